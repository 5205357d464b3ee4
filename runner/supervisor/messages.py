"""Events and actions of the supervisor's state machine (:mod:`ckrun.supervisor.machine`).

Events carry what happened (with ``now``, ``time.monotonic()`` seconds); actions say
what the loop in :mod:`ckrun.supervisor.loop` must do.  All are frozen dataclasses, so a
scripted history of :func:`ckrun.supervisor.machine.step` calls is a plain table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckrun.enums import StrEnum


class PreflightOutcome(StrEnum):
    """What preflight found (:mod:`ckrun.supervisor.preflight`)."""

    READY = "ready"  # start an attempt (resuming ``step``, or from scratch)
    COMPLETE = "complete"  # the run has its completion marker
    INCOMPATIBLE = "incompatible"  # the newest checkpoint refuses this launch
    CANCELLED = "cancelled"  # `ckrun cancel` happened


class RequeueResult(StrEnum):
    """The scheduler's answer to a requeue (:meth:`ckrun.scheduler.base.Scheduler.requeue`)."""

    RESTART_HERE = "restart_here"  # the supervisor starts the next attempt itself
    REQUEUED = "requeued"  # the scheduler starts the next attempt; this one exits
    FAILED = "failed"  # the requeue raised, or no job of this scheduler


# ---------------------------------------------------------------- events
@dataclass(frozen=True)
class Preflighted:
    """Preflight result (a :class:`PreflightOutcome`, with the step, refusing diff and
    a line for the log)."""

    outcome: PreflightOutcome
    step: int | None = None
    diff: tuple[str, ...] = ()
    detail: str = ""
    now: float = 0.0


@dataclass(frozen=True)
class SpawnFailed:
    """The command could not be executed."""

    error: str
    now: float = 0.0


@dataclass(frozen=True)
class ChildExited:
    """The attempt's child was reaped and its session is empty.

    Attributes:
        status: shell-style exit status (128+N for signal N).
        newest_step: newest committed step in storage now (None: none).
        complete: a valid COMPLETE.json exists now.
        save_s: the newest checkpoint's own save duration (manifest), seconds.
        reason: the exit-reason record the library wrote before exiting
            (:func:`ckrun.control_files.read_exit_reason`: ``preempted``, ``incompatible``,
            ``config_invalid``, ``storage_full``, ``storage_denied``,
            ``checkpoints_unusable``), None without one.
            Only a record makes an exit 3/4/5 ckrun's and a status 0 a preemption.
        detail: the record's message.
    """

    status: int
    newest_step: int | None = None
    complete: bool = False
    now: float = 0.0
    save_s: float | None = None
    reason: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class LeaderExited:
    """The command's own process was reaped but processes of its session are left.

    Fed every round until the session is empty (then :class:`ChildExited` follows).

    Attributes:
        status: the command's exit status.
        saving: a process that was sent the notice signal is still alive (it may be
            writing the emergency checkpoint): the notice deadline applies, not the
            stray timer.
    """

    status: int
    now: float = 0.0
    saving: bool = False


@dataclass(frozen=True)
class Delivered:
    """Result of :class:`Deliver`: how many processes were sent the notice signal."""

    count: int
    now: float = 0.0


@dataclass(frozen=True)
class Interrupt:
    """SIGINT (Ctrl-C in the foreground): a save-and-stop notice; twice stops at once."""

    now: float = 0.0


@dataclass(frozen=True)
class NoticeEvent:
    """A notice: ``deadline`` is monotonic seconds (capped by grace in :func:`step`)."""

    kind: str
    source: str
    deadline: float
    now: float = 0.0
    self_term: bool = False
    cancel: bool = False
    lease_lost: bool = False


@dataclass(frozen=True)
class Forward:
    """HUP or QUIT for the child's group."""

    sig: int
    now: float = 0.0


@dataclass(frozen=True)
class Tick:
    """Time passes."""

    now: float


@dataclass(frozen=True)
class Requeued:
    """The scheduler's answer to the requeue (a :class:`RequeueResult`)."""

    outcome: RequeueResult
    detail: str = ""
    now: float = 0.0


Event = (
    Preflighted
    | SpawnFailed
    | ChildExited
    | LeaderExited
    | Delivered
    | Interrupt
    | NoticeEvent
    | Forward
    | Tick
    | Requeued
)


# ---------------------------------------------------------------- actions
@dataclass(frozen=True)
class RunPreflight:
    """Run preflight and feed back :class:`Preflighted`."""


@dataclass(frozen=True)
class Spawn:
    """Start attempt ``attempt`` (resuming from ``resume_step``)."""

    attempt: int
    resume_step: int | None


@dataclass(frozen=True)
class WriteNotice:
    """Write ``notice.json`` with a deadline ``seconds_left`` from now."""

    kind: str
    source: str
    seconds_left: float


@dataclass(frozen=True)
class Deliver:
    """Send the notice signal to the child's processes that catch it; feed back
    :class:`Delivered`."""


@dataclass(frozen=True)
class SignalGroup:
    """Send ``sig`` to the child's process group / session."""

    sig: int


@dataclass(frozen=True)
class Escalate:
    """Write the escalation marker, then TERM the child's session."""


@dataclass(frozen=True)
class Kill:
    """KILL everything left in the child's session."""


@dataclass(frozen=True)
class Persist:
    """Write the run's budgets (:mod:`ckrun.supervisor.budgets`) with the run."""


@dataclass(frozen=True)
class Requeue:
    """Ask the scheduler for the next attempt; feed back :class:`Requeued`."""


@dataclass(frozen=True)
class Log:
    """Print ``message`` (``[ckrun]`` prefixed) and append event ``kind`` with ``fields``."""

    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Exit:
    """The supervisor exits with ``code``."""

    code: int


Action = (
    RunPreflight
    | Spawn
    | WriteNotice
    | Deliver
    | SignalGroup
    | Escalate
    | Kill
    | Persist
    | Requeue
    | Log
    | Exit
)
