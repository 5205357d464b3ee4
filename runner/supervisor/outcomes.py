"""How an attempt ends: the exit-status half of :func:`ckrun.supervisor.machine.step`.

Pure, like the machine: a reaped child (:class:`ChildExited`), the scheduler's answer to a
requeue (:class:`Requeued`) and the stops they lead to.  The rules (DESIGN.md §4.5,
issue 11 items 7, 8, 10, 13):

* status 0 is a completion unless the library's exit-reason record says the process
  stopped for a notice (a script that never acknowledged a notice and finished has
  completed; it is never trained again);
* 3, 4 and 5 are ckrun's (invalid config, incompatible checkpoint, storage) only with
  the library's record; otherwise they are ordinary failures of the command;
* 75, 76 or death by SIGTERM without a notice is a preemption, "with a commit" (exit 75)
  only with the library's record and a newer step in storage; a preemption without a
  new checkpoint (a drill's excepted) extends the no-progress streak, which backs off
  from its second preemption and stops the run at ``no_progress_preemptions`` (a
  requeue storm);
* every other status is a failure: back-off, failure budget, crash-loop guard.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

from ckrun.errors import ExitCode
from ckrun.supervisor.messages import (
    Action,
    ChildExited,
    Exit,
    Log,
    Requeue,
    Requeued,
    RequeueResult,
    RunPreflight,
)
from ckrun.supervisor.state import Phase, State

_TERMINATED_BY_TERM = 128 + int(signal.SIGTERM)
#: Exit code after Ctrl-C (130: 128 + SIGINT, the shell convention).
INTERRUPTED = int(ExitCode.INTERRUPTED)
#: Exit-reason records that make a status 5 the library's (see ChildExited.reason).
_STORAGE_REASONS = ("storage_full", "storage_denied", "checkpoints_unusable")

Result = tuple[State, list[Action]]


def update(s: State, **kw: Any) -> State:
    return dataclasses.replace(s, **kw)


def stop(s: State, phase: Phase, code: int, kind: str, msg: str, **f: Any) -> Result:
    s = update(s, phase=phase, exit_code=code, why=msg, child=False)
    return s, [Log(kind, msg, dict(f, exit_code=code)), Exit(code)]


def lost(s: State, ck: str = "") -> Result:
    """The run's lease was taken over (DESIGN.md §7): exit 2, never requeue."""
    return stop(
        s,
        Phase.LEASE_LOST,
        ExitCode.USAGE,
        "lease_lost",
        "the run's lease was taken over by another supervisor: this one stops without "
        "requeueing" + (f"; {ck}" if ck else ""),
    )


def newer(step: int | None, base: int | None) -> bool:
    return step is not None and (base is None or step > base)


