"""The machine's timers: strays after the command's exit, the escalation of a notice
(TERM, then KILL, inside ``grace_s``), the back-off before a restart and the delay before
a requeue (DESIGN.md §4.5).

Every timer is a field of :class:`~ckrun.supervisor.state.State` (monotonic seconds); the
loop only feeds :class:`Tick` and :class:`LeaderExited`, and these pure functions decide.

* Strays: once the command's own process has exited, what is left of its session gets
  TERM ``stray_s`` later and KILL ``stray_s`` after that (unless a notified process is
  still saving; then the notice deadline applies).
* Escalation: TERM at ``term_at`` and KILL at ``kill_at`` (:meth:`Policy.escalation`).
  ``STOPPING`` + KILL *stays* in ``STOPPING`` until the child is reaped; the
  ``PREEMPTED`` step then has the real exit status and the storage check.
"""

from __future__ import annotations

import signal

from ckrun.supervisor.messages import (
    Action,
    Escalate,
    Kill,
    LeaderExited,
    Log,
    Requeue,
    RunPreflight,
    SignalGroup,
    Tick,
)
from ckrun.supervisor.outcomes import Result, update
from ckrun.supervisor.state import Phase, State


def on_leader_exited(s: State, ev: LeaderExited) -> Result:
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


def on_tick(s: State, ev: Tick) -> Result:
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
