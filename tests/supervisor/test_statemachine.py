"""DESIGN.md §4.5 as transition tables of the pure ``step()``: no processes, no clock."""

from __future__ import annotations

import dataclasses
import signal
from typing import Any

import pytest
from ckrun.supervisor import machine as sm
from ckrun.supervisor.machine import Phase

P = sm.Policy(
    max_requeues=2,
    max_failures=3,
    crash_loop_failures=2,
    grace_s=30.0,
    margin_s=2.0,
    kill_delay_s=5.0,
    backoff_s=1.0,
    backoff_max_s=3.0,
)


def st(**kw: Any) -> sm.State:
    return dataclasses.replace(sm.State(policy=P), **kw)


def running(**kw: Any) -> sm.State:
    base: dict[str, object] = dict(phase=Phase.RUNNING, attempt=1, child=True, base_step=10)
    base.update(kw)
    return st(**base)


def draining(**kw: Any) -> sm.State:
    base = dict(
        phase=Phase.DRAINING,
        notice_at=100.0,
        deadline=130.0,
        notice_kind="drill",
        notice_source="cli:preempt",
    )
    base.update(kw)
    return running(**base)


def kinds(actions: list[sm.Action]) -> list[str]:
    return [
        type(a).__name__
        + (f":{a.kind}" if isinstance(a, sm.Log) else "")
        + (f":{a.code}" if isinstance(a, sm.Exit) else "")
        for a in actions
    ]


# (name, state, event, expected phase, expected action kinds)
TABLE = [
    (
        "preflight complete",
        st(),
        sm.Preflighted("complete", 50),
        Phase.ALREADY_COMPLETE,
        ["Log:already_complete", "Exit:0"],
    ),
    (
        "preflight incompatible",
        st(),
        sm.Preflighted("incompatible", 50, ("launch_hash: a → b",)),
        Phase.INCOMPATIBLE,
        ["Log:incompatible", "Exit:4"],
    ),
    (
        "preflight ready",
        st(),
        sm.Preflighted("ready", 50),
        Phase.RUNNING,
        ["Spawn", "Log:attempt_start"],
    ),
    (
        "preflight cancelled",
        st(),
        sm.Preflighted("cancelled"),
        Phase.CANCELLED,
        ["Log:cancelled", "Exit:0"],
    ),
    (
        "child exits 0",
        running(),
        sm.ChildExited(0, 20, True, 5.0),
        Phase.COMPLETED,
        ["Log:child_exit", "Log:completed", "Exit:0"],
    ),
    (
        "child fails, budget left",
        running(),
        sm.ChildExited(1, 20, False, 5.0),
        Phase.RUNNING,
        ["Persist", "Log:child_exit", "Log:backoff"],
    ),
    (
        "child fails, budget spent",
        running(failures=3),
        sm.ChildExited(1, 20, False, 5.0),
        Phase.FAILED,
        ["Persist", "Log:child_exit", "Log:failed", "Exit:1"],
    ),
    (
        "child fails, no progress (crash loop)",
        running(no_progress=1),
        sm.ChildExited(1, 10, False, 5.0),
        Phase.FAILED,
        ["Persist", "Log:child_exit", "Log:failed", "Exit:1"],
    ),
    (
        "child exits 4 with the library's record",
        running(),
        sm.ChildExited(4, 10, reason="incompatible"),
        Phase.INCOMPATIBLE,
        ["Log:child_exit", "Log:incompatible", "Exit:4"],
    ),
    (
        "child exits 4 on its own: a failure (issue 11 item 8)",
        running(),
        sm.ChildExited(4, 10),
        Phase.RUNNING,
        ["Persist", "Log:child_exit", "Log:backoff"],
    ),
    (
        "child exits 3 with the library's record",
        running(),
        sm.ChildExited(3, 10, reason="config_invalid"),
        Phase.FAILED,
        ["Log:child_exit", "Log:failed", "Exit:3"],
    ),
    (
        "child exits 3 on its own: a failure",
        running(),
        sm.ChildExited(3, 10),
        Phase.RUNNING,
        ["Persist", "Log:child_exit", "Log:backoff"],
    ),
    (
        "child exits 5 with StorageFull's record: stop, not retried (item 10)",
        running(),
        sm.ChildExited(5, 10, reason="storage_full", detail="no space left"),
        Phase.FAILED,
        ["Log:child_exit", "Log:failed", "Exit:5"],
    ),
    (
        "child exits 5 finding every checkpoint damaged: stop, a restart cannot help",
        running(),
        sm.ChildExited(5, 10, reason="checkpoints_unusable", detail="step 1 is unusable"),
        Phase.FAILED,
        ["Log:child_exit", "Log:failed", "Exit:5"],
    ),
    (
        "child exits 75 on its own",
        running(),
        sm.ChildExited(75, 11, False, 5.0),
        Phase.PREEMPTED,
        ["Persist", "Log:child_exit", "Log:preempted", "Requeue"],
    ),
    (
        "notice",
        running(),
        sm.NoticeEvent("drill", "cli", 1000.0, 100.0),
        Phase.DRAINING,
        ["WriteNotice", "Deliver", "Log:notice"],
    ),
    (
        "INT forwarded",
        running(),
        sm.Forward(int(signal.SIGINT)),
        Phase.RUNNING,
        ["SignalGroup", "Log:forward"],
    ),
    (
        "second notice",
        draining(),
        sm.NoticeEvent("preemption", "aws", 120.0, 101.0),
        Phase.DRAINING,
        ["Log:notice"],
    ),
    (
        "draining child exits",
        draining(),
        sm.ChildExited(75, 11, False, 101.0, 0.4),
        Phase.PREEMPTED,
        ["Persist", "Log:child_exit", "Log:preempted", "Requeue"],
    ),
    (
        "deadline minus margin",
        draining(),
        sm.Tick(128.0),
        Phase.STOPPING,
        ["Escalate", "Log:escalate"],
    ),
    # item 4: KILL at deadline - margin (128), TERM kill_delay (5 s) before it
    ("before TERM nothing", draining(), sm.Tick(122.9), Phase.DRAINING, []),
    (
        "TERM kill_delay before deadline minus margin",
        draining(),
        sm.Tick(123.0),
        Phase.STOPPING,
        ["Escalate", "Log:escalate"],
    ),
    (
        "stopping kill delay",
        draining(phase=Phase.STOPPING, kill_at=133.0),
        sm.Tick(133.0),
        Phase.STOPPING,
        ["Kill", "Log:kill"],
    ),
    (
        "stopping child exits",
        draining(phase=Phase.STOPPING, kill_at=133.0),
        sm.ChildExited(143, 10, False, 131.0),
        Phase.PREEMPTED,
        ["Persist", "Log:child_exit", "Log:preempted", "Requeue"],
    ),
]


