"""``ckrun status`` accounting on a scripted events.jsonl (real files, fixed timestamps)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from ckrun.cli import status as runstatus
from ckrun.config import resolve
from ckrun.supervisor.rundir import RunDir

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def at(s: float) -> str:
    return (T0 + dt.timedelta(seconds=s)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def commit(step: int, t: float, save_s: float, kind: str = "recovery") -> dict[str, Any]:
    return {"step": step, "committed_utc": at(t), "save_s": save_s, "kind": kind}


def test_goodput_lost_work_and_saving_time(tmp_path: Path) -> None:
    cfg = resolve("local", {"storage": str(tmp_path)}, {}, run="r", command=("true",))
    rd = RunDir(cfg.state_root)
    rd.freeze(cfg)
    evs: list[dict[str, Any]] = [
        {"utc": at(0), "attempt": 0, "kind": "spawn"},
        {"utc": at(0), "attempt": 0, "kind": "attempt_start"},
        {
            "utc": at(21),
            "attempt": 0,
            "kind": "attempt_end",
            "status": 75,
            "commits": [commit(100, 10, 1.0), commit(200, 20, 1.0)],
        },
        {"utc": at(21), "attempt": 0, "kind": "preempted", "new_checkpoint": True},
        {"utc": at(25), "attempt": 1, "kind": "spawn"},
        {"utc": at(25), "attempt": 1, "kind": "attempt_start", "step": 200},
        {
            "utc": at(40),
            "attempt": 1,
            "kind": "attempt_end",
            "status": 1,
            "commits": [commit(290, 35, 1.0)],
        },
        {"utc": at(40), "attempt": 1, "kind": "backoff"},
        {"utc": at(45), "attempt": 2, "kind": "spawn"},
        {"utc": at(45), "attempt": 2, "kind": "attempt_start", "step": 290},
        {
            "utc": at(50.5),
            "attempt": 2,
            "kind": "attempt_end",
            "status": 0,
            "commits": [commit(300, 50, 0.5, "final")],
        },
        {
            "utc": at(50.5),
            "attempt": 2,
            "kind": "supervisor_exit",
            "state": "COMPLETED",
            "exit_code": 0,
        },
    ]
    Path(rd.events_path).write_text("".join(json.dumps(e) + "\n" for e in evs) + '{"torn')
    s = runstatus.summarize(rd)
    assert s["state"] == "COMPLETED" and s["attempts"] == 3 and s["exit_code"] == 0
    assert (s["preemptions"], s["failures"]) == (1, 1)
    assert s["last_committed_step"] == 300
    assert s["wall_s"] == pytest.approx(50.5)
    assert s["saving_s"] == pytest.approx(3.5)
    # useful: (20 - 0 - 2) + (35 - 25 - 1) + (50 - 45 - 0.5) = 31.5 s
    assert s["useful_s"] == pytest.approx(31.5)
    assert s["goodput"] == pytest.approx(31.5 / 50.5, abs=1e-4)
    pre, fail = s["interruptions"]
    assert (pre["interruption"], pre["lost_s"], pre["lost_steps"]) == ("preemption", 1.0, 0)
    # 90 steps in 9 useful seconds, 5 s lost after the last commit -> 50 steps
    assert (fail["interruption"], fail["lost_s"], fail["lost_steps"]) == ("failure", 5.0, 50)
    text = runstatus.render(s)
    assert "goodput 62.4%" in text and "lost 5.0 s / 50 steps" in text


def test_a_killed_supervisor_is_not_reported_as_preempted(tmp_path: Path) -> None:
    # issue 11 item 2: the first supervisor exited PREEMPTED; the second one was SIGKILLed
    # (no supervisor_exit, no live lock holder): its run is not PREEMPTED
    cfg = resolve("local", {"storage": str(tmp_path)}, {}, run="r", command=("true",))
    rd = RunDir(cfg.state_root)
    rd.freeze(cfg)
    evs: list[dict[str, Any]] = [
        {"utc": at(0), "attempt": 0, "kind": "supervisor_start"},
        {"utc": at(0), "attempt": 0, "kind": "spawn"},
        {"utc": at(9), "attempt": 0, "kind": "attempt_end", "status": 75, "commits": []},
        {"utc": at(9), "attempt": 0, "kind": "supervisor_exit", "state": "PREEMPTED"},
        {"utc": at(20), "attempt": 1, "kind": "supervisor_start"},
        {"utc": at(20), "attempt": 1, "kind": "spawn"},
    ]
    Path(rd.events_path).write_text("".join(json.dumps(e) + "\n" for e in evs))
    s = runstatus.summarize(rd)
    assert s["state"] == "SUPERVISOR_DIED" and s["exit_code"] is None
    assert "its supervisor was killed" in runstatus.render(s)