def storm(s: State, step_: int | None) -> Result:
    return stop(
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


def exited(s: State, ev: ChildExited) -> Result:
    if not s.child:
        return s, []
    progress = newer(ev.newest_step, s.base_step)
    s = update(s, child=False)
    log = Log(
        "child_exit",
        f"child exited with status {ev.status}"
        + (f" ({ev.reason}: {ev.detail})" if ev.reason else ""),
        {"status": ev.status, "step": ev.newest_step, "reason": ev.reason},
    )
    # The completion marker decides first: a command that wrote COMPLETE.json has
    # finished, whatever a notice that landed while it was exiting made of its status.
    if ev.complete or (ev.status == 0 and ev.reason != "preempted"):
        if not ev.complete:
            tail = " (no COMPLETE.json: the command did not finalize)"
        elif ev.status != 0:
            tail = f" (COMPLETE.json written; the command then ended with status {ev.status})"
        else:
            tail = ""
        s = update(s, streak=0)
        s, acts = stop(
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
    s = update(s, preemptions=s.preemptions + 1)
    return preempted(s, progress, ev.now, [log], ev.newest_step, ev.save_s)


def _library_exit(s: State, ev: ChildExited) -> Result | None:
    """Exit 3/4/5 with the library's record: the run stops (retrying cannot help)."""
    if ev.status == ExitCode.INCOMPATIBLE and ev.reason == "incompatible":
        return stop(
            s,
            Phase.INCOMPATIBLE,
            ExitCode.INCOMPATIBLE,
            "incompatible",
            f"the command refused the checkpoint as incompatible: {ev.detail or 'exit 4'}",
        )
    if ev.status == ExitCode.CONFIG_INVALID and ev.reason == "config_invalid":
        return stop(
            s,
            Phase.FAILED,
            ExitCode.CONFIG_INVALID,
            "failed",
            f"the command reported an invalid config: {ev.detail or 'exit 3'}",
        )
    if ev.status == ExitCode.STORAGE_ERROR and ev.reason in _STORAGE_REASONS:
        return stop(
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
    if s.interrupted is not None and ev.reason == "preempted":
        # the library took the forwarded HUP/QUIT as a notice and committed: a hung-up
        # terminal keeps the work and the run stays resumable, like Ctrl-C
        name = signal.Signals(s.interrupted).name
        s, acts = stop(
            s,
            Phase.CANCELLED,
            128 + s.interrupted,
            "cancelled",
            f"child saved at step {ev.newest_step} and stopped after a forwarded {name}; "
            "`ckrun submit` resumes",
            step=ev.newest_step,
        )
        return s, [log, *acts]
    if s.interrupted is not None:
        name = signal.Signals(s.interrupted).name
        s, acts = stop(
            s,
            Phase.FAILED,
            ExitCode.CHILD_FAILED,
            "failed",
            f"child stopped after a forwarded {name}; not restarting",
        )
        return s, [log, *acts]
    if ev.status in (ExitCode.PREEMPTED, ExitCode.PREEMPTED_NO_CHECKPOINT, _TERMINATED_BY_TERM):
        s = update(
            s,
            preemptions=s.preemptions + 1,
            notice_kind="termination",
            notice_source="child",
            notice_at=ev.now,
        )
        # without a notice, only the library's record makes an exit 75 "preempted with a
        # commit": a script's own 75 is a preemption without one (the newest checkpoint
        # in storage is still where the next start resumes)
        vouched = ev.status == _TERMINATED_BY_TERM or ev.reason == "preempted"
        return preempted(s, progress and vouched, ev.now, [log], ev.newest_step, ev.save_s)
    failures = s.failures + 1
    no_progress = 0 if progress else s.no_progress + 1
    s = update(s, failures=failures, no_progress=no_progress)
    if failures > p.max_failures:
        s, acts = stop(
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
        s, acts = stop(
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
    s = update(s, respawn_at=ev.now + delay)
    return s, [
        log,
        Log(
            "backoff",
            f"failure {failures}/{p.max_failures}; restarting in {delay:g} s",
            {"seconds": delay, "failures": failures},
        ),
    ]


def preempted(
    s: State,
    progress: bool,
    now: float,
    acts: list[Action],
    step_: int | None = None,
    save_s: float | None = None,
) -> Result:
    code = ExitCode.PREEMPTED if progress else ExitCode.PREEMPTED_NO_CHECKPOINT
    s = update(
        s,
        phase=Phase.PREEMPTED,
        exit_code=None,
        child=False,
        # a drill (`ckrun preempt`, chaos) tests the resume path: it never extends the streak
        streak=0 if progress else s.streak + (s.notice_kind != "drill"),
    )
    took = now - (s.notice_at if s.notice_at is not None else now)
    save = f"committed in {save_s:.2f} s, " if save_s is not None else ""
    ck = (
        f"checkpoint step {step_} {save}child gone {took:.1f} s after the notice"
        if progress
        else f"no new checkpoint (last step {s.base_step})"
        if s.base_step is not None
        else "no checkpoint yet"
    )
    fields = {
        "step": step_ if progress else s.base_step,
        "seconds": round(took, 3),
        "save_s": save_s if progress else None,
        "new_checkpoint": progress,
        "exit_code": int(code),
    }
    if s.lease_lost:
        s, more = lost(s, ck)
        return s, [*acts, *more]
    if s.cancel:
        final = INTERRUPTED if s.ctrl_c else ExitCode.OK
        s, more = stop(s, Phase.CANCELLED, final, "cancelled", f"cancelled; {ck}", **fields)
        return s, [*acts, *more]
    budget = f"requeue {s.preemptions}/{s.policy.max_requeues}"
    if s.preemptions > s.policy.max_requeues:
        s = update(s, exit_code=int(code), why="requeue budget spent")
        return s, [
            *acts,
            Log("preempted", f"{ck}; {budget}: budget spent, not requeueing", fields),
            Exit(int(code)),
        ]
    limit = s.policy.no_progress_preemptions
    if limit and s.streak >= limit:
        s, more = storm(s, step_)
        return s, [*acts, Log("preempted", f"{ck}, {budget}", fields), *more]
    s = update(s, why=ck, pending_code=int(code))
    if s.streak > 1 and not s.self_term:  # no progress again: back off before the next start
        delay = s.policy.backoff(s.streak - 1)
        s = update(s, requeue_at=now + delay)
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


def requeued(s: State, ev: Requeued) -> Result:
    if s.phase is not Phase.PREEMPTED or s.requeue_at is not None:
        return s, []
    code = s.pending_code if s.pending_code is not None else ExitCode.PREEMPTED_NO_CHECKPOINT
    if ev.outcome == RequeueResult.FAILED:
        return stop(
            s,
            Phase.REQUEUE_FAILED,
            ExitCode.REQUEUE_FAILED,
            "requeue_failed",
            f"requeue failed: {ev.detail}; the checkpoint is intact, resubmit",
        )
    if ev.outcome == RequeueResult.RESTART_HERE and not s.self_term:
        s = update(s, phase=Phase.PREFLIGHT)
        return s, [Log("requeue", "restarting here", {"outcome": ev.outcome}), RunPreflight()]
    msg = (
        "this supervisor or machine is being stopped (SIGTERM or a machine notice): not "
        "restarting in place; `ckrun run` or `ckrun submit` again resumes"
        if ev.outcome == RequeueResult.RESTART_HERE
        else f"requeued by the scheduler{': ' + ev.detail if ev.detail else ''}"
    )
    s = update(s, exit_code=int(code))
    return s, [
        Log("requeue", msg, {"outcome": ev.outcome, "exit_code": int(code)}),
        Exit(int(code)),
    ]