@pytest.mark.parametrize("name,state,event,phase,actions", TABLE, ids=[t[0] for t in TABLE])
def test_transition(
    name: str, state: sm.State, event: sm.Event, phase: Phase, actions: list[str]
) -> None:
    new, acts = sm.step(state, event)
    assert new.phase is phase
    assert kinds(acts) == actions


def test_notice_deadline_capped_by_grace_and_second_keeps_earlier() -> None:
    s, acts = sm.step(running(), sm.NoticeEvent("preemption", "aws", 500.0, 100.0))
    assert s.deadline == 130.0  # grace 30 s caps the 400 s notice
    assert isinstance(acts[0], sm.WriteNotice) and acts[0].seconds_left == 30.0
    s2, _ = sm.step(s, sm.NoticeEvent("preemption", "gcp", 120.0, 101.0))
    assert s2.deadline == 120.0
    s3, _ = sm.step(s2, sm.NoticeEvent("drill", "cli", 125.0, 102.0))
    assert s3.deadline == 120.0


def test_preempted_exit_code_tells_new_checkpoint_from_none() -> None:
    s, _ = sm.step(draining(), sm.ChildExited(75, 11, False, 101.0))
    s, acts = sm.step(s, sm.Requeued("requeued"))
    assert acts[-1] == sm.Exit(75)
    s, _ = sm.step(draining(), sm.ChildExited(75, 10, False, 101.0))  # no newer commit
    s, acts = sm.step(s, sm.Requeued("requeued"))
    assert acts[-1] == sm.Exit(76)


