"""Hugging Face Trainer and Lightning under ckrun (issue 15): exact resume end to end.

Tiny models built from configs, synthetic data, CPU; real supervisors, real signals.
Each test runs real training processes (tens of seconds): marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckrun.cli.resume_check import compare_trees, load_final

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HF = str(EXAMPLES / "train_hf.py")
PL = str(EXAMPLES / "train_lightning.py")
HF_ARGS = ("--steps", "30", "--save-steps", "10")
PL_ARGS = ("--steps", "40")


def _check(tmp_path: Path, script: str, *args: str, k: int = 3) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckrun", "check-resume", "-k", str(k), "--seed", "5",
         "--workdir", str(tmp_path), "--timeout", "600", "--", sys.executable, script, *args],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip


def _submit(tmp_path: Path, run: str, script: str, *args: str, chaos: str | None = None) -> None:
    extra = ["--chaos-preempt-every", chaos] if chaos else []
    r = subprocess.run(
        [sys.executable, "-m", "ckrun", "submit", script, "--run", run, "--storage",
         str(tmp_path), *extra, "--", *args],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _preemptions(root: Path) -> int:
    with open(root / "events.jsonl") as f:
        return sum(1 for ln in f if ln.strip() and json.loads(ln)["kind"] == "preempted")


def _same_final(tmp_path: Path) -> None:
    _, ref = load_final(str(tmp_path / "ref"))
    _, got = load_final(str(tmp_path / "chaos"))
    _, div, _ = compare_trees(ref, got)
    assert div is None, f"{div.path}: {div.detail}"


@pytest.mark.slow
@pytest.mark.parametrize("script,args", [(HF, HF_ARGS), (PL, PL_ARGS)], ids=["hf", "lightning"])
def test_check_resume_passes_with_the_integration(
    tmp_path: Path, script: str, args: tuple[str, ...]
) -> None:
    pytest.importorskip("transformers" if script == HF else "lightning")
    r = _check(tmp_path, script, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "script,broken",
    [(HF, "--ignore-data-skip"), (PL, "--no-data-position")],
    ids=["hf", "lightning"],
)
def test_check_resume_fails_without_the_data_position(
    tmp_path: Path, script: str, broken: str
) -> None:
    pytest.importorskip("transformers" if script == HF else "lightning")
    args = HF_ARGS if script == HF else PL_ARGS
    r = _check(tmp_path, script, *args, broken)  # seed 5: two drills mid-epoch, one at the end
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL:" in r.stdout and "the first step whose parameters differ is step" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", [HF, PL], ids=["hf", "lightning"])
def test_check_resume_without_the_integration_says_so(tmp_path: Path, script: str) -> None:
    pytest.importorskip("transformers" if script == HF else "lightning")
    args = HF_ARGS if script == HF else PL_ARGS
    r = _check(tmp_path, script, *args, "--no-ckrun", k=1)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "committed no checkpoint through ckrun" in r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", [HF, PL], ids=["hf", "lightning"])
def test_chaos_preemptions_end_with_the_uninterrupted_weights(tmp_path: Path, script: str) -> None:
    pytest.importorskip("transformers" if script == HF else "lightning")
    # 0.5 s steps, 15 s of training: a notice every 6 s of training (counted from the
    # first step, so start-up does not count) preempts each run about twice
    args = ("--steps", "30", "--step-seconds", "0.5")
    if script == HF:
        args += ("--save-steps", "1000")  # only ckrun's notice saves
    _submit(tmp_path, "ref", script, *args)
    _submit(tmp_path, "chaos", script, *args, chaos="6s")
    assert _preemptions(tmp_path / "chaos") >= 1
    assert (tmp_path / "chaos" / "COMPLETE.json").exists()
    _same_final(tmp_path)
    assert os.path.exists(tmp_path / "chaos" / "final")
