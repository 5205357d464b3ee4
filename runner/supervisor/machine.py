"""The supervisor's pure state machine: ``step(state, event) -> (state, actions)``.

DESIGN.md §4.5.  No I/O, no clock, no processes: time arrives inside events as
``now`` (``time.monotonic()`` seconds), and everything the supervisor must *do* leaves as
:class:`Action` values that :mod:`ckrun.supervisor.loop`'s loop executes.  Each row of the
§4.5 table is a unit test of :func:`step` (``tests/supervisor/test_statemachine.py``).

Phases::

    PREFLIGHT → RUNNING → DRAINING → STOPPING → COMPLETED | ALREADY_COMPLETE |
    INCOMPATIBLE | FAILED | PREEMPTED | REQUEUE_FAILED | CANCELLED

Two refinements of the table, both deliberate:

* ``STOPPING`` + kill delay passes sends KILL and *stays* in ``STOPPING`` until the child
  is reaped (KILL cannot be ignored, so that is milliseconds); the ``PREEMPTED`` step
  then has the real exit status and the storage check after the child is gone.
* ``PREEMPTED`` waits for the :class:`Requeued` outcome of the scheduler: restart here
  (local backend → ``PREFLIGHT`` of the next attempt), requeued (exit 75/76) or failed
  (``REQUEUE_FAILED``, exit 6).  A SIGTERM aimed at the supervisor itself is never
  answered by restarting in the same process: the supervisor is being stopped.

Restart policy (DESIGN.md §3): preemptions count against ``max_requeues``; failures of
the user's command against ``max_failures``; ``crash_loop_failures`` consecutive failures
without checkpoint progress stop the run (crash-loop guard).  The restart delay after the
n-th failure is ``min(backoff_max_s, backoff_s * 2**(n-1))`` seconds.
"""

from __future__ import annotations

import dataclasses
import enum
import signal
from dataclasses import dataclass, field
from typing import Any

from ckrun.errors import ExitCode
from ckrun.supervisor.messages import (  # re-exported: the machine's vocabulary
    Action,
    ChildExited,
    Deliver,
    Escalate,
    Event,
    Exit,
    Forward,
    Kill,
    Log,
    NoticeEvent,
    Preflighted,
    PreflightOutcome,
    Requeue,
    Requeued,
    RequeueResult,
    RunPreflight,
    SignalGroup,
    Spawn,
    SpawnFailed,
    Tick,
    WriteNotice,
)

_TERMINATED_BY_TERM = 128 + int(signal.SIGTERM)


class Phase(str, enum.Enum):
    """Supervisor phases (DESIGN.md §4.5)."""

    PREFLIGHT = "PREFLIGHT"
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    STOPPING = "STOPPING"
    COMPLETED = "COMPLETED"
    ALREADY_COMPLETE = "ALREADY_COMPLETE"
    INCOMPATIBLE = "INCOMPATIBLE"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"
    REQUEUE_FAILED = "REQUEUE_FAILED"
    CANCELLED = "CANCELLED"


@dataclass(frozen=True)
class Policy:
    """Limits and timings (seconds) from the RunConfig."""

    max_requeues: int = 100
    max_failures: int = 3
    crash_loop_failures: int = 2
    grace_s: float = 60.0
    margin_s: float = 2.0
    kill_delay_s: float = 10.0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0


@dataclass(frozen=True)
class State:
    """Supervisor state; times are monotonic seconds.

    Attributes:
        attempt: attempts started so far in this run (the next attempt's 0-based id).
        base_step: newest committed step when the current attempt started (None: none).
        child: a child of the current attempt is alive (not yet reaped).
        notice_at / deadline / kill_at: drain start, TERM-at (before margin), KILL-at.
        self_term: the supervisor itself got SIGTERM, or a notice source said this
            machine goes away (cloud, scheduler): never restart in place.
        interrupted: INT/HUP/QUIT forwarded to the child (it is being stopped by the user).
    """

    policy: Policy = field(default_factory=Policy)
    phase: Phase = Phase.PREFLIGHT
    attempt: int = 0
    failures: int = 0
    preemptions: int = 0
    no_progress: int = 0
    base_step: int | None = None
    child: bool = False
    notice_kind: str | None = None
    notice_source: str | None = None
    notice_at: float | None = None
    deadline: float | None = None
    kill_at: float | None = None
    killed: bool = False
    respawn_at: float | None = None
    cancel: bool = False
    self_term: bool = False
    interrupted: int | None = None
    pending_code: int | None = None
    exit_code: int | None = None
    why: str = ""

    @property
    def terminal(self) -> bool:
        """The run is over for this supervisor: a phase of :data:`TERMINAL`, or the exit
        code decided (a PREEMPTED run the scheduler requeued).  The machine ignores
        every later event and the loop returns :attr:`exit_code`."""
        return self.phase in TERMINAL or self.exit_code is not None