def test_restart_here_goes_back_to_preflight_unless_supervisor_terminated() -> None:
    s, _ = sm.step(draining(), sm.ChildExited(75, 11, False, 101.0))
    s2, acts = sm.step(s, sm.Requeued("restart_here"))
    assert s2.phase is Phase.PREFLIGHT and isinstance(acts[-1], sm.RunPreflight)
    s, _ = sm.step(draining(self_term=True), sm.ChildExited(75, 11, False, 101.0))
    s2, acts = sm.step(s, sm.Requeued("restart_here"))
    assert acts[-1] == sm.Exit(75) and s2.exit_code == 75


def test_requeue_failure_exits_6() -> None:
    s, _ = sm.step(draining(), sm.ChildExited(75, 11, False, 101.0))
    s, acts = sm.step(s, sm.Requeued("failed", "scontrol: permission denied"))
    assert s.phase is Phase.REQUEUE_FAILED and acts[-1] == sm.Exit(6)


def test_requeue_budget_counts_preemptions() -> None:
    s, acts = sm.step(draining(preemptions=2), sm.ChildExited(75, 11, False, 101.0))
    assert s.preemptions == 3 and acts[-1] == sm.Exit(75)
    assert "budget spent" in [a for a in acts if isinstance(a, sm.Log)][-1].message


def test_backoff_doubles_and_is_capped_then_preflight() -> None:
    s = running()
    delays = []
    for i in range(3):
        s, acts = sm.step(
            dataclasses.replace(s, child=True, phase=Phase.RUNNING),
            sm.ChildExited(1, 11 + i, False, 10.0 * i),
        )
        assert s.respawn_at is not None
        delays.append(s.respawn_at - 10.0 * i)
        s = dataclasses.replace(s, base_step=11 + i)
    assert delays == [1.0, 2.0, 3.0]
    assert s.respawn_at is not None
    s2, acts = sm.step(s, sm.Tick(s.respawn_at - 0.01))
    assert acts == []
    s2, acts = sm.step(s, sm.Tick(s.respawn_at))
    assert s2.phase is Phase.PREFLIGHT and acts == [sm.RunPreflight()]


def test_progress_resets_the_crash_loop_guard() -> None:
    s, _ = sm.step(running(no_progress=1), sm.ChildExited(1, 12, False, 1.0))
    assert s.phase is Phase.RUNNING and s.no_progress == 0


def test_forwarded_int_then_exit_stops_without_restart() -> None:
    s, _ = sm.step(running(), sm.Forward(int(signal.SIGINT)))
    s, acts = sm.step(s, sm.ChildExited(130, 10, False, 1.0))
    assert s.phase is Phase.FAILED and acts[-1] == sm.Exit(1)


def test_cancel_drains_then_stops_with_0() -> None:
    s, _ = sm.step(running(), sm.NoticeEvent("termination", "cli:cancel", 999.0, 1.0, cancel=True))
    assert s.phase is Phase.DRAINING
    s, acts = sm.step(s, sm.ChildExited(75, 11, False, 2.0))
    assert s.phase is Phase.CANCELLED and acts[-1] == sm.Exit(0)


def test_notice_during_backoff_needs_no_drain() -> None:
    s = running(child=False, respawn_at=50.0)
    s, acts = sm.step(s, sm.NoticeEvent("drill", "cli", 999.0, 10.0))
    assert s.phase is Phase.PREEMPTED and isinstance(acts[-1], sm.Requeue)


def test_spawn_failure_fails_with_reason() -> None:
    s, _ = sm.step(st(), sm.Preflighted("ready"))
    s, acts = sm.step(s, sm.SpawnFailed("cannot run 'nope': No such file"))
    assert s.phase is Phase.FAILED and acts[-1] == sm.Exit(1) and "nope" in s.why


def test_attempt_ids_are_zero_based_and_continue() -> None:
    s, acts = sm.step(st(attempt=3), sm.Preflighted("ready", 7))
    assert acts[0] == sm.Spawn(3, 7) and s.attempt == 4


def test_terminal_states_ignore_events() -> None:
    s, _ = sm.step(st(), sm.Preflighted("complete"))
    assert sm.step(s, sm.NoticeEvent("drill", "cli", 1.0)) == (s, [])


