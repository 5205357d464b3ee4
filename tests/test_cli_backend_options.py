"""The backend options of `ckrun submit` as issues 4 and 6 write them out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml


def _ckrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckrun", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_slurm_options(tmp_path: Path) -> None:
    r = _ckrun(
        "submit",
        "train.py",
        "--profile",
        "slurm",
        "--partition",
        "low",
        "--time",
        "4:00:00",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--account",
        "acct",
        "--qos",
        "prio",
        "--storage",
        str(tmp_path / "s"),
        "--dry-run",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    for line in (
        "#SBATCH --partition=low",
        "#SBATCH --time=4:00:00",
        "#SBATCH --nodes=2",
        "#SBATCH --account=acct",
        "#SBATCH --qos=prio",
    ):
        assert line in r.stdout
    assert "gpus" in r.stdout and "8" in r.stdout


def test_k8s_options(tmp_path: Path) -> None:
    r = _ckrun(
        "submit",
        "train.py",
        "--profile",
        "k8s",
        "--image",
        "ghcr.io/me/t:1",
        "--namespace",
        "ml",
        "--gpus",
        "2",
        "--storage",
        "s3://b/runs",
        "--dry-run",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    job = next(
        d
        for d in yaml.safe_load_all(r.stdout[r.stdout.index("apiVersion") :])
        if d and d.get("kind") == "Job"
    )
    assert job["metadata"]["namespace"] == "ml"
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "ghcr.io/me/t:1"
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "2"


def test_option_of_another_backend_is_refused(tmp_path: Path) -> None:
    r = _ckrun("submit", "train.py", "--image", "x", "--dry-run", cwd=tmp_path)
    assert r.returncode == 3
    assert "unknown config key(s) image" in r.stderr and "valid keys" in r.stderr


def test_submit_time_values_travel_to_the_job(tmp_path: Path) -> None:
    """A pod has no run.json: the values given at submit reach its `ckrun run` as env,
    the profile as --profile."""
    r = _ckrun(
        "submit",
        "train.py",
        "--profile",
        "k8s",
        "--image",
        "i:1",
        "--storage",
        "s3://b/runs",
        "--max-requeues",
        "7",
        "--set",
        "endpoint_url=http://minio:9000",
        "--allow-change",
        "config.lr",
        "--dry-run",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    job = next(
        d
        for d in yaml.safe_load_all(r.stdout[r.stdout.index("apiVersion") :])
        if d and d.get("kind") == "Job"
    )
    c = job["spec"]["template"]["spec"]["containers"][0]
    cmd = c["command"]
    assert cmd[cmd.index("--profile") + 1] == "k8s"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CKRUN_MAX_REQUEUES"] == "7"
    assert env["CKRUN_ENDPOINT_URL"] == "http://minio:9000"
    assert env["CKRUN_ALLOW_CHANGE"] == "config.lr"
    assert "CKRUN_MAX_FAILURES" not in env  # a profile default stays with the profile
    assert "CKRUN_IMAGE" not in env  # backend options shape the Job, not the supervisor


def test_cancel_uses_the_profiles_options(tmp_path: Path, monkeypatch: object) -> None:
    # issue 11 item 12: `ckrun cancel` reaches the backend with the options the run was
    # submitted with (here the Kubernetes namespace of a job id recorded without one).
    # No Kubernetes API server runs here: the API call is recorded instead (a mock).
    import json

    import pytest
    from ckrun.cli import commands
    from ckrun.config import resolve
    from ckrun.scheduler import k8s_api
    from ckrun.supervisor.rundir import RunDir

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    opts = {"storage": str(tmp_path), "state_dir": "", "namespace": "team-a", "image": "img"}
    cfg = resolve("k8s", opts, {}, run="r", command=("python", "train.py"))
    rd = RunDir(cfg.state_root)
    rd.freeze(cfg)
    (Path(rd.job_json)).write_text(json.dumps({"backend": "k8s", "job_id": "ckrun-r"}))
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(k8s_api, "delete_job", lambda api, ns, name: calls.append((ns, name)))
    monkeypatch.setattr("ckrun.scheduler.k8s.K8sScheduler.api", lambda self: None)
    commands.cancel("r", str(tmp_path))
    assert calls == [("team-a", "ckrun-r")]
