"""What the CLI's ``submit``, ``run``, ``cancel`` and ``preempt`` do (no click here).

``submit`` resolves the config, freezes it in ``run.json`` (refusing a different launch
of an existing run unless ``--allow-change launch_hash``), then runs the supervisor in
the foreground (local profile), starts a detached one (``--detach``), or hands a
:class:`~ckrun.scheduler.base.JobSpec` to another backend's ``submit``.  ``run`` is the
supervisor alone: the frozen ``run.json`` is the truth; the command line may only add
``--allow-change`` fields.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import shlex
from collections.abc import Mapping
from typing import Any

from ckrun.cli.locate import (
    STATE_POINTER,
    absolute_paths,
    detect_backend,
    hint,
    locate,
    located_config,
    relocated,
    run_storage,
    scheduler_for,
)
from ckrun.cli.requests import cancel, preempt
from ckrun.cli.suggest import check_script
from ckrun.config import (
    RunConfig,
    build_notice_sources,
    check_run_name,
    is_local_storage,
    resolve,
)
from ckrun.errors import (
    CkrunError,
    ExitCode,
    IncompatibleCheckpoint,
    RunLocked,
    UsageError,
)
from ckrun.notices import iso_utc, utcnow
from ckrun.scheduler.base import JobSpec
from ckrun.storage.fsutil import write_json_atomic
from ckrun.supervisor.budgets import RunDirBudgets
from ckrun.supervisor.rundir import (
    RunDir,
)

#: ``cancel``, ``preempt`` (:mod:`ckrun.cli.requests`) and the run-finding helpers
#: (:mod:`ckrun.cli.locate`) are re-exported: ``ckrun.cli.commands.cancel`` etc. keep working.
__all__ = [
    "STATE_POINTER", "absolute_paths", "cancel", "default_run_name", "detect_backend",
    "hint", "job_env", "launch_diff", "locate", "located_config", "preempt", "reconcile",
    "relocated", "remember_state_root", "run", "run_storage", "say", "scheduler_for",
    "submit", "supervise",
]  # fmt: skip


def say(msg: str) -> None:
    """Print a ``[ckrun]`` line on stderr."""
    import sys

    print(f"[ckrun] {msg}", file=sys.stderr, flush=True)


def default_run_name(command: tuple[str, ...]) -> str:
    """``<script stem>-<UTC yyyymmdd-HHMMSS>``: the first ``*.py`` argument, else argv[0]."""
    import re

    script = next((a for a in command if a.endswith(".py")), command[0] if command else "run")
    stem = os.path.splitext(os.path.basename(script))[0]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).lstrip(".-") or "run"
    return f"{stem}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}"


def launch_diff(old: RunConfig, new: RunConfig) -> list[str]:
    """Readable differences of the launch identity (empty when the same)."""
    if old.launch_hash() == new.launch_hash():
        return []
    return [
        f"launch_hash: {old.launch_hash()} → {new.launch_hash()}",
        f"command: {shlex.join(old.command)} → {shlex.join(new.command)}",
        *(
            [f"world_size: {old.world_size} → {new.world_size}"]
            if old.world_size != new.world_size
            else []
        ),
    ]


def reconcile(frozen: RunConfig | None, cfg: RunConfig) -> RunConfig:
    """``cfg`` if it may replace the frozen config.

    Raises:
        IncompatibleCheckpoint: the launch identity differs (exit 4) and
            ``launch_hash`` is not in ``--allow-change``.
    """
    if frozen is None:
        return cfg
    diff = launch_diff(frozen, cfg)
    if diff and "launch_hash" not in cfg.allow_change:
        raise IncompatibleCheckpoint(
            f"run {cfg.run!r} was frozen with a different launch in run.json; use another "
            "--run, or --allow-change launch_hash to continue it with this command",
            diff=diff,
        )
    return cfg


def remember_state_root(cfg: RunConfig) -> None:
    """Leave a pointer (:data:`STATE_POINTER`) where :func:`locate` looks for run
    ``cfg.run`` under ``cfg.storage`` when a profile's ``state_dir`` keeps its state
    elsewhere (the k8s profile: ``./ckrun-state``), so ``ckrun status|logs|cancel NAME
    --storage S`` work as pasted from any directory.  Remote storage only: its default
    state directory is this machine's own cache; a local storage's is the run root.

    A pointer that cannot be written is reported, never fatal.
    """
    if is_local_storage(cfg.storage):
        return
    default = located_config(cfg.run, cfg.storage).state_root
    here = os.path.abspath(cfg.state_root)
    if os.path.abspath(default) == here:
        return
    try:
        os.makedirs(default, exist_ok=True)
        write_json_atomic(os.path.join(default, STATE_POINTER), {"state_root": here})
    except OSError as e:  # the run works without it; only NAME --storage lookups miss it
        say(
            f"note: cannot write {default} ({e.strerror}): commands that take run "
            f"{cfg.run!r} find it only with CKRUN_STATE_DIR={os.path.dirname(here)}"
        )


def supervise(
    cfg: RunConfig,
    run_name: str,
    backend: str | None = None,
    *,
    frozen: RunConfig | None = None,
    wait_for_lease: tuple[float, str] | None = None,
) -> int:
    """Lock the run (per node rank), freeze ``cfg`` if it changed, run the supervisor loop.

    ``wait_for_lease`` (seconds, source) applies to this invocation only (never frozen).

    Returns:
        The supervisor's exit code.

    Raises:
        RunLocked: another live supervisor of this rank holds the run.
    """
    from ckrun.supervisor.loop import Supervisor

    sched = scheduler_for(backend or detect_backend(), cfg)
    job = sched.current()
    rundir = RunDir(cfg.state_root, rank=job.rank if job is not None else 0)
    with rundir.lock(run_name) as lock:
        if cfg != frozen and rundir.rank == 0:
            rundir.freeze(cfg)
        if wait_for_lease is not None:
            origin = {**cfg.sources, "wait_for_lease_s": wait_for_lease[1]}
            cfg = dataclasses.replace(cfg, wait_for_lease_s=wait_for_lease[0], sources=origin)
        sources = list(sched.notice_sources(job)) + build_notice_sources(cfg)
        return int(Supervisor(cfg, rundir, sched, job, sources, lock=lock).run())


def job_env(cfg: RunConfig) -> dict[str, str]:
    """``CKRUN_<KEY>`` for every value given on the command line or in the environment
    at submit time, so the job's own ``ckrun run`` (a pod or a fresh VM without the
    submitter's ``run.json``) resolves the same configuration; profile values travel as
    ``--profile``.  Backend options (image, partition, ...) shape the job itself and stay
    out; the storage base travels as ``--storage``."""
    from ckrun.config import common_keys, env_name

    skip = {"storage", "state_dir", "scheduler"}
    backend = {f.name for f in dataclasses.fields(cfg.options)} if cfg.options else set()
    out: dict[str, str] = {}
    for key, src in cfg.sources.items():
        if key in skip or key in backend or not (src == "cli" or src.startswith("env:")):
            continue
        value = getattr(cfg, key) if key in common_keys() else cfg.cloud.get(key)
        if value is None:
            continue
        out[env_name(key)] = (
            ",".join(map(str, value))
            if isinstance(value, (tuple, list))
            else f"{value:g}"
            if isinstance(value, float)
            else str(value)
        )
    return out


def submit(
    profile: str,
    cli: Mapping[str, Any],
    command: tuple[str, ...],
    run_name: str | None,
    *,
    detach: bool = False,
    dry_run: bool = False,
    show_config: bool = False,
) -> int:
    """``ckrun submit`` (see the module docstring); returns the exit code.

    With ``dry_run`` only the job (the sbatch script, the Job YAML, or the local command
    line) goes to stdout, so it pipes into ``sbatch`` or ``kubectl apply -f -``; the
    resolved configuration precedes it only with ``show_config``."""
    name = default_run_name(command) if run_name is None else check_run_name(run_name)
    cfg = absolute_paths(resolve(profile, cli, run=name, command=command))
    local = cfg.scheduler == "local"
    if local and not dry_run:
        check_script(command)
    rundir = _submit_state(cfg)
    sched = scheduler_for(cfg.scheduler, cfg)
    args: list[str] = ["--storage", cfg.storage, "--profile", profile]
    for f in cfg.allow_change:
        args += ["--allow-change", f]
    env = {} if local else job_env(cfg)
    if local and rundir is not None:
        env["CKRUN_SUPERVISOR_LOG"] = rundir.log_path
    if cfg.state_dir:
        env["CKRUN_STATE_DIR"] = cfg.state_dir
    spec = JobSpec(
        run=name,
        command=command,
        storage=cfg.run_root,
        options=cfg.options,
        env=env,
        supervisor_args=tuple(args),
        nnodes=cfg.nnodes,
        nproc_per_node=cfg.nproc_per_node,
    )
    if dry_run:
        import json

        artifact = sched.render(spec)
        if show_config:
            print(json.dumps(cfg.to_json(), indent=1, default=str))
        print(artifact, flush=True)
        say(
            f"dry run of run {name} ({cfg.scheduler}): nothing started"
            + ("" if show_config else "; --show-config prints the resolved configuration")
        )
        return 0
    if rundir is None:  # remote storage, no local state dir: the job keeps its own
        job_id = sched.submit(spec)
        say(f"run {name}: submitted to {cfg.scheduler} as job {job_id}")
        return 0
    cfg = reconcile(rundir.load_config(), cfg)
    holder = rundir.live_holder()
    if holder is not None:
        raise RunLocked(
            f"run {name!r} is alive: supervisor pid {holder.get('pid')} on "
            f"{holder.get('host')} holds it; `{hint('status', name, cfg.storage)}`",
            holder=holder,
        )
    if os.path.exists(rundir.cancelled_path):
        os.unlink(rundir.cancelled_path)
    before = rundir.load_config()
    budgets = RunDirBudgets(rundir.root)
    spent = budgets.load()
    rundir.freeze(cfg)
    remember_state_root(cfg)
    budgets.reset()  # a new submission: fresh budgets (before its job can start)
    say(f"run {name}: storage {cfg.run_root}, profile {profile}")
    if local and not detach:
        rc = supervise(cfg, name, "local", frozen=cfg)
        if rc == ExitCode.INCOMPATIBLE and before is not None and launch_diff(before, cfg):
            # the checkpoint refused this launch: the run stays what it was, so the
            # original command (what the refusal tells the user to restore) still runs
            rundir.freeze(before)
            say(f"run {name}: run.json keeps its previous launch (the checkpoint refused this one)")
        return rc
    try:
        job_id = sched.submit(spec)
    except CkrunError:  # refused: leave the run as it was (no new frozen run.json)
        if before is None:
            os.unlink(rundir.run_json)
        else:
            rundir.freeze(before)
            budgets.save(spent)
        raise
    files = getattr(sched, "log_files", None)
    write_json_atomic(
        rundir.job_json,
        {
            "backend": cfg.scheduler,
            "job_id": job_id,
            "submitted_utc": iso_utc(utcnow()),
            "log_files": list(files(spec, job_id)) if callable(files) else [],
        },
    )
    from ckrun.runlog import EventLog

    EventLog(rundir.events_path, name).append("submitted", backend=cfg.scheduler, job_id=job_id)
    where = f", log {rundir.log_path}" if local else ""
    say(f"run {name}: submitted to {cfg.scheduler} as job {job_id}{where}")
    say(
        f"follow it: `{hint('logs', name, cfg.storage, '-f')}`; "
        f"`{hint('status', name, cfg.storage)}`"
    )
    return 0


def _submit_state(cfg: RunConfig) -> RunDir | None:
    """The local state dir of a submission; None for another backend with remote storage
    and no ``state_dir`` (run.json then lives only where the job runs).  The local
    backend with remote storage uses the default cache (:func:`default_state_dir`)."""
    if cfg.scheduler != "local" and not cfg.state_dir and not is_local_storage(cfg.storage):
        return None
    return RunDir(cfg.state_root)


def run(
    run_name: str,
    cli: Mapping[str, Any],
    command: tuple[str, ...],
    *,
    profile: str | None = None,
    scheduler: str | None = None,
) -> int:
    """``ckrun run``: the supervisor alone, for run ``run_name``; returns the exit code."""
    check_run_name(run_name)
    base = absolute_paths(resolve(profile or "local", cli, run=run_name, command=command))
    rundir = RunDir(base.state_root)
    frozen = rundir.load_config()
    if frozen is None:
        if not command:
            raise UsageError(
                f"run {run_name!r} has no run.json under {base.storage}: give "
                "the command after `--`"
            )
        cfg = base
    else:
        allow = tuple(dict.fromkeys((*frozen.allow_change, *cli.get("allow_change", ()))))
        storage, state_dir = relocated(frozen, base, given="storage" in cli)
        cfg = dataclasses.replace(
            frozen,
            command=command or frozen.command,
            allow_change=allow,
            storage=storage,
            state_dir=state_dir,
        )
        cfg = reconcile(frozen, cfg)
    src = base.sources.get("wait_for_lease_s", "default")
    wait = (base.wait_for_lease_s, src) if src != "default" else None
    return supervise(cfg, run_name, scheduler, frozen=frozen, wait_for_lease=wait)