Result = tuple["State", list[Action]]

__all__ = [
    "Phase",
    "Policy",
    "State",
    "TERMINAL",
    "step",
    "PreflightOutcome",
    "Preflighted",
    "SpawnFailed",
    "ChildExited",
    "NoticeEvent",
    "Forward",
    "Tick",
    "Requeued",
    "RequeueResult",
    "Event",
    "RunPreflight",
    "Spawn",
    "WriteNotice",
    "Deliver",
    "SignalGroup",
    "Escalate",
    "Kill",
    "Requeue",
    "Log",
    "Exit",
    "Action",
    "Result",
]

TERMINAL = frozenset(
    {
        Phase.COMPLETED,
        Phase.ALREADY_COMPLETE,
        Phase.INCOMPATIBLE,
        Phase.FAILED,
        Phase.REQUEUE_FAILED,
        Phase.CANCELLED,
    }
)


def _r(s: State, **kw: Any) -> State:
    return dataclasses.replace(s, **kw)


def _stop(s: State, phase: Phase, code: int, kind: str, msg: str, **f: Any) -> Result:
    s = _r(s, phase=phase, exit_code=code, why=msg, child=False)
    return s, [Log(kind, msg, dict(f, exit_code=code)), Exit(code)]


def _newer(step: int | None, base: int | None) -> bool:
    return step is not None and (base is None or step > base)


def step(s: State, ev: Event) -> Result:
    """Advance the machine by one event. Pure: same input, same output.

    Returns:
        The new state and the actions to execute, in order.
    """
    if s.terminal:
        return s, []
    if isinstance(ev, Preflighted):
        return _preflighted(s, ev)
    if isinstance(ev, SpawnFailed):
        return _stop(
            s,
            Phase.FAILED,
            ExitCode.CHILD_FAILED,
            "failed",
            f"cannot start the command: {ev.error}; fix the command line",
        )
    if isinstance(ev, NoticeEvent):
        return _notice(s, ev)
    if isinstance(ev, Forward):
        return _forward(s, ev)
    if isinstance(ev, Tick):
        return _tick(s, ev)
    if isinstance(ev, ChildExited):
        return _exited(s, ev)
    return _requeued(s, ev)


def _preflighted(s: State, ev: Preflighted) -> Result:
    if s.phase is not Phase.PREFLIGHT:
        return s, []
    if ev.outcome == PreflightOutcome.COMPLETE:
        return _stop(
            s,
            Phase.ALREADY_COMPLETE,
            ExitCode.OK,
            "already_complete",
            f"run already complete ({ev.detail or 'COMPLETE.json'}); not starting the command",
            step=ev.step,
        )
    if ev.outcome == PreflightOutcome.INCOMPATIBLE:
        return _stop(
            s,
            Phase.INCOMPATIBLE,
            ExitCode.INCOMPATIBLE,
            "incompatible",
            "newest checkpoint is incompatible with run.json: "
            + "; ".join(ev.diff)
            + " (use --allow-change FIELD to accept)",
            step=ev.step,
            diff=list(ev.diff),
        )
    if ev.outcome == PreflightOutcome.CANCELLED or s.cancel:
        return _stop(
            s,
            Phase.CANCELLED,
            ExitCode.OK,
            "cancelled",
            "run was cancelled; `ckrun submit` the run again to resume it",
        )
    attempt = s.attempt  # ids are 0-based and never repeat within a run
    s = _r(
        s,
        phase=Phase.RUNNING,
        attempt=attempt + 1,
        base_step=ev.step,
        child=True,
        notice_kind=None,
        notice_source=None,
        notice_at=None,
        deadline=None,
        kill_at=None,
        killed=False,
        respawn_at=None,
        interrupted=None,
    )
    where = f"resuming from step {ev.step}" if ev.step is not None else "from scratch"
    return s, [
        Spawn(attempt, ev.step),
        Log("attempt_start", f"started, {where}", {"step": ev.step}),
    ]


