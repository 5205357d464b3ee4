"""Issue 13 item 3: a run killed between its final commit and COMPLETE.json completes."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import discovery, layout, sharding
from ckrun.checkpoint.marker import CompletionMarker

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


def test_a_marker_written_while_a_save_writes_refuses_its_commit(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the run completes elsewhere (another owner commits its final artifact and the
    # marker) after this save began: its commit would land after the marker; it is
    # refused and its shard dropped instead
    s = {"w": torch.ones(2)}
    with ckrun.Checkpointer(str(tmp_path / "elsewhere"), rng=False) as other:
        final = other.finalize(5, s)
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        ck.save(1, s)
        write = sharding.write_object

        def finish_then_write(*a: object, **kw: object) -> object:
            shutil.copytree(tmp_path / "elsewhere" / "final", run_dir / "final")
            marker = CompletionMarker.for_manifest(final).dumps()
            ckrun.open_storage(str(run_dir)).put(layout.COMPLETE, marker)
            return write(*a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(sharding, "write_object", finish_then_write)
        with pytest.raises(ckrun.RunComplete):
            ck.save(2, s)
        monkeypatch.undo()
        with pytest.raises(ckrun.RunComplete):  # known now: refused before any work
            ck.save(3, s)
    steps = [m.step for m in discovery.committed(ckrun.open_storage(str(run_dir)))]
    assert steps == [5, 1]
    left = [p for p in (run_dir / "checkpoints").rglob("*") if p.is_file()]
    assert all("step-0000000001" in str(p) for p in left), left
