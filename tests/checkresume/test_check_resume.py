"""``ckrun check-resume`` end to end: real supervisors, real child processes.

A correct loop passes; each deliberately broken loop fails and the report names the
entry that diverged first and its usual cause.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from ckrun.cli.resume_check import compare_trees, drill_counts

TINY = str(Path(__file__).with_name("tiny_train.py"))


def _check(tmp_path: Path, *extra: str, seed: int = 5) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ckrun",
            "check-resume",
            "-k",
            "3",
            "--seed",
            str(seed),
            "--workdir",
            str(tmp_path),
            "--timeout",
            "300",
            "--",
            sys.executable,
            TINY,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_drill_counts() -> None:
    assert drill_counts([4, 10, 11]) == [5, 6, 1]
    assert drill_counts([]) == []


def test_compare_trees_orders_causes_first() -> None:
    import torch

    a = {"step": 3, "user": {"model": {"w": torch.zeros(2)}, "sampler": {"pos": 1}}}
    b = {"step": 3, "user": {"model": {"w": torch.ones(2)}, "sampler": {"pos": 2}}}
    n, d, rng = compare_trees(a, b)
    assert n == 3 and d is not None and rng == []
    assert d.path == "user.sampler.pos" and "data order" in d.hint
    b["user"]["sampler"]["pos"] = 1
    _, d, _ = compare_trees(a, b)
    assert d is not None and d.path == "user.model.w" and d.detail == "max abs diff 1"
    a["rng"] = {"torch": torch.zeros(3)}
    b["rng"] = {"torch": torch.ones(3)}
    b["user"]["model"]["w"] = torch.zeros(2)
    _, d, rng = compare_trees(a, b)
    assert d is None and rng == ["rng.torch"]


@pytest.mark.slow
def test_correct_loop_passes(tmp_path: Path) -> None:
    r = _check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "after 3 preemptions" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "bug,entry",
    [
        ("no-sampler", "user.model"),
        ("extra-draw", "user.model"),
        ("no-scheduler", "user.optimizer.param_groups"),
    ],
)
def test_broken_loops_fail_with_first_divergence(tmp_path: Path, bug: str, entry: str) -> None:
    r = _check(tmp_path, "--bug", bug)
    assert r.returncode == 1, r.stdout + r.stderr
    fail = next(line for line in r.stdout.splitlines() if line.startswith("FAIL:"))
    assert fail.startswith(f"FAIL: {entry}"), r.stdout
    assert "likely cause:" in r.stdout and "--seed 5" in r.stdout
    if bug == "extra-draw":
        assert "RNG states that also differ: " in r.stdout and "rng.torch" in r.stdout
