"""`ckrun status` shows the scheduler's record next to ckrun's, and never fails on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ckrun.cli import status as runstatus
from ckrun.supervisor.rundir import RunDir


def _rundir(tmp_path: Path, job: dict[str, str] | None) -> RunDir:
    rd = RunDir(str(tmp_path / "r"))
    rd.create()
    if job is not None:
        Path(rd.job_json).write_text(json.dumps(job))
    return rd


def test_local_run_has_no_scheduler_view(tmp_path: Path) -> None:
    assert runstatus.scheduler_view(_rundir(tmp_path, None)) is None
    rd = _rundir(tmp_path, {"backend": "local", "job_id": "123"})
    assert runstatus.scheduler_view(rd) is None


def test_unreachable_kubernetes_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No API server can run on these machines: point the client at nothing.
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rd = _rundir(tmp_path, {"backend": "k8s", "job_id": "ml/train-x"})
    view = runstatus.scheduler_view(rd)
    assert view is not None and view["backend"] == "k8s" and view["job_id"] == "ml/train-x"
    assert view["error"]
    text = runstatus.render(runstatus.summarize(rd))
    assert "k8s job ml/train-x: " in text


def test_slurm_view_without_slurm_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no squeue/sacct/scontrol
    rd = _rundir(tmp_path, {"backend": "slurm", "job_id": "4242"})
    view = runstatus.scheduler_view(rd)
    assert view is not None and view["job_id"] == "4242"
    assert "error" in view or view.get("state") == "UNKNOWN"
    assert os.environ["PATH"].endswith("empty-bin")
