"""Own-checkpoint mode (issue 15): an unmodified script that keeps its own ``torch.save``
checkpoint resumes from it under the supervisor; a file cut short by a kill is never
restored.  Real supervisors, real child processes, real signals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = str(Path(__file__).with_name("own_ckpt_train.py"))


def _run(
    cwd: Path, run: str, *script_args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "ckrun", "run", "--run", run, "--storage", "st",
        "--checkpoint-path", "out/ckpt.pt", "--resume-args", "init_from=resume",
        "--", sys.executable, SCRIPT, *script_args,
    ]  # fmt: skip
    return subprocess.run(
        argv,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _events(cwd: Path, run: str) -> list[dict[str, object]]:
    with open(cwd / "st" / run / "events.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _final(path: Path) -> dict[str, object]:
    return dict(torch.load(path, map_location="cpu", weights_only=True))


@pytest.mark.slow
def test_unmodified_script_resumes_from_its_own_checkpoint(tmp_path: Path) -> None:
    ref, got = tmp_path / "ref", tmp_path / "got"
    ref.mkdir()
    got.mkdir()
    args = ("--steps", "60", "--save-every", "10", "--step-seconds", "0.05")
    r = _run(ref, "r", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    # a drill right after the 2nd version committed by attempt 0, then after attempt 1's 1st
    p = _run(got, "r", *args, env={"CKRUN_DRILL_AFTER_COMMITS": "2,1"})
    assert p.returncode == 0, p.stdout + p.stderr
    starts = [ln for ln in p.stdout.splitlines() if ln.startswith("START")]
    assert starts[0] == "START iter=0 init_from=scratch"
    assert len(starts) == 3 and all("init_from=resume" in s for s in starts[1:]), starts
    # resumed where its own checkpoint was, not from scratch
    assert int(starts[1].split()[1].split("=")[1]) > 0
    kinds = [e["kind"] for e in _events(got, "r")]
    assert kinds.count("preempted") == 2 and kinds[-1] == "supervisor_exit"
    assert "own checkpoint out/ckpt.pt" in p.stderr and "is lost" in p.stderr
    a, b = _final(ref / "out" / "ckpt.pt"), _final(got / "out" / "ckpt.pt")
    assert a["iter_num"] == b["iter_num"] == 59
    for k, v in a["model"].items():  # type: ignore[union-attr]
        assert torch.equal(v, b["model"][k])  # type: ignore[index]
    assert (got / "st" / "r" / "COMPLETE.json").exists()


@pytest.mark.slow
def test_a_checkpoint_cut_short_by_a_kill_is_never_restored(tmp_path: Path) -> None:
    p = _run(
        tmp_path,
        "k",
        "--steps",
        "30",
        "--save-every",
        "5",
        "--step-seconds",
        "0.05",
        "--die-mid-save",
        "4",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    starts = [ln for ln in p.stdout.splitlines() if ln.startswith("START")]
    # attempt 0 saved iter 0, 5, 10 and was killed writing iter 15: attempt 1 resumes
    # from a complete version (iter 10 -> starts at 11), never from the half-written file
    assert len(starts) == 2 and starts[1].startswith("START iter="), starts
    assert int(starts[1].split()[1].split("=")[1]) <= 11
    assert "Traceback" not in p.stdout + p.stderr
    statuses = [e.get("status") for e in _events(tmp_path, "k") if e["kind"] == "attempt_end"]
    assert statuses[0] == 128 + 9 and statuses[-1] == 0
