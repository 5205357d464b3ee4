"""``ckrun check-resume`` says where its work directory is, shows progress while its runs
go, and removes what it wrote on PASS (real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckrun.cli import resume_check

TINY = str(Path(__file__).with_name("tiny_train.py"))


def test_progress_lines_while_a_run_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resume_check, "PROGRESS_EVERY_S", 0.2)
    root = tmp_path / "run"
    root.mkdir()
    (root / "events.jsonl").write_text(
        "".join(
            json.dumps({"utc": "2026-01-01T00:00:00Z", "attempt": 0, "kind": k, **f}) + "\n"
            for k, f in [("spawn", {}), ("save", {"step": 7}), ("preempted", {})]
        )
    )
    seen: list[tuple[float, int | None, int, int]] = []
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    resume_check._wait_reporting(p, str(root), 60, lambda *a: seen.append(a))
    assert p.returncode == 0
    assert len(seen) >= 2 and seen[-1][1:] == (7, 1, 1), seen
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(subprocess.TimeoutExpired):
        resume_check._wait_reporting(p, str(root), 0.5, None)
    p.kill()
    p.wait()


@pytest.mark.slow
def test_pass_removes_its_runs_and_keeps_a_named_workdir(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    r = subprocess.run(
        [sys.executable, "-m", "ckrun", "check-resume", "-k", "1", "--seed", "3",
         "--workdir", str(tmp_path), "--", sys.executable, TINY, "--steps", "12"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"work directory {tmp_path} (removed on PASS, kept on FAIL)" in r.stdout
    assert "PASS" in r.stdout and f"removed both runs and their logs from {tmp_path}" in r.stdout
    assert sorted(os.listdir(tmp_path)) == ["mine.txt"]


def test_remove_runs_only_touches_what_check_resume_wrote(tmp_path: Path) -> None:
    for d in ("named", "made"):
        for run in ("uninterrupted", "interrupted"):
            (tmp_path / d / run / "checkpoints").mkdir(parents=True)
            (tmp_path / d / f"{run}.log").write_text("log")
        (tmp_path / d / "mine.txt").write_text("keep me")
    resume_check.remove_runs(str(tmp_path / "named"), created=False)
    assert sorted(os.listdir(tmp_path / "named")) == ["mine.txt"]
    resume_check.remove_runs(str(tmp_path / "made"), created=True)
    assert not (tmp_path / "made").exists()
