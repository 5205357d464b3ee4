"""The Slurm job script: the supervisor's command line, the sbatch parameters, the script
as submitit renders it, and its submission (DESIGN.md §6).

Each task of the job runs the ckrun supervisor (``ckrun run --run NAME --storage BASE
-- CMD``), never submitit's pickled-function runner, so submitit's in-job signal handling
(its USR2 handler, its own ``scontrol requeue`` and ``max_num_timeout``) never runs.
submitit renders the sbatch script (``_make_sbatch_string``: the same text ``--dry-run``
prints and :func:`submit_script` hands to ``sbatch``) and parses the job id.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
from typing import Any

from ckrun.errors import ConfigError, SchedulerError
from ckrun.scheduler.base import JobSpec
from ckrun.scheduler.slurm_jobs import storage_base
from ckrun.scheduler.slurm_options import Options

#: environment variables the rendered script exports (config.py's ``CKRUN_<KEY>`` names),
#: so the supervisor in the job uses the lead time and notice signal Slurm was told.
LEAD_ENV = "CKRUN_LEAD_S"
SIGNAL_ENV = "CKRUN_NOTICE_SIGNAL"
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def supervisor_command(spec: JobSpec, o: Options) -> str:
    """The shell-quoted ``ckrun run --run NAME --storage BASE [ARGS] -- CMD`` line.

    ``BASE`` is ``spec.storage`` (the run root ``BASE/NAME``) less ``/NAME``, unless
    ``spec.supervisor_args`` already gives ``--storage``.
    """
    argv = [*shlex.split(o.launcher), "run", "--run", spec.run]
    if "--storage" not in spec.supervisor_args:
        argv += ["--storage", storage_base(spec.storage, spec.run)]
    argv += [*spec.supervisor_args, "--", *spec.command]
    return shlex.join(argv)


def sbatch_params(spec: JobSpec, o: Options) -> dict[str, Any]:
    """submitit's ``_make_sbatch_string`` keyword arguments for ``spec`` under ``o``.

    Raises:
        ConfigError: no command, or an environment name that is not a shell variable.
    """
    if not spec.command:
        raise ConfigError("no training command given: ckrun submit TRAIN.py ...")
    prefix = "" if o.use_srun else "B:"
    extra: dict[str, Any] = {"signal": f"{prefix}{o.signal}@{o.lead_s}", "time": o.time}
    extra["requeue" if o.requeue else "no_requeue"] = True
    extra.update(o.sbatch_extra_params())
    setup = [f"export {LEAD_ENV}={o.lead_s}", f"export {SIGNAL_ENV}=SIG{o.signal}"]
    for key in sorted(spec.env):
        if not ENV_KEY_RE.match(key):
            raise ConfigError(f"environment name {key!r} is not a valid shell variable name")
        setup.append(f"export {key}={shlex.quote(spec.env[key])}")
    setup += list(o.setup)
    params: dict[str, Any] = {
        "job_name": spec.run, "partition": o.partition, "nodes": o.nodes,
        "ntasks_per_node": 1, "gpus_per_node": o.gpus_per_node,
        "cpus_per_task": o.cpus_per_task, "mem": o.mem, "account": o.account,
        "qos": o.qos, "wckey": o.wckey, "setup": setup, "use_srun": o.use_srun,
        "additional_parameters": extra,
    }  # fmt: skip
    if o.use_srun and o.cpus_per_task:
        # Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task (release
        # notes 22.05): without this the supervisor and the training get one CPU.
        params["srun_args"] = [f"--cpus-per-task={o.cpus_per_task}"]
    return params


def render_script(spec: JobSpec, o: Options) -> str:
    """The exact sbatch script :func:`submit_script` hands to ``sbatch`` (no side effects).

    Rendered by submitit's ``_make_sbatch_string`` with the supervisor as the
    command: ``srun ... ckrun run ...`` (``use_srun``) or ``exec ckrun run ...``.

    Raises:
        ConfigError: no command, a bad environment name, ``spec.env`` setting a
            different ``CKRUN_NOTICE_SIGNAL`` than the one Slurm will send.
    """
    from submitit.slurm.slurm import _make_sbatch_string  # lazy: heavy import

    wanted = spec.env.get(SIGNAL_ENV, "").upper().removeprefix("SIG")
    if wanted and wanted != o.signal:
        raise ConfigError(
            f"notice signal {wanted} differs from the signal Slurm sends ({o.signal}): "
            "set the slurm profile's signal and notice_signal to the same value"
        )
    env = {k: v for k, v in spec.env.items() if k != SIGNAL_ENV}
    spec = dataclasses.replace(spec, env=env)
    command = supervisor_command(spec, o)
    if not o.use_srun:
        command = "exec " + command
    folder = os.path.abspath(o.log_dir)
    text: str = _make_sbatch_string(command=command, folder=folder, **sbatch_params(spec, o))
    return text


def submit_script(spec: JobSpec, o: Options, path: str) -> str:
    """Submit :func:`render_script`'s script through submitit's executor; returns the
    Slurm job id.  ``path`` is the ``PATH`` to find ``sbatch`` on.

    Raises:
        SchedulerError: ``sbatch``/``srun`` missing, or ``sbatch`` refused the job
            (its message is included).
    """
    script = render_script(spec, o)
    if shutil.which("sbatch", path=path) is None:
        raise SchedulerError(
            "sbatch not found on PATH: submit from a Slurm login node, or use "
            "--dry-run to print the script and submit it with sbatch yourself"
        )
    folder = os.path.abspath(o.log_dir)
    os.makedirs(folder, exist_ok=True)
    try:
        executor = script_executor(folder, script, o.nodes)
        job = executor._submit_command(supervisor_command(spec, o))
    except Exception as exc:  # submitit raises RuntimeError/FailedJobError/OSError
        raise SchedulerError(
            f"sbatch refused the job: {exc}; check partition/account/qos/time in the "
            f"profile (the script is printed by `ckrun submit --dry-run`)"
        ) from exc
    return str(job.job_id)


def script_executor(folder: str, script: str, nodes: int) -> Any:
    """A submitit ``SlurmExecutor`` whose submission file is ``script`` verbatim."""
    import submitit

    class _Executor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return script

        def _num_tasks(self) -> int:
            return nodes

    return _Executor(folder=folder)