# ---------------------------------------------------------------- issue 11
def test_notice_while_the_requeue_is_pending_counts_once() -> None:
    # item 9: PREEMPTED waits for Requeued; a notice then is logged, not counted again
    s, acts = sm.step(draining(), sm.ChildExited(75, 11, False, 101.0))
    assert s.phase is Phase.PREEMPTED and isinstance(acts[-1], sm.Requeue)
    s2, acts2 = sm.step(s, sm.NoticeEvent("termination", "signal:SIGTERM", 200.0, 102.0))
    assert s2.preemptions == s.preemptions and kinds(acts2) == ["Log:notice"]


def test_notice_during_preflight_does_not_start_the_command() -> None:
    s, acts = sm.step(st(), sm.NoticeEvent("drill", "cli", 999.0, 1.0))
    assert s.notice_pending and kinds(acts) == ["Log:notice"]
    s, acts = sm.step(s, sm.Preflighted("ready", 7, now=2.0))
    assert s.phase is Phase.PREEMPTED and s.preemptions == 1
    assert not any(isinstance(a, sm.Spawn) for a in acts) and isinstance(acts[-1], sm.Requeue)


def test_second_notice_during_back_off_counts_once() -> None:
    s = running(child=False, respawn_at=50.0)
    s, _ = sm.step(s, sm.NoticeEvent("drill", "cli", 999.0, 10.0))
    s2, acts = sm.step(s, sm.NoticeEvent("drill", "cli", 999.0, 11.0))
    assert s2.preemptions == 1 and kinds(acts) == ["Log:notice"]


def test_exit_0_after_an_unacknowledged_notice_is_completed() -> None:
    # item 13: no exit-reason record: the script finished, it is not requeued
    s, acts = sm.step(draining(), sm.ChildExited(0, 10, False, 105.0))
    assert s.phase is Phase.COMPLETED and acts[-1] == sm.Exit(0)
    # with the library's record ("preempted") it is a preemption
    s, acts = sm.step(draining(), sm.ChildExited(0, 11, False, 105.0, reason="preempted"))
    assert s.phase is Phase.PREEMPTED


def test_no_process_catches_the_notice_then_term_at_once() -> None:
    s, acts = sm.step(draining(), sm.Delivered(0, 100.0))
    assert acts[0] == sm.SignalGroup(int(signal.SIGTERM))
    assert sm.step(draining(), sm.Delivered(2, 100.0))[1] == []


def test_strays_timers() -> None:
    # item 3: TERM stray_s after the command's exit, KILL stray_s later, unless saving
    s, acts = sm.step(running(), sm.LeaderExited(0, 10.0))
    assert s.strays_term_at == 12.0 and kinds(acts) == ["Log:strays"]
    assert sm.step(s, sm.Tick(11.9))[1] == []
    s, acts = sm.step(s, sm.Tick(12.0))
    assert acts[0] == sm.SignalGroup(int(signal.SIGTERM)) and s.strays_kill_at == 14.0
    s, acts = sm.step(s, sm.Tick(14.0))
    assert acts[0] == sm.Kill()
    saving, _ = sm.step(draining(), sm.LeaderExited(0, 101.0, saving=True))
    assert saving.strays_term_at is None  # a notified process may still be saving


def test_ctrl_c_once_saves_twice_kills() -> None:
    s, acts = sm.step(running(), sm.Interrupt(100.0))
    assert s.phase is Phase.DRAINING and s.cancel and s.ctrl_c
    assert isinstance(acts[0], sm.WriteNotice) and isinstance(acts[1], sm.Deliver)
    s2, acts2 = sm.step(s, sm.Interrupt(102.0))
    assert acts2[0] == sm.Kill()
    s3, acts3 = sm.step(s, sm.ChildExited(75, 11, False, 103.0))
    assert s3.phase is Phase.CANCELLED and acts3[-1] == sm.Exit(130)


