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

* A notice: TERM at ``term_at`` and KILL at ``kill_at``, both inside ``grace_s``
  (:meth:`Policy.escalation`).  When no process of the child's tree catches the notice
  signal (:class:`Delivered` with count 0) the notice is delivered as SIGTERM at once.
* ``STOPPING`` + KILL *stays* in ``STOPPING`` until the child is reaped; the
  ``PREEMPTED`` step then has the real exit status and the storage check.
* ``PREEMPTED`` waits for the :class:`Requeued` outcome of the scheduler: restart here
  (local backend → ``PREFLIGHT`` of the next attempt), requeued (exit 75/76) or failed
  (``REQUEUE_FAILED``, exit 6).  A SIGTERM aimed at the supervisor itself is never
  answered by restarting in the same process.  A lost lease (another supervisor took
  the run over, DESIGN.md §7) is a notice with ``lease_lost``: the child is drained
  (its commit is refused by fencing), then ``LEASE_LOST``, exit 2, no requeue.  One
  notice, one requeue: notices while the requeue is pending, during back-off or during
  preflight never count twice.
* Strays: once the command's own process has exited, what is left of its session gets
  TERM ``stray_s`` later and KILL ``stray_s`` after that (unless a notified process is
  still saving; then the notice deadline applies).
* Exit statuses 3, 4, 5 are ckrun's only with the library's exit-reason record
  (:class:`ChildExited` ``reason``); a status 0 is a completion unless the record says
  the process stopped for a notice (a script that never acknowledged a notice and
  finished has completed).
* Ctrl-C (:class:`Interrupt`): the first is a save-and-stop notice (CANCELLED, exit 130);
  a second within ``interrupt_window_s`` KILLs the child's session at once.

