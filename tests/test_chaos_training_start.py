"""``--chaos-preempt-every`` counts from the child's first training step, and warns when
the interval is shorter than the measured start-up plus save (real files, real clock)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from ckrun import control
from ckrun.notices import iso_utc, utcnow
from ckrun.runlog import read_events
from ckrun.scheduler.local import ChaosSource, slow_start_warning


def _mark(cdir: Path, seconds_ago: float) -> None:
    t = utcnow().timestamp() - seconds_ago
    import datetime as dt

    stamp = iso_utc(dt.datetime.fromtimestamp(t, dt.timezone.utc))
    (cdir / control.TRAINING_FILE).write_text(json.dumps({"utc": stamp, "pid": 1}))


def test_interval_counts_from_the_training_start_not_the_spawn(tmp_path: Path) -> None:
    cdir = tmp_path / "control"
    cdir.mkdir()
    src = ChaosSource(0.05)
    src.attempt_started(control_dir=str(cdir))
    time.sleep(0.1)  # longer than the interval since the spawn: still starting up
    assert src.poll() is None
    _mark(cdir, 0.0)  # training just started
    assert src.poll() is None
    _mark(cdir, 1.0)  # trained for a second
    n = src.poll()
    assert n is not None and n.source == "chaos" and n.kind == "drill"
    assert src.poll() is None  # one notice per attempt


def test_warning_when_interval_is_below_start_up_plus_save(tmp_path: Path) -> None:
    cdir = tmp_path / "control"
    cdir.mkdir()
    evs = [
        {"utc": "2026-01-01T00:00:00Z", "attempt": 0, "kind": "spawn"},
        {"utc": "2026-01-01T00:00:04.5Z", "attempt": 0, "kind": "restore", "seconds": 0.5},
        {"utc": "2026-01-01T00:00:06Z", "attempt": 0, "kind": "save", "step": 3, "seconds": 1.0},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))
    w = slow_start_warning(2.0, str(cdir))
    assert w is not None and "start-up 4.5 s + save 1.0 s" in w and "11s" in w
    assert slow_start_warning(10.0, str(cdir)) is None
    assert slow_start_warning(2.0, str(tmp_path / "other" / "control")) is None  # no history


def test_first_check_marks_training_and_logs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cdir = tmp_path / "control"
    cdir.mkdir()
    monkeypatch.setenv("CKRUN_CONTROL_DIR", str(cdir))
    monkeypatch.setenv("CKRUN_ATTEMPT", "2")
    monkeypatch.setenv("CKRUN_RUN", "r")
    monkeypatch.delenv("RANK", raising=False)
    control.reset_for_tests()
    try:
        assert control.training_started(str(cdir)) is None
        assert control.preemption_requested() is False
        t = control.training_started(str(cdir))
        assert t is not None and abs(t - time.time()) < 60
        control.preemption_requested()
        (ev,) = read_events(str(tmp_path / "events.jsonl"))
        assert (ev["kind"], ev["attempt"], ev["run"], ev["pid"]) == (
            "train_start",
            2,
            "r",
            os.getpid(),
        )
        control.clear(str(cdir))
        assert control.training_started(str(cdir)) is None
    finally:
        control.reset_for_tests()