def test_no_progress_preemption_streak_stops_and_backs_off() -> None:
    # item 7: the streak grows on preemptions without a new checkpoint, backs off from
    # the second one, and stops the run at the limit; progress resets it
    p = dataclasses.replace(P, no_progress_preemptions=3, max_requeues=100)
    s = dataclasses.replace(running(), policy=p)
    s1, acts = sm.step(s, sm.ChildExited(75, 10, False, 5.0))
    assert s1.streak == 1 and isinstance(acts[-1], sm.Requeue)
    s2, acts = sm.step(
        dataclasses.replace(s1, phase=Phase.RUNNING, child=True), sm.ChildExited(75, 10, False, 6.0)
    )
    assert s2.streak == 2 and s2.requeue_at == 7.0 and "Requeue" not in kinds(acts)
    assert sm.step(s2, sm.Tick(7.0))[1] == [sm.Requeue()]
    s3, acts = sm.step(
        dataclasses.replace(s2, phase=Phase.RUNNING, child=True, requeue_at=None),
        sm.ChildExited(143, 10, False, 9.0),
    )
    assert s3.phase is Phase.FAILED and acts[-1] == sm.Exit(1) and "requeue storm" in s3.why
    ok, _ = sm.step(
        dataclasses.replace(s2, phase=Phase.RUNNING, child=True, requeue_at=None),
        sm.ChildExited(75, 12, False, 9.0, reason="preempted"),
    )
    assert ok.streak == 0
    # a new supervisor with the persisted streak does not start the command
    s4, acts = sm.step(dataclasses.replace(st(), policy=p, streak=3), sm.Preflighted("ready", 10))
    assert s4.phase is Phase.FAILED and not any(isinstance(a, sm.Spawn) for a in acts)


def test_budget_changes_are_persisted_first() -> None:
    _, acts = sm.step(running(), sm.ChildExited(1, 20, False, 5.0))
    assert isinstance(acts[0], sm.Persist)
    _, acts = sm.step(running(), sm.NoticeEvent("drill", "cli", 1000.0, 100.0))
    assert not any(isinstance(a, sm.Persist) for a in acts)


def test_only_the_record_makes_an_own_exit_75_a_preemption_with_a_commit() -> None:
    # item 8: without a notice, a 75 with a newer step in storage but no record is a
    # preemption without a commit (76, streak); with the library's record it is 75
    s, _ = sm.step(running(), sm.ChildExited(75, 11, False, 5.0))
    assert s.pending_code == 76 and s.streak == 1
    s, _ = sm.step(running(), sm.ChildExited(75, 11, False, 5.0, reason="preempted"))
    assert s.pending_code == 75 and s.streak == 0


def test_drills_do_not_extend_the_no_progress_streak() -> None:
    # a chaos/`ckrun preempt` drill before the first step re-saves the resumed step
    s, _ = sm.step(draining(streak=2), sm.ChildExited(75, 10, False, 101.0))
    assert s.phase is Phase.PREEMPTED and s.streak == 2
    s, _ = sm.step(
        draining(streak=2, notice_kind="preemption"), sm.ChildExited(75, 10, False, 101.0)
    )
    assert s.streak == 3


def test_a_completion_marker_decides_even_when_a_late_notice_killed_the_exit() -> None:
    # item 6: the command wrote COMPLETE.json, then a notice's SIGTERM landed while it was
    # exiting (status 143): the run is COMPLETED, never restarted into ALREADY_COMPLETE
    s, acts = sm.step(draining(), sm.ChildExited(143, 40, True, 105.0))
    assert s.phase is Phase.COMPLETED and acts[-1] == sm.Exit(0)
    assert s.preemptions == 0
    s, acts = sm.step(running(), sm.ChildExited(75, 40, True, 105.0, reason="preempted"))
    assert s.phase is Phase.COMPLETED and acts[-1] == sm.Exit(0)
    # without the marker, the same exit is still a preemption
    s, _ = sm.step(draining(), sm.ChildExited(143, 40, False, 105.0))
    assert s.phase is Phase.PREEMPTED


def test_a_forwarded_hangup_the_library_saved_on_stops_resumable() -> None:
    """A hung-up terminal (SIGHUP forwarded) that the library turned into a save: the
    work is kept, so the run stops CANCELLED (exit 128 + SIGHUP) and ``ckrun submit``
    resumes it; a plain script killed by the same signal still fails (above)."""
    s, _ = sm.step(running(), sm.Forward(int(signal.SIGHUP)))
    s, acts = sm.step(s, sm.ChildExited(75, 14, False, 1.0, reason="preempted"))
    assert s.phase is Phase.CANCELLED, s.phase
    assert acts[-1] == sm.Exit(128 + int(signal.SIGHUP))
    msgs = " ".join(a.message for a in acts if isinstance(a, sm.Log))
    assert "SIGHUP" in msgs and "ckrun submit" in msgs and "14" in msgs
