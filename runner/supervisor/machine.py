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
  answered by restarting in the same process.  One notice, one requeue: notices while
  the requeue is pending, during back-off or during preflight never count twice.
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

import dataclasses
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
    Requeue,
    Requeued,
    RunPreflight,
    SignalGroup,
    Spawn,
    SpawnFailed,
    Tick,
    WriteNotice,
)
from ckrun.supervisor.state import TERMINAL, Phase, Policy, State

_TERMINATED_BY_TERM = 128 + int(signal.SIGTERM)
#: Exit code after Ctrl-C (128 + SIGINT, the shell convention).
INTERRUPTED = int(ExitCode.INTERRUPTED)
#: Exit-reason records that make a status the library's (see ChildExited.reason).
_STORAGE_REASONS = ("storage_full", "storage_error")

Result = tuple[State, list[Action]]

__all__ = [
    "INTERRUPTED",
    "Phase",
    "Policy",
    "State",
    "TERMINAL",
    "step",
    "budgets",
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
        The new state and the actions to execute, in order; a :class:`Persist` comes
        first whenever the run's budgets changed (before a requeue or exit can end the
        process).
    """
    if s.phase in TERMINAL or s.exit_code is not None:
        return s, []
    new, acts = _dispatch(s, ev)
    if budgets(new) != budgets(s):  # recorded before anything else happens
        acts = [Persist(), *acts]
    return new, acts


def _dispatch(s: State, ev: Event) -> Result:
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
        return _exited(s, ev)
    return _requeued(s, ev)


def _preflighted(s: State, ev: Preflighted) -> Result:
    if s.phase is not Phase.PREFLIGHT:
        return s, []
    if ev.outcome == "complete":
        return _stop(
            s,
            Phase.ALREADY_COMPLETE,
            ExitCode.OK,
            "already_complete",
            f"run already complete ({ev.detail or 'COMPLETE.json'}); not starting the command",
            step=ev.step,
        )
    if ev.outcome == "incompatible":
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
    if ev.outcome == "cancelled" or (s.cancel and not s.ctrl_c):
        return _stop(
            s,
            Phase.CANCELLED,
            ExitCode.OK,
            "cancelled",
            "run was cancelled; `ckrun submit` the run again to resume it",
        )
    if s.ctrl_c:
        return _stop(
            s, Phase.CANCELLED, INTERRUPTED, "cancelled", "interrupted (Ctrl-C) before the start"
        )
    limit = s.policy.no_progress_preemptions
    if limit and s.streak >= limit:
        return _storm(s, ev.step)
    if s.notice_pending:  # a notice came while preflight ran: do not start the command
        s = _r(s, notice_pending=False, preemptions=s.preemptions + 1, base_step=ev.step)
        return _preempted(s, False, ev.now, [])
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


def _storm(s: State, step_: int | None) -> Result:
    return _stop(
        s,
        Phase.FAILED,
        ExitCode.CHILD_FAILED,
        "failed",
        f"requeue storm: {s.streak} preemptions in a row without a new checkpoint "
        f"(newest step {step_ if step_ is not None else s.base_step}; limit "
        f"no_progress_preemptions {s.policy.no_progress_preemptions}); the command stops "
        "(exit 75, or by SIGTERM) before it saves: fix it, then `ckrun submit` again",
        streak=s.streak,
        reason="no_progress",
    )


def _notice(s: State, ev: NoticeEvent) -> Result:
    s = _r(s, cancel=s.cancel or ev.cancel, self_term=s.self_term or ev.self_term)
    what = f"notice {ev.source} ({ev.kind})"
    fields: dict[str, Any] = {"source": ev.source, "notice_kind": ev.kind}
    if s.phase in (Phase.DRAINING, Phase.STOPPING):
        if s.phase is Phase.DRAINING and s.deadline is not None and ev.deadline < s.deadline:
            s = _r(s, deadline=max(ev.now, ev.deadline))
            return s, [Log("notice", f"{what} while draining; deadline moved earlier", fields)]
        return s, [Log("notice", f"{what} while draining; keeping the earlier deadline", fields)]
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
        fields["seconds_left"] = round(dl - ev.now, 3)
        return s, [
            WriteNotice(ev.kind, ev.source, dl - ev.now),
            Deliver(),
            Log("notice", what, fields),
        ]
    if s.phase is Phase.PREFLIGHT:
        return _r(s, notice_pending=True), [
            Log("notice", f"{what} during preflight: the command will not start", fields)
        ]
    if s.phase is Phase.PREEMPTED:  # the requeue is already on its way (or backing off)
        return s, [Log("notice", f"{what} while requeueing: already counted", fields)]
    # No child (back-off between failures): nothing to drain; one preemption.
    s = _r(
        s,
        notice_kind=ev.kind,
        notice_source=ev.source,
        notice_at=ev.now,
        preemptions=s.preemptions + 1,
    )
    return _preempted(s, False, ev.now, [Log("notice", what + " with no child running", fields)])


def _interrupt(s: State, ev: Interrupt) -> Result:
    window = s.policy.interrupt_window_s
    if s.ctrl_c and s.interrupt_at is not None and ev.now - s.interrupt_at <= window:
        if s.child:
            return _r(s, phase=Phase.STOPPING, killed=True, kill_at=ev.now), [
                Kill(),
                Log("kill", "second Ctrl-C: sent KILL to the child's session"),
            ]
        return s, []
    s = _r(s, ctrl_c=True, interrupt_at=ev.now)
    if s.phase in (Phase.DRAINING, Phase.STOPPING):
        return _r(s, cancel=True), [
            Log("notice", "Ctrl-C while draining: stopping after the save (Ctrl-C again: now)")
        ]
    if s.phase is Phase.RUNNING and not s.child:  # back-off: nothing to save
        return _stop(s, Phase.CANCELLED, INTERRUPTED, "cancelled", "interrupted (Ctrl-C)")
    if s.phase is Phase.PREEMPTED:
        return _stop(
            s, Phase.CANCELLED, INTERRUPTED, "cancelled", "interrupted (Ctrl-C) while requeueing"
        )
    if s.phase is Phase.PREFLIGHT:
        return s, []  # _preflighted stops
    s, acts = _notice(
        s, NoticeEvent("termination", "signal:SIGINT", ev.now + s.policy.grace_s, ev.now)
    )
    return _r(s, cancel=True), [
        *acts,
        Log(
            "interrupt",
            f"Ctrl-C: saving, then stopping (Ctrl-C again within {window:g} s: stop at once)",
        ),
    ]


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
        s = _r(s, leader_status=ev.status)
        acts.append(
            Log(
                "strays",
                f"command exited ({ev.status}) but its session has processes left; "
                f"TERM in {s.policy.stray_s:g} s unless they exit",
                {"status": ev.status},
            )
        )
    if not ev.saving and s.strays_term_at is None:
        s = _r(s, strays_term_at=ev.now + s.policy.stray_s)
    return s, acts


def _tick(s: State, ev: Tick) -> Result:
    p = s.policy
    now = ev.now
    if s.phase is Phase.RUNNING and not s.child and s.respawn_at is not None:
        if now >= s.respawn_at:
            return _r(s, phase=Phase.PREFLIGHT, respawn_at=None), [RunPreflight()]
        return s, []
    if s.phase is Phase.PREEMPTED and s.requeue_at is not None:
        if now >= s.requeue_at:
            return _r(s, requeue_at=None), [Requeue()]
        return s, []
    if s.child and s.strays_term_at is not None and not s.killed:
        if s.strays_kill_at is not None and now >= s.strays_kill_at:
            return _r(s, killed=True), [Kill(), Log("kill", "strays still alive: sent KILL")]
        if s.strays_kill_at is None and now >= s.strays_term_at:
            return _r(s, strays_kill_at=now + p.stray_s), [
                SignalGroup(signal.SIGTERM),
                Log("strays_term", "sent TERM to the processes left in the command's session"),
            ]
    if s.phase is Phase.DRAINING and s.deadline is not None:
        term_at, kill_at = p.escalation(s.notice_at if s.notice_at is not None else now, s.deadline)
        if now >= term_at:
            s = _r(s, phase=Phase.STOPPING, kill_at=kill_at)
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
            return _r(s, killed=True), [
                Kill(),
                Log("kill", "still alive at the deadline minus the margin: sent KILL"),
            ]
    return s, []


def _exited(s: State, ev: ChildExited) -> Result:
    if not s.child:
        return s, []
    progress = _newer(ev.newest_step, s.base_step)
    s = _r(s, child=False)
    log = Log(
        "child_exit",
        f"child exited with status {ev.status}"
        + (f" ({ev.reason}: {ev.detail})" if ev.reason else ""),
        {"status": ev.status, "step": ev.newest_step, "reason": ev.reason},
    )
    if ev.status == 0 and (ev.reason != "preempted" or ev.complete):
        tail = "" if ev.complete else " (no COMPLETE.json: the command did not finalize)"
        s = _r(s, streak=0)
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
    lib = _library_exit(s, ev)
    if lib is not None:
        s, acts = lib
        return s, [log, *acts]
    if s.phase is Phase.RUNNING and not s.ctrl_c and not s.cancel:
        return _exited_running(s, ev, progress, log)
    s = _r(s, preemptions=s.preemptions + 1)
    return _preempted(s, progress, ev.now, [log], ev.newest_step, ev.save_s)


def _library_exit(s: State, ev: ChildExited) -> Result | None:
    """Exit 3/4/5 with the library's record: the run stops (retrying cannot help)."""
    if ev.status == ExitCode.INCOMPATIBLE and ev.reason == "incompatible":
        return _stop(
            s,
            Phase.INCOMPATIBLE,
            ExitCode.INCOMPATIBLE,
            "incompatible",
            f"the command refused the checkpoint as incompatible: {ev.detail or 'exit 4'}",
        )
    if ev.status == ExitCode.CONFIG_INVALID and ev.reason == "config_invalid":
        return _stop(
            s,
            Phase.FAILED,
            ExitCode.CONFIG_INVALID,
            "failed",
            f"the command reported an invalid config: {ev.detail or 'exit 3'}",
        )
    if ev.status == ExitCode.STORAGE_ERROR and ev.reason in _STORAGE_REASONS:
        return _stop(
            s,
            Phase.FAILED,
            ExitCode.STORAGE_ERROR,
            "failed",
            f"the command stopped on a storage error, not restarting: {ev.detail}",
            reason=ev.reason,
        )
    return None


