"""Honest goodput (``ckrun.report.goodput``) on scripted histories with known answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckrun.cli import status as runstatus
from ckrun.report import goodput
from ckrun.report.history import parse
from report_scripted import T0, Script, five_of_three_hundred, stormy


def test_five_of_three_hundred_steps_is_not_eighty_percent(tmp_path: Path) -> None:
    # The case: 5 steps in 5 two-second attempts showed 82.8 % before.
    rd = five_of_three_hundred().write(tmp_path, "FAILED", 75)
    s = runstatus.summarize(rd)
    assert s["wall_s"] == pytest.approx(12.0)
    assert s["productive_s"] == pytest.approx(1.0)
    assert s["goodput"] == pytest.approx(1 / 12, abs=1e-4)
    ov = s["overheads_s"]
    assert ov["startup"] == pytest.approx(7.25)
    assert ov["restore"] == pytest.approx(0.25)
    assert ov["saving"] == pytest.approx(1.0)
    assert ov["shutdown"] == pytest.approx(0.5)
    assert ov["waiting"] == pytest.approx(2.0)
    assert ov["lost"] == 0 and ov["unsaved"] == 0
    assert s["productive_steps"] == 5 and s["lost_steps"] == 0
    assert s["preemptions"] == 5
    assert sum(ov.values()) + s["productive_s"] == pytest.approx(s["wall_s"])
    text = runstatus.render(s)
    assert "goodput 8.3%" in text and "start-up 7.2 s" in text
    # compact: 5 drills are summed up, not listed line by line
    assert "notices: 5 from chaos, lead 60 s" in text
    assert "5 interruption(s) lost no steps" in text and "attempt 3: preemption" not in text
    assert len(text.splitlines()) == 5 + 1 + 5 + 2  # header 5, legend, bars, 2 summaries


def test_recomputed_steps_are_lost_when_a_later_attempt_resumes_from_an_older_commit() -> None:
    # Attempt 0 commits 10 and 20, then crashes; attempt 1 resumes from 10 (20 unusable):
    # the training from 10 to 20 is recomputed, so it is lost, not productive.
    s = Script()
    s.attempt(
        0,
        0.0,
        resume=None,
        startup=1.0,
        restore=0.0,
        saves=[(10, 6.0, 1.0), (20, 11.0, 1.0)],
        end=13.0,
        status=1,
        outcome="failure",
    )
    s.attempt(
        1,
        14.0,
        resume=10,
        startup=1.0,
        restore=1.0,
        saves=[(20, 21.0, 1.0)],
        end=21.5,
        status=0,
        outcome="completed",
    )
    acc = goodput.account(parse(s.events), T0.timestamp() + 100, 20)
    a0, a1 = acc.attempts
    assert (a0.base, a0.kept) == (-1, 10) and (a1.base, a1.kept) == (10, 20)
    assert a0.seconds("productive") == pytest.approx(4.0)  # 1 -> 5 (step 10 captured at 5)
    assert a0.seconds("lost") == pytest.approx(4.0 + 2.0)  # 6 -> 10 and 11 -> 13
    assert a0.seconds("saving") == pytest.approx(2.0)
    # 11 steps (0..10) in 4 productive seconds: 6 lost seconds are ~16.5 steps (estimated)
    assert a0.lost_steps == pytest.approx(16.5) and a0.lost_estimated
    assert a1.seconds("productive") == pytest.approx(4.0)  # 16 -> 20
    assert a1.seconds("shutdown") == pytest.approx(0.5)
    tot = acc.totals
    assert tot["waiting"] == pytest.approx(1.0)
    assert sum(tot.values()) == pytest.approx(acc.wall_s) == pytest.approx(21.5)
    assert acc.goodput == pytest.approx(8.0 / 21.5)
    assert acc.productive_steps == 21  # steps 0..20


def test_running_attempt_counts_unsaved_work_apart() -> None:
    s = Script()
    s.ev(0.0, 0, "spawn").ev(0.0, 0, "attempt_start")
    s.ev(2.0, 0, "restore", seconds=0.5).ev(6.0, 0, "save", step=100, seconds=1.0)
    acc = goodput.account(parse(s.events), T0.timestamp() + 10.0)
    (a,) = acc.attempts
    # no commit recorded yet for a live attempt: nothing is kept, nothing lost
    assert a.seconds("startup") == pytest.approx(1.5)
    assert a.seconds("restore") == pytest.approx(0.5)
    assert a.seconds("saving") == pytest.approx(1.0)
    assert a.seconds("unsaved") == pytest.approx(7.0)
    assert a.seconds("lost") == 0 and acc.goodput == 0


def test_stormy_history_accounts_every_second(tmp_path: Path) -> None:
    s = runstatus.summarize(stormy().write(tmp_path, "REQUEUE_FAILED", 77))
    assert (s["attempts"], s["preemptions"], s["failures"]) == (4, 3, 1)
    ov = s["overheads_s"]
    assert sum(ov.values()) + s["productive_s"] == pytest.approx(s["wall_s"]) == 38.5
    fail = next(i for i in s["interruptions"] if i["interruption"] == "failure")
    assert fail["attempt"] == 1 and fail["lost_training_s"] == pytest.approx(4.0)
    assert s["requeue_refusals"] == [{"attempt": 3, "at_s": 38.5}]
    assert [n["source"] for n in s["notices"]] == ["chaos", "aws", "signal:SIGUSR1"]
    assert [n["lead_s"] for n in s["notices"]] == [60.0, 120.0, 30.0]


def test_status_json_is_numbers_not_sentences(tmp_path: Path) -> None:
    s = runstatus.summarize(stormy().write(tmp_path, "REQUEUE_FAILED", 77))
    iv = s["interval"]
    assert isinstance(iv, dict)
    for k in ("interval_s", "mtbi_s", "exposure_s"):
        assert isinstance(iv[k], float), (k, iv)
    assert isinstance(iv["interruptions"], int)

    def walk(x: object, path: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        elif isinstance(x, str):
            assert " " not in x or path in (".command",), f"sentence at {path}: {x!r}"

    walk({k: v for k, v in s.items() if k not in ("command", "supervisor")}, "")


def test_a_killed_supervisor_is_reported_as_such(tmp_path: Path) -> None:
    # (issue 11's state, kept by the report) the last supervisor left no exit record
    s = Script()
    s.ev(0, 0, "supervisor_start").ev(0, 0, "spawn").ev(9, 0, "attempt_end", status=75)
    s.ev(9, 0, "supervisor_exit", state="PREEMPTED", exit_code=75)
    s.ev(20, 1, "supervisor_start").ev(20, 1, "spawn").ev(22, 1, "restore", seconds=0.5)
    st = runstatus.summarize(s.write(tmp_path))
    assert st["state"] == "SUPERVISOR_DIED" and st["exit_code"] is None
    assert "its supervisor was killed" in runstatus.render(st)
    # its attempt ends at its last report, not now: no unsaved work grows forever
    assert st["wall_s"] == pytest.approx(22.0)


def test_a_save_made_after_the_supervisor_was_killed_is_not_counted_lost(tmp_path: Path) -> None:
    # kill -9 of the supervisor: its child gets SIGTERM (parent-death signal), takes it as
    # a notice and commits step 25 (its own `save` event); no attempt_end is ever
    # written.  The attempt was shown "productive 0.0 s to step 17, lost 7.4 s / ? steps".
    s = Script()
    s.ev(0, 0, "supervisor_start").ev(0, 0, "spawn").ev(2, 0, "restore", step=17, seconds=0.5)
    s.ev(9.5, 0, "save", step=25, seconds=0.5, mode="sync")
    st = runstatus.summarize(s.write(tmp_path))
    assert st["state"] == "SUPERVISOR_DIED"
    a = st["attempt_detail"][-1]
    assert a["saved_step"] == 25 and a["lost_s"] == 0, a
    assert st["overheads_s"]["lost"] == 0 and st["productive_s"] == pytest.approx(7.0)


def test_a_resubmitted_complete_run_stays_completed(tmp_path: Path) -> None:
    """`ckrun submit` of a run that is already complete starts nothing and exits 0 (its
    supervisor ends ALREADY_COMPLETE); `ckrun status` and `ckrun runs` said the run's
    state was ALREADY_COMPLETE from then on (and the runs table lost its alignment).
    The run is COMPLETED; the re-submit changed nothing."""
    rd = five_of_three_hundred().write(tmp_path, "ALREADY_COMPLETE", 0)
    s = runstatus.summarize(rd)
    assert s["state"] == "COMPLETED"
