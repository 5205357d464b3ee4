"""A real detached run under chaos drills, seen through ``ckrun logs -f``, ``ckrun status
--watch``, ``ckrun runs``, ``status --json`` and the timeline page in headless Chromium.

The child (``tests/supervisor/child_train.py``) imports torch, so each attempt spends
seconds starting up: with ``--chaos-preempt-every 1s`` counted from the spawn, every
notice arrived before the first step and no attempt made progress; counted from the
child's first training step, every attempt commits new steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser import Elements, colour_counts, dump_dom, screenshot
from ckrun.report.timeline_html import COLOURS
from ckrun.runlog import read_events
from ckrun.scheduler.local import chaos_warning

CHILD = str(Path(__file__).resolve().parents[1] / "supervisor" / "child_train.py")
ENV = {"CKRUN_BACKOFF_S": "0.1", "CKRUN_KILL_DELAY_S": "1", "CKRUN_MARGIN_S": "0.5"}


def ckrun(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **ENV)
    env.pop("CKRUN_CONTROL_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "ckrun.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[str]:
    """The storage base; a detached supervisor still alive at the end is stopped."""
    base = tmp_path / "runs"
    yield str(base)
    for job in base.glob("*/job.json"):
        pid = int(json.loads(job.read_text())["job_id"])
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _chaos_warning_due(evs: list[dict[str, Any]], every_s: float) -> bool:
    """Whether any attempt after the first started with a history (the events before its
    ``spawn``) that calls for the supervisor's chaos warning."""
    return any(
        ev["kind"] == "spawn"
        and int(ev.get("attempt", 0)) > 0
        and chaos_warning(every_s, evs[:i]) is not None
        for i, ev in enumerate(evs)
    )


@pytest.mark.slow
def test_detached_chaos_run_logs_watch_runs_and_page(tmp_path: Path, runs: str) -> None:
    r = ckrun(
        ["submit", "--run", "demo", "--storage", runs, "--detach", "--chaos-preempt-every",
         "1s", CHILD, "--", "--steps", "40", "--step-s", "0.05"],
        tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"ckrun logs demo -f --storage {runs}" in r.stderr  # suggested, with --storage
    env = dict(os.environ)
    env.pop("CKRUN_CONTROL_DIR", None)
    watch = subprocess.Popen(
        [sys.executable, "-m", "ckrun.cli", "status", "demo", "--storage", runs, "--watch",
         "--every", "0.5s"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        logs = ckrun(["logs", "demo", "--storage", runs, "-f"], tmp_path, timeout=400)
        out, _ = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
    # logs -f: the supervisor's lines and the child's, until the supervisor exited
    assert logs.returncode == 0, logs.stderr
    assert "step 40" in logs.stdout and "[ckrun] demo attempt 0" in logs.stdout, logs.stdout
    assert "saved" in logs.stdout and "on notice" in logs.stdout
    # the chaos warning, at each attempt's start, exactly when the run's history before
    # that spawn shows a start-up plus save longer than the interval (a fast machine
    # starts torch in under a second, so it is not always due)
    evs = read_events(os.path.join(runs, "demo", "events.jsonl"))
    due = _chaos_warning_due(evs, every_s=1.0)
    assert ("is shorter than the measured start-up" in logs.stdout) == due, (due, logs.stdout)
    # --watch refreshed until the run completed, then exited by itself
    assert watch.returncode == 0
    assert out.count("run demo: ") >= 2 and out.rstrip().splitlines()[-1] != ""
    assert "run demo: COMPLETED" in out
    # chaos counts from the first training step: every drilled attempt made progress
    pre = [e for e in evs if e["kind"] == "preempted"]
    assert pre and all(e["new_checkpoint"] for e in pre), pre
    assert {e["kind"] for e in evs} >= {"restore", "save", "spawn", "notice"}
    # ckrun runs
    r = ckrun(["runs", "--storage", runs], tmp_path)
    assert r.returncode == 0, r.stderr
    (row,) = [line for line in r.stdout.splitlines() if line.startswith("demo ")]
    assert row.split()[1:4] == ["COMPLETED", str(len(pre) + 1), "40"], row
    # status --json (numbers) and the page
    page = tmp_path / "demo.html"
    r = ckrun(["status", "demo", "--storage", runs, "--json", "--html", str(page)], tmp_path)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["attempts"] == len(pre) + 1 and s["complete"]
    assert all(a["measured"] and a["startup_s"] > 0 for a in s["attempt_detail"])
    assert all(a["restore_s"] > 0 for a in s["attempt_detail"][1:])
    # child_train's checkpoint N holds N steps; the report numbers steps as the library's
    # examples do (checkpoint N holds step N, 0-based), so it counts 0..40
    assert s["productive_steps"] == 41 and 0 < s["goodput"] < 1
    assert sum(s["overheads_s"].values()) + s["productive_s"] == pytest.approx(
        s["wall_s"], abs=0.01
    )
    dom = Elements(dump_dom(page))
    assert len(dom.having("g", "attempt")) == s["attempts"]
    assert {a["data-source"] for a in dom.having("g", "notice")} == {"chaos"}
    assert len(dom.having("line", "commit")) >= s["attempts"]
    px = colour_counts(screenshot(page, tmp_path / "demo.png"), COLOURS)
    assert px["productive"] > 1000 and px["startup"] > 1000, px