def _exited_running(s: State, ev: ChildExited, progress: bool, log: Log) -> Result:
    p = s.policy
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
    delay = p.backoff(failures)
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
    s = _r(
        s,
        phase=Phase.PREEMPTED,
        exit_code=None,
        child=False,
        streak=0 if progress else s.streak + 1,
    )
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
        stop = INTERRUPTED if s.ctrl_c else ExitCode.OK
        s, more = _stop(s, Phase.CANCELLED, stop, "cancelled", f"cancelled; {ck}", **fields)
        return s, [*acts, *more]
    budget = f"requeue {s.preemptions}/{s.policy.max_requeues}"
    if s.preemptions > s.policy.max_requeues:
        s = _r(s, exit_code=int(code), why="requeue budget spent")
        return s, [
            *acts,
            Log("preempted", f"{ck}; {budget}: budget spent, not requeueing", fields),
            Exit(int(code)),
        ]
    limit = s.policy.no_progress_preemptions
    if limit and s.streak >= limit:
        s, more = _storm(s, step_)
        return s, [*acts, Log("preempted", f"{ck}, {budget}", fields), *more]
    s = _r(s, why=ck, pending_code=int(code))
    if s.streak > 1 and not s.self_term:  # no progress again: back off before the next start
        delay = s.policy.backoff(s.streak - 1)
        s = _r(s, requeue_at=now + delay)
        return s, [
            *acts,
            Log("preempted", f"{ck}, {budget}", fields),
            Log(
                "backoff",
                f"{s.streak} preemption(s) in a row without a new checkpoint; next start "
                f"in {delay:g} s",
                {"seconds": delay, "streak": s.streak},
            ),
        ]
    return s, [*acts, Log("preempted", f"{ck}, {budget}", fields), Requeue()]


def _requeued(s: State, ev: Requeued) -> Result:
    if s.phase is not Phase.PREEMPTED or s.requeue_at is not None:
        return s, []
    code = s.pending_code if s.pending_code is not None else ExitCode.PREEMPTED_NO_CHECKPOINT
    if ev.outcome == "failed":
        return _stop(
            s,
            Phase.REQUEUE_FAILED,
            ExitCode.REQUEUE_FAILED,
            "requeue_failed",
            f"requeue failed: {ev.detail}; the checkpoint is intact, resubmit",
        )
    if ev.outcome == "restart_here" and not s.self_term:
        s = _r(s, phase=Phase.PREFLIGHT)
        return s, [Log("requeue", "restarting here", {"outcome": ev.outcome}), RunPreflight()]
    msg = (
        "this supervisor or machine is being stopped (SIGTERM or a machine notice): not "
        "restarting in place; `ckrun run` or `ckrun submit` again resumes"
        if ev.outcome == "restart_here"
        else f"requeued by the scheduler{': ' + ev.detail if ev.detail else ''}"
    )
    s = _r(s, exit_code=int(code))
    return s, [
        Log("requeue", msg, {"outcome": ev.outcome, "exit_code": int(code)}),
        Exit(int(code)),
    ]
