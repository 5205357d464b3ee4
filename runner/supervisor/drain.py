"""The machine's transitions for what drains a child: a notice, Ctrl-C, a forwarded
signal, and the delivery count of the notice signal (DESIGN.md §4.5).

Pure functions of :class:`~ckrun.supervisor.state.State` and one event, called by
:func:`ckrun.supervisor.machine.step` (which adds the :class:`Persist` of changed budgets).

* A notice while ``RUNNING`` with a child: ``DRAINING`` with the deadline
  ``min(notice deadline, now + grace_s)``; ``notice.json`` is written, then the signal
  delivered.  While draining, an earlier deadline moves it; a later one is ignored.  During
  preflight it stops the start; while a requeue is pending it is already counted (one
  notice, one requeue); with no child (back-off) it counts one preemption at once.
* :class:`Delivered` with count 0 (no process catches the notice signal): the notice is
  delivered as SIGTERM at once.
* Ctrl-C (:class:`Interrupt`): the first is a save-and-stop notice (CANCELLED, exit 130);
  a second within ``interrupt_window_s`` KILLs the child's session at once.
* HUP/QUIT (:class:`Forward`) go to the child's group; with no child they stop the run.
"""

from __future__ import annotations

import signal
from typing import Any

from ckrun.errors import ExitCode
from ckrun.supervisor.messages import (
    Deliver,
    Delivered,
    Forward,
    Interrupt,
    Kill,
    Log,
    NoticeEvent,
    SignalGroup,
    WriteNotice,
)
from ckrun.supervisor.outcomes import INTERRUPTED, Result, preempted, stop, update
from ckrun.supervisor.state import Phase, State


def on_notice(s: State, ev: NoticeEvent) -> Result:
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


def on_interrupt(s: State, ev: Interrupt) -> Result:
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
        return s, []  # the Preflighted step stops
    s, acts = on_notice(
        s, NoticeEvent("termination", "signal:SIGINT", ev.now + s.policy.grace_s, ev.now)
    )
    return update(s, cancel=True), [
        *acts,
        Log(
            "interrupt",
            f"Ctrl-C: saving, then stopping (Ctrl-C again within {window:g} s: stop at once)",
        ),
    ]


def on_forward(s: State, ev: Forward) -> Result:
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


def on_delivered(s: State, ev: Delivered) -> Result:
    if ev.count or s.phase is not Phase.DRAINING or not s.child:
        return s, []
    return s, [
        SignalGroup(signal.SIGTERM),
        Log(
            "deliver_term",
            "no process of the command catches the notice signal: delivered the notice as SIGTERM",
        ),
    ]