Restart policy (DESIGN.md §3): preemptions count against ``max_requeues``; failures of
the user's command against ``max_failures``; ``crash_loop_failures`` consecutive failures
without checkpoint progress stop the run (crash-loop guard); ``no_progress_preemptions``
preemptions in a row without a new checkpoint stop the run (requeue-storm guard), with
the back-off ``min(backoff_max_s, backoff_s * 2**(n-1))`` before the n-th next start.
"""

from __future__ import annotations

import signal
from typing import Any

from ckrun.errors import ExitCode
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
        return _notice(s, ev)
    if isinstance(ev, Interrupt):
        return _interrupt(s, ev)
    if isinstance(ev, Forward):
        return _forward(s, ev)
    if isinstance(ev, Tick):
        return _tick(s, ev)
    if isinstance(ev, Delivered):
        return _delivered(s, ev)
    if isinstance(ev, LeaderExited):
        return _leader_exited(s, ev)
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


def _notice(s: State, ev: NoticeEvent) -> Result:
    s = update(
        s,
        cancel=s.cancel or ev.cancel,
        self_term=s.self_term or ev.self_term or ev.lease_lost,
        lease_lost=s.lease_lost or ev.lease_lost,
    )
    what = f"notice {ev.source} ({ev.kind})"
    fields: dict[str, Any] = {"source": ev.source, "notice_kind": ev.kind}
    if s.phase in (Phase.DRAINING, Phase.STOPPING):
        if s.phase is Phase.DRAINING and s.deadline is not None and ev.deadline < s.deadline:
            s = update(s, deadline=max(ev.now, ev.deadline))
            return s, [Log("notice", f"{what} while draining; deadline moved earlier", fields)]
        return s, [Log("notice", f"{what} while draining; keeping the earlier deadline", fields)]
    if s.phase is Phase.RUNNING and s.child:
        dl = min(ev.deadline, ev.now + s.policy.grace_s)
        s = update(
            s,
            phase=Phase.DRAINING,
            notice_kind=ev.kind,
            notice_source=ev.source,
            notice_at=ev.now,
            deadline=dl,
        )
        fields["seconds_left"] = round(dl - ev.now, 3)
        return s, [
            WriteNotice(ev.kind, ev.source, dl - ev.now),
            Deliver(),
            Log("notice", what, fields),
        ]
    if s.phase is Phase.PREFLIGHT:
        return update(s, notice_pending=True), [
            Log("notice", f"{what} during preflight: the command will not start", fields)
        ]
    if s.phase is Phase.PREEMPTED:  # the requeue is already on its way (or backing off)
        return s, [Log("notice", f"{what} while requeueing: already counted", fields)]
    # No child (back-off between failures): nothing to drain; one preemption.
    s = update(
        s,
        notice_kind=ev.kind,
        notice_source=ev.source,
        notice_at=ev.now,
        preemptions=s.preemptions + 1,
    )
    return preempted(s, False, ev.now, [Log("notice", what + " with no child running", fields)])


def _interrupt(s: State, ev: Interrupt) -> Result:
    window = s.policy.interrupt_window_s
    if s.ctrl_c and s.interrupt_at is not None and ev.now - s.interrupt_at <= window:
        if s.child:
            return update(s, phase=Phase.STOPPING, killed=True, kill_at=ev.now), [
                Kill(),
                Log("kill", "second Ctrl-C: sent KILL to the child's session"),
            ]
        return s, []
    s = update(s, ctrl_c=True, interrupt_at=ev.now)
    if s.phase in (Phase.DRAINING, Phase.STOPPING):
        return update(s, cancel=True), [
            Log("notice", "Ctrl-C while draining: stopping after the save (Ctrl-C again: now)")
        ]
    if s.phase is Phase.RUNNING and not s.child:  # back-off: nothing to save
        return stop(s, Phase.CANCELLED, INTERRUPTED, "cancelled", "interrupted (Ctrl-C)")
    if s.phase is Phase.PREEMPTED:
        return stop(
            s, Phase.CANCELLED, INTERRUPTED, "cancelled", "interrupted (Ctrl-C) while requeueing"
        )
    if s.phase is Phase.PREFLIGHT:
        return s, []  # _preflighted stops
    s, acts = _notice(
        s, NoticeEvent("termination", "signal:SIGINT", ev.now + s.policy.grace_s, ev.now)
    )
    return update(s, cancel=True), [
        *acts,
        Log(
            "interrupt",
            f"Ctrl-C: saving, then stopping (Ctrl-C again within {window:g} s: stop at once)",
        ),
    ]


def _forward(s: State, ev: Forward) -> Result:
    name = signal.Signals(ev.sig).name
    if s.child:
        return update(s, interrupted=ev.sig), [
            SignalGroup(ev.sig),
            Log("forward", f"forwarded {name} to the child", {"signal": name}),
        ]
    return stop(
        s,
        Phase.FAILED,
        ExitCode.CHILD_FAILED,
        "failed",
        f"stopped by {name} while no child was running",
    )


def _delivered(s: State, ev: Delivered) -> Result:
    if ev.count or s.phase is not Phase.DRAINING or not s.child:
        return s, []
    return s, [
        SignalGroup(signal.SIGTERM),
        Log(
            "deliver_term",
            "no process of the command catches the notice signal: delivered the notice as SIGTERM",
        ),
    ]


def _leader_exited(s: State, ev: LeaderExited) -> Result:
    if not s.child:
        return s, []
    acts: list[Action] = []
    if s.leader_status is None:
        s = update(s, leader_status=ev.status)
        acts.append(
            Log(
                "strays",
                f"command exited ({ev.status}) but its session has processes left; "
                f"TERM in {s.policy.stray_s:g} s unless they exit",
                {"status": ev.status},
            )
        )
    if not ev.saving and s.strays_term_at is None:
        s = update(s, strays_term_at=ev.now + s.policy.stray_s)
    return s, acts


def _tick(s: State, ev: Tick) -> Result:
    p = s.policy
    now = ev.now
    if s.phase is Phase.RUNNING and not s.child and s.respawn_at is not None:
        if now >= s.respawn_at:
            return update(s, phase=Phase.PREFLIGHT, respawn_at=None), [RunPreflight()]
        return s, []
    if s.phase is Phase.PREEMPTED and s.requeue_at is not None:
        if now >= s.requeue_at:
            return update(s, requeue_at=None), [Requeue()]
        return s, []
    if s.child and s.strays_term_at is not None and not s.killed:
        if s.strays_kill_at is not None and now >= s.strays_kill_at:
            return update(s, killed=True), [Kill(), Log("kill", "strays still alive: sent KILL")]
        if s.strays_kill_at is None and now >= s.strays_term_at:
            return update(s, strays_kill_at=now + p.stray_s), [
                SignalGroup(signal.SIGTERM),
                Log("strays_term", "sent TERM to the processes left in the command's session"),
            ]
    if s.phase is Phase.DRAINING and s.deadline is not None:
        term_at, kill_at = p.escalation(s.notice_at if s.notice_at is not None else now, s.deadline)
        if now >= term_at:
            s = update(s, phase=Phase.STOPPING, kill_at=kill_at)
            waited = now - (s.notice_at or now)
            return s, [
                Escalate(),
                Log(
                    "escalate",
                    f"no exit {waited:.1f} s after the notice: sent TERM to the child's "
                    f"group; KILL in {kill_at - now:.1f} s",
                    {"seconds": round(waited, 3)},
                ),
            ]
    elif s.phase is Phase.STOPPING and not s.killed and s.kill_at is not None:
        if now >= s.kill_at:
            return update(s, killed=True), [
                Kill(),
                Log("kill", "still alive at the deadline minus the margin: sent KILL"),
            ]
    return s, []
