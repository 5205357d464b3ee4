"""The ``Scheduler`` protocol (DESIGN.md §3 "Scheduler") shared by local, Slurm and k8s.

Ownership: each backend lives in its own module (``scheduler/local.py``,
``scheduler/slurm.py``, ``scheduler/k8s.py``) and defines

* a frozen ``Options`` dataclass with its backend-specific profile keys (``partition``,
  ``image``, ...), each with a default; ``config.py`` validates the flat profile YAML by
  giving common keys to ``RunConfig`` and the rest to the selected backend's ``Options``
  (unknown keys rejected with the valid list);
* a class implementing :class:`Scheduler`, registered in :data:`BACKENDS` below by name.

``render`` has no side effects (golden-tested); ``cancel`` is idempotent; ``PREEMPTED`` is
its own state, never folded into ``FAILED``.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ckrun.notices import NoticeSource


class JobState(str, enum.Enum):
    """Scheduler-neutral job states."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    REQUEUED = "REQUEUED"
    PREEMPTED = "PREEMPTED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    UNKNOWN = "UNKNOWN"


class RequeueOutcome(str, enum.Enum):
    """What :meth:`Scheduler.requeue` did.

    ``RESTART_HERE``: the supervisor itself must start the next attempt (local backend).
    ``REQUEUED``: the scheduler will start a new attempt; the supervisor exits 75/76.
    """

    RESTART_HERE = "restart_here"
    REQUEUED = "requeued"


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to render and submit one run.

    Attributes:
        run: run name (also the job name).
        command: the training command, argv form.
        storage: storage URL of the run root (``<storage>/<run>``).
        options: the backend's frozen ``Options`` instance.
        env: extra environment for the job.
        supervisor_args: extra ``ckrun run`` arguments (``--grace``, ``--max-requeues``...).
        nnodes: nodes of the job, one supervisor each (``--nnodes``); the k8s backend
            renders one pod per node.
        nproc_per_node: processes per node (``--nproc-per-node``).
    """

    run: str
    command: tuple[str, ...]
    storage: str
    options: Any = None
    env: dict[str, str] = field(default_factory=dict)
    supervisor_args: tuple[str, ...] = ()
    nnodes: int = 1
    nproc_per_node: int = 1

    @property
    def storage_base(self) -> str:
        """The storage base given at submit (``--storage``): :attr:`storage` without
        its ``/<run>``, as commands that take a run want it."""
        tail = "/" + self.run
        return self.storage[: -len(tail)] if self.storage.endswith(tail) else self.storage


@dataclass(frozen=True)
class JobInfo:
    """The job a supervisor runs in (from the environment), or a submitted job.

    Attributes:
        backend: ``"local"``, ``"slurm"`` or ``"k8s"``.
        job_id: scheduler job id (Slurm: ``ARRAYJOB_TASK`` for array tasks).
        attempt: 0 on the first run, then 1, 2, ... (Slurm ``SLURM_RESTART_COUNT``).
        rank: node / process rank of this supervisor (0 requeues).
        time_limit_end_utc: ISO-8601 UTC end of the allocation, when known.
        detail: backend-specific fields.
    """

    backend: str
    job_id: str
    attempt: int = 0
    rank: int = 0
    time_limit_end_utc: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Scheduler(Protocol):
    """A place runs are submitted to and requeued by."""

    name: str

    def render(self, spec: JobSpec) -> str:
        """The exact submission artefact (sbatch script, Job YAML, command line)."""
        ...

    def submit(self, spec: JobSpec) -> str:
        """Submit and return the job id. Raises ``SchedulerError``."""
        ...

    def status(self, job_id: str) -> JobState:
        """The scheduler's view of ``job_id``."""
        ...

    def cancel(self, job_id: str) -> None:
        """Cancel ``job_id``; idempotent."""
        ...

    def current(self) -> JobInfo | None:
        """The job this process runs in, or None when not inside one of this backend's."""
        ...

    def requeue(self, job: JobInfo) -> RequeueOutcome:
        """Arrange the next attempt after a verified commit.

        Call only once everything is durable (Slurm signals the caller ~13 ms after
        ``scontrol requeue`` returns). Raises ``RequeueError`` (exit 6).
        """
        ...

    def notice_sources(self, job: JobInfo | None) -> list[NoticeSource]:
        """Backend-specific notice sources (e.g. Slurm's time-limit watcher)."""
        ...


#: backend name -> "module:Class"; modules are imported lazily.
BACKENDS: dict[str, str] = {
    "local": "ckrun.scheduler.local:LocalScheduler",
    "slurm": "ckrun.scheduler.slurm:SlurmScheduler",
    "k8s": "ckrun.scheduler.k8s:K8sScheduler",
}


def backend_module(name: str) -> Any:
    """The module implementing backend ``name`` (it defines ``Options``)."""
    from ckrun.errors import ConfigError

    if name not in BACKENDS:
        raise ConfigError(f"unknown scheduler {name!r}; valid: {', '.join(sorted(BACKENDS))}")
    return importlib.import_module(BACKENDS[name].split(":")[0])


def get_scheduler(name: str, **kwargs: Any) -> Scheduler:
    """Instantiate backend ``name``. Raises ``ConfigError`` for an unknown name."""
    mod = backend_module(name)
    cls = getattr(mod, BACKENDS[name].split(":")[1])
    return cls(**kwargs)  # type: ignore[no-any-return]