def _notice(s: State, ev: NoticeEvent) -> Result:
    s = _r(s, cancel=s.cancel or ev.cancel, self_term=s.self_term or ev.self_term)
    what = f"notice {ev.source} ({ev.kind})"
    if s.phase in (Phase.DRAINING, Phase.STOPPING):
        dl = min(s.deadline or ev.deadline, ev.deadline)
        s = _r(s, deadline=dl if s.phase is Phase.DRAINING else s.deadline)
        return s, [
            Log(
                "notice",
                f"{what} while draining; keeping the earlier deadline",
                {"source": ev.source, "notice_kind": ev.kind},
            )
        ]
    if s.phase is Phase.RUNNING and s.child:
        dl = min(ev.deadline, ev.now + s.policy.grace_s)
        s = _r(
            s,
            phase=Phase.DRAINING,
            notice_kind=ev.kind,
            notice_source=ev.source,
            notice_at=ev.now,
            deadline=dl,
        )
        return s, [
            WriteNotice(ev.kind, ev.source, dl - ev.now),
            Deliver(),
            Log(
                "notice",
                what,
                {
                    "source": ev.source,
                    "notice_kind": ev.kind,
                    "seconds_left": round(dl - ev.now, 3),
                },
            ),
        ]
    # No child (backoff between failures, or before the spawn): nothing to drain.
    s = _r(
        s,
        notice_kind=ev.kind,
        notice_source=ev.source,
        notice_at=ev.now,
        preemptions=s.preemptions + 1,
    )
    return _preempted(
        s, False, ev.now, [Log("notice", what + " with no child running", {"source": ev.source})]
    )


def _forward(s: State, ev: Forward) -> Result:
    name = signal.Signals(ev.sig).name
    if s.child:
        return _r(s, interrupted=ev.sig), [
            SignalGroup(ev.sig),
            Log("forward", f"forwarded {name} to the child", {"signal": name}),
        ]
    return _stop(
        s,
        Phase.FAILED,
        ExitCode.CHILD_FAILED,
        "failed",
        f"stopped by {name} while no child was running",
    )


def _tick(s: State, ev: Tick) -> Result:
    p = s.policy
    if s.phase is Phase.RUNNING and not s.child and s.respawn_at is not None:
        if ev.now >= s.respawn_at:
            return _r(s, phase=Phase.PREFLIGHT, respawn_at=None), [RunPreflight()]
    elif s.phase is Phase.DRAINING and s.deadline is not None:
        if ev.now >= s.deadline - p.margin_s:
            s = _r(s, phase=Phase.STOPPING, kill_at=ev.now + p.kill_delay_s)
            waited = ev.now - (s.notice_at or ev.now)
            return s, [
                Escalate(),
                Log(
                    "escalate",
                    f"no exit {waited:.1f} s after the notice: sent TERM to the child's group",
                    {"seconds": round(waited, 3)},
                ),
            ]
    elif s.phase is Phase.STOPPING and not s.killed and s.kill_at is not None:
        if ev.now >= s.kill_at:
            return _r(s, killed=True), [
                Kill(),
                Log("kill", f"still alive {p.kill_delay_s:g} s after TERM: sent KILL"),
            ]
    return s, []


def _exited(s: State, ev: ChildExited) -> Result:
    if not s.child:
        return s, []
    progress = _newer(ev.newest_step, s.base_step)
    s = _r(s, child=False)
    log = Log(
        "child_exit",
        f"child exited with status {ev.status}",
        {"status": ev.status, "step": ev.newest_step},
    )
    if ev.status == 0 and (s.phase is Phase.RUNNING or ev.complete):
        tail = "" if ev.complete else " (no COMPLETE.json: the command did not finalize)"
        s, acts = _stop(
            s,
            Phase.COMPLETED,
            ExitCode.OK,
            "completed",
            f"run completed{tail}",
            step=ev.newest_step,
            marker=ev.complete,
        )
        return s, [log, *acts]
    if ev.status == ExitCode.INCOMPATIBLE:
        s, acts = _stop(
            s,
            Phase.INCOMPATIBLE,
            ExitCode.INCOMPATIBLE,
            "incompatible",
            "the command refused the checkpoint as incompatible (exit 4)",
        )
        return s, [log, *acts]
    if s.phase is Phase.RUNNING:
        return _exited_running(s, ev, progress, log)
    s = _r(s, preemptions=s.preemptions + 1)
    return _preempted(s, progress, ev.now, [log], ev.newest_step, ev.save_s)


