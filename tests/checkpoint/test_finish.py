"""Issue 13 item 3: a run killed between its final commit and COMPLETE.json completes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import discovery, layout

PROG = str(Path(__file__).parent / "progs" / "finish.py")


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, PROG, *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def _killed_before_marker(run_dir: Path) -> None:
    r = _run(str(run_dir), "--die-before-marker")
    assert r.returncode == -signal.SIGKILL, r.stderr
    st = ckrun.open_storage(str(run_dir))
    assert discovery.committed(st)[0].kind == "final"
    assert not (run_dir / layout.COMPLETE).exists()


def test_relaunched_script_completes_from_the_committed_final(run_dir: Path) -> None:
    _killed_before_marker(run_dir)
    r = _run(str(run_dir))  # resumes from the final artifact, finalizes again
    assert r.returncode == 0, r.stderr
    assert "finalized 4 5.0" in r.stdout
    marker, problem = discovery.completion(ckrun.open_storage(str(run_dir)))
    assert marker is not None and problem is None and marker.final_step == 4
    again = _run(str(run_dir))  # finalize is idempotent: the same step again is fine
    assert again.returncode == 0 and "finalized 4" in again.stdout, again.stderr


def test_supervisor_preflight_writes_the_marker_and_never_starts(tmp_path: Path) -> None:
    root = tmp_path / "runs" / "fin"
    _killed_before_marker(root)
    r = subprocess.run(
        [sys.executable, "-m", "ckrun.cli", "run", "--run", "fin", "--storage", "runs"]
        + ["--", sys.executable, "-c", "raise SystemExit(1)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "complete" in r.stderr
    marker, _ = discovery.completion(ckrun.open_storage(str(root)))
    assert marker is not None and marker.final_step == 4


def test_finalize_same_step_returns_it_other_step_refused(run_dir: Path) -> None:
    s = {"w": torch.ones(2)}
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        a = ck.finalize(3, s)
        assert ck.finalize(3, s).key == a.key
        with pytest.raises(ckrun.RunComplete):
            ck.finalize(4, s)
