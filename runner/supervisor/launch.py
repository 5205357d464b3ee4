"""What an attempt is started with: its command line, its environment, its id.

The child's environment is the supervisor's own plus the ``CKRUN_*`` contract the
library reads (:meth:`ckrun.Checkpointer.from_env`, :mod:`ckrun.control`):
``CKRUN_RUN``, ``CKRUN_ATTEMPT``, ``CKRUN_STORAGE`` (the run root), ``CKRUN_CONTROL_DIR``,
``CKRUN_GRACE_S``, ``CKRUN_NOTICE_SIGNAL``, ``CKRUN_CONFIG_HASH``, ``CKRUN_ALLOW_CHANGE``,
``CKRUN_SUPERVISOR_PID`` (the library saves and stops when that process is gone),
``CKRUN_RESUME_STEP`` and the storage profile's keys.
"""

from __future__ import annotations

import os

from ckrun.config import RunConfig, is_local_storage, storage_env
from ckrun.scheduler.base import JobInfo
from ckrun.storage.base import Storage
from ckrun.supervisor.rundir import RunDir


def child_env(
    cfg: RunConfig,
    rundir: RunDir,
    attempt: int,
    resume_step: int | None,
    lease_epoch: int | None = None,
) -> dict[str, str]:
    """The complete environment of attempt ``attempt`` (see the module docstring);
    ``lease_epoch`` (``CKRUN_LEASE_EPOCH``) fences the child's commits when the run is
    owned through a lease (DESIGN.md §7)."""
    env = dict(os.environ)
    env.pop("CKRUN_RESUME_STEP", None)
    env.pop("CKRUN_LEASE_EPOCH", None)
    root = cfg.run_root
    if is_local_storage(root):
        root = os.path.abspath(root.removeprefix("file://"))
    env.update(
        CKRUN_RUN=cfg.run,
        CKRUN_ATTEMPT=str(attempt),
        CKRUN_STORAGE=root,
        CKRUN_CONTROL_DIR=rundir.control_dir,
        CKRUN_GRACE_S=f"{cfg.grace_s:g}",
        CKRUN_NOTICE_SIGNAL=cfg.signal_number().name,
        CKRUN_CONFIG_HASH=cfg.launch_hash(),
        CKRUN_ALLOW_CHANGE=",".join(cfg.allow_change),
        CKRUN_SUPERVISOR_PID=str(os.getpid()),
    )
    env.update(storage_env(cfg))  # endpoint_url, s3_* from the profile
    if resume_step is not None:
        env["CKRUN_RESUME_STEP"] = str(resume_step)
    if lease_epoch is not None:
        env["CKRUN_LEASE_EPOCH"] = str(lease_epoch)
    return env


def command(cfg: RunConfig, job: JobInfo | None) -> tuple[str, ...]:
    """The command to spawn: under torchrun with ``nproc_per_node``/``nnodes`` > 1
    (:func:`ckrun.supervisor.torchrun.wrap`)."""
    from ckrun.supervisor import torchrun

    return torchrun.wrap(
        cfg.command,
        nproc_per_node=cfg.nproc_per_node,
        nnodes=cfg.nnodes,
        node_rank=job.rank if job else 0,
        grace_s=cfg.grace_s,
    )


def prior_attempts(rundir: RunDir, storage: Storage) -> int:
    """Attempts already made in this run (events and manifests), so ids never repeat."""
    from ckrun.runlog import read_events
    from ckrun.supervisor.preflight import newest_attempt

    seen = [
        int(e.get("attempt", 0)) + 1
        for e in read_events(rundir.events_path)
        if e.get("kind") == "spawn"
    ]
    last = newest_attempt(storage)
    return max([0, *seen, (last + 1) if last is not None else 0])