def _exited_running(s: State, ev: ChildExited, progress: bool, log: Log) -> Result:
    p = s.policy
    if ev.status == ExitCode.CONFIG_INVALID:
        s, acts = _stop(
            s,
            Phase.FAILED,
            ExitCode.CONFIG_INVALID,
            "failed",
            "the command reported an invalid config (exit 3)",
        )
        return s, [log, *acts]
    if s.interrupted is not None:
        name = signal.Signals(s.interrupted).name
        s, acts = _stop(
            s,
            Phase.FAILED,
            ExitCode.CHILD_FAILED,
            "failed",
            f"child stopped after a forwarded {name}; not restarting",
        )
        return s, [log, *acts]
    if ev.status in (ExitCode.PREEMPTED, ExitCode.PREEMPTED_NO_CHECKPOINT, _TERMINATED_BY_TERM):
        s = _r(
            s,
            preemptions=s.preemptions + 1,
            notice_kind="termination",
            notice_source="child",
            notice_at=ev.now,
        )
        return _preempted(s, progress, ev.now, [log], ev.newest_step, ev.save_s)
    failures = s.failures + 1
    no_progress = 0 if progress else s.no_progress + 1
    s = _r(s, failures=failures, no_progress=no_progress)
    if failures > p.max_failures:
        s, acts = _stop(
            s,
            Phase.FAILED,
            ExitCode.CHILD_FAILED,
            "failed",
            f"failure budget spent: {failures} failures > max_failures "
            f"{p.max_failures}; see the output above",
            failures=failures,
        )
        return s, [log, *acts]
    if no_progress >= p.crash_loop_failures:
        s, acts = _stop(
            s,
            Phase.FAILED,
            ExitCode.CHILD_FAILED,
            "failed",
            f"crash loop: {no_progress} failures in a row with no checkpoint "
            f"progress (newest step {ev.newest_step}); fix the error above, "
            "then run again",
            failures=failures,
        )
        return s, [log, *acts]
    delay = min(p.backoff_max_s, p.backoff_s * 2 ** (failures - 1))
    s = _r(s, respawn_at=ev.now + delay)
    return s, [
        log,
        Log(
            "backoff",
            f"failure {failures}/{p.max_failures}; restarting in {delay:g} s",
            {"seconds": delay, "failures": failures},
        ),
    ]


def _preempted(
    s: State,
    progress: bool,
    now: float,
    acts: list[Action],
    step_: int | None = None,
    save_s: float | None = None,
) -> Result:
    code = ExitCode.PREEMPTED if progress else ExitCode.PREEMPTED_NO_CHECKPOINT
    s = _r(s, phase=Phase.PREEMPTED, exit_code=None, child=False)
    took = now - (s.notice_at if s.notice_at is not None else now)
    save = f"committed in {save_s:.2f} s, " if save_s is not None else ""
    ck = (
        f"checkpoint step {step_} {save}child gone {took:.1f} s after the notice"
        if progress
        else f"no new checkpoint (last step {s.base_step})"
    )
    fields = {
        "step": step_ if progress else s.base_step,
        "seconds": round(took, 3),
        "save_s": save_s if progress else None,
        "new_checkpoint": progress,
        "exit_code": int(code),
    }
    if s.cancel:
        s, more = _stop(s, Phase.CANCELLED, ExitCode.OK, "cancelled", f"cancelled; {ck}", **fields)
        return s, [*acts, *more]
    budget = f"requeue {s.preemptions}/{s.policy.max_requeues}"
    if s.preemptions > s.policy.max_requeues:
        s = _r(s, exit_code=int(code), why="requeue budget spent")
        return s, [
            *acts,
            Log("preempted", f"{ck}; {budget}: budget spent, not requeueing", fields),
            Exit(int(code)),
        ]
    s = _r(s, why=ck, pending_code=int(code))
    return s, [*acts, Log("preempted", f"{ck}, {budget}", fields), Requeue()]


def _requeued(s: State, ev: Requeued) -> Result:
    if s.phase is not Phase.PREEMPTED:
        return s, []
    code = s.pending_code if s.pending_code is not None else ExitCode.PREEMPTED_NO_CHECKPOINT
    if ev.outcome == RequeueResult.FAILED:
        return _stop(
            s,
            Phase.REQUEUE_FAILED,
            ExitCode.REQUEUE_FAILED,
            "requeue_failed",
            f"requeue failed: {ev.detail}; the checkpoint is intact, resubmit",
        )
    if ev.outcome == RequeueResult.RESTART_HERE and not s.self_term:
        s = _r(s, phase=Phase.PREFLIGHT)
        return s, [Log("requeue", "restarting here", {"outcome": ev.outcome}), RunPreflight()]
    msg = (
        "this supervisor or machine is being stopped (SIGTERM or a machine notice): not "
        "restarting in place; `ckrun run` or `ckrun submit` again resumes"
        if ev.outcome == RequeueResult.RESTART_HERE
        else f"requeued by the scheduler{': ' + ev.detail if ev.detail else ''}"
    )
    s = _r(s, exit_code=int(code))
    return s, [
        Log("requeue", msg, {"outcome": ev.outcome, "exit_code": int(code)}),
        Exit(int(code)),
    ]
