"""The supervisor's pure state machine: ``step(state, event) -> (state, actions)``.

DESIGN.md §4.5.  No I/O, no clock, no processes: time arrives inside events as
``now`` (``time.monotonic()`` seconds), and everything the supervisor must *do* leaves as
:class:`Action` values that :mod:`ckrun.supervisor.loop`'s loop executes.  Every timer
(escalation, strays, back-off, second Ctrl-C) is state (:mod:`ckrun.supervisor.state`);
the loop only feeds ``Tick`` and process events.  Each row of the §4.5 table is a unit
test of :func:`step` (``tests/supervisor/test_statemachine.py``).

Phases::

    PREFLIGHT → RUNNING → DRAINING → STOPPING → COMPLETED | ALREADY_COMPLETE |
    INCOMPATIBLE | FAILED | PREEMPTED | REQUEUE_FAILED | CANCELLED

* A notice, Ctrl-C, a forwarded signal and the notice's delivery:
  :mod:`ckrun.supervisor.drain`.  The timers (escalation TERM/KILL inside ``grace_s``,
  strays, back-off, requeue delay): :mod:`ckrun.supervisor.timers`.  How an attempt ends
  (exit statuses, requeue outcomes, budgets): :mod:`ckrun.supervisor.outcomes`.
* ``PREEMPTED`` waits for the :class:`Requeued` outcome of the scheduler: restart here
  (local backend → ``PREFLIGHT`` of the next attempt), requeued (exit 75/76) or failed
  (``REQUEUE_FAILED``, exit 6).  A SIGTERM aimed at the supervisor itself is never
  answered by restarting in the same process.  A lost lease (another supervisor took
  the run over, DESIGN.md §7) is a notice with ``lease_lost``: the child is drained
  (its commit is refused by fencing), then ``LEASE_LOST``, exit 2, no requeue.  One
  notice, one requeue: notices while the requeue is pending, during back-off or during
  preflight never count twice.
* Exit statuses 3, 4, 5 are ckrun's only with the library's exit-reason record
  (:class:`ChildExited` ``reason``); a status 0 is a completion unless the record says
  the process stopped for a notice (a script that never acknowledged a notice and
  finished has completed).

Restart policy (DESIGN.md §3): preemptions count against ``max_requeues``; failures of
the user's command against ``max_failures``; ``crash_loop_failures`` consecutive failures
without checkpoint progress stop the run (crash-loop guard); ``no_progress_preemptions``
preemptions in a row without a new checkpoint stop the run (requeue-storm guard), with
the back-off ``min(backoff_max_s, backoff_s * 2**(n-1))`` before the n-th next start.
"""

from __future__ import annotations

from ckrun.errors import ExitCode
from ckrun.supervisor.drain import on_delivered, on_forward, on_interrupt, on_notice
from ckrun.supervisor.messages import (  # re-exported: the machine's vocabulary
    Action,
    ChildExited,
    Deliver,
    Delivered,
    Escalate,
    Event,
    Exit,
    Forward,
    Interrupt,
    Kill,
    LeaderExited,
    Log,
    NoticeEvent,
    Persist,
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
from ckrun.supervisor.outcomes import (
    INTERRUPTED,
    Result,
    exited,
    lost,
    preempted,
    requeued,
    stop,
    storm,
    update,
)
from ckrun.supervisor.state import TERMINAL, Phase, Policy, State
from ckrun.supervisor.timers import on_leader_exited, on_tick

__all__ = [
    "INTERRUPTED",
    "Phase",
    "Policy",
    "State",
    "TERMINAL",
    "step",
    "budgets",
    "PreflightOutcome",
    "Preflighted",
    "SpawnFailed",
    "ChildExited",
    "LeaderExited",
    "Delivered",
    "Interrupt",
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
    "Persist",
    "Requeue",
    "Log",
    "Exit",
    "Action",
    "Result",
]


def budgets(s: State) -> tuple[int, int, int, int]:
    """``(preemptions, failures, no_progress, streak)``: what persists with the run."""
    return (s.preemptions, s.failures, s.no_progress, s.streak)


def step(s: State, ev: Event) -> Result:
    """Advance the machine by one event. Pure: same input, same output.

    Returns:
        The new state and the actions to execute, in order; a :class:`Persist` comes
        first whenever the run's budgets changed (before a requeue or exit can end the
        process).
    """
    if s.terminal:
        return s, []
    new, acts = _dispatch(s, ev)
    if budgets(new) != budgets(s):  # recorded before anything else happens
        acts = [Persist(), *acts]
    return new, acts


def _dispatch(s: State, ev: Event) -> Result:
    if isinstance(ev, Preflighted):
        return _preflighted(s, ev)
    if isinstance(ev, SpawnFailed):
        return stop(
            s,
            Phase.FAILED,
            ExitCode.CHILD_FAILED,
            "failed",
            f"cannot start the command: {ev.error}; fix the command line",
        )
    if isinstance(ev, NoticeEvent):
        return on_notice(s, ev)
    if isinstance(ev, Interrupt):
        return on_interrupt(s, ev)
    if isinstance(ev, Forward):
        return on_forward(s, ev)
    if isinstance(ev, Tick):
        return on_tick(s, ev)
    if isinstance(ev, Delivered):
        return on_delivered(s, ev)
    if isinstance(ev, LeaderExited):
        return on_leader_exited(s, ev)
    if isinstance(ev, ChildExited):
        return exited(s, ev)
    return requeued(s, ev)


def _preflighted(s: State, ev: Preflighted) -> Result:
    if s.phase is not Phase.PREFLIGHT:
        return s, []
    if ev.outcome == PreflightOutcome.COMPLETE:
        return stop(
            s,
            Phase.ALREADY_COMPLETE,
            ExitCode.OK,
            "already_complete",
            f"run already complete ({ev.detail or 'COMPLETE.json'}); not starting the command",
            step=ev.step,
        )
    if ev.outcome == PreflightOutcome.INCOMPATIBLE:
        return stop(
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
    if s.lease_lost:
        return lost(s)
    if ev.outcome == PreflightOutcome.CANCELLED or (s.cancel and not s.ctrl_c):
        return stop(
            s,
            Phase.CANCELLED,
            ExitCode.OK,
            "cancelled",
            "run was cancelled; `ckrun submit` the run again to resume it",
        )
    if s.ctrl_c:
        return stop(
            s, Phase.CANCELLED, INTERRUPTED, "cancelled", "interrupted (Ctrl-C) before the start"
        )
    limit = s.policy.no_progress_preemptions
    if limit and s.streak >= limit:
        return storm(s, ev.step)
    if s.notice_pending:  # a notice came while preflight ran: do not start the command
        s = update(s, notice_pending=False, preemptions=s.preemptions + 1, base_step=ev.step)
        return preempted(s, False, ev.now, [])
    attempt = s.attempt  # ids are 0-based and never repeat within a run
    s = update(
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
        leader_status=None,
        strays_term_at=None,
        strays_kill_at=None,
        respawn_at=None,
        requeue_at=None,
        interrupted=None,
    )
    where = f"resuming from step {ev.step}" if ev.step is not None else "from scratch"
    return s, [
        Spawn(attempt, ev.step),
        Log("attempt_start", f"started, {where}", {"step": ev.step}),
    ]
