"""`ckrun submit --profile k8s --dry-run` prints the Job (the real CLI, in a subprocess).

No cluster is contacted: --dry-run renders only.  The image is given as CKRUN_IMAGE (the
environment layer of the config; a ``--image`` flag is the CLI's to add).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")

CKRUN = Path(sys.executable).with_name("ckrun")


def _dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, CKRUN_IMAGE="ghcr.io/acme/train:1.4", CKRUN_STATE_DIR=str(tmp_path / "state")
    )
    for key in ("KUBERNETES_SERVICE_HOST", "SLURM_JOB_ID", "CKRUN_STORAGE_BASE"):
        env.pop(key, None)
    return subprocess.run(
        [
            str(CKRUN),
            "submit",
            "--profile",
            "k8s",
            "--run",
            "demo",
            *args,
            "--dry-run",
            "--",
            "python",
            "train.py",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def _job(stdout: str) -> dict:  # type: ignore[type-arg]
    start = stdout.index("# ckrun Job for run")
    return yaml.safe_load(stdout[start:])  # type: ignore[no-any-return]


def test_dry_run_prints_a_valid_job(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, "--storage", "s3://acme-ckpt/runs")
    assert r.returncode == 0, r.stderr
    job = _job(r.stdout)
    kv.validate(job, "1.29", strict=True)
    kv.validate(job, "1.37", strict=True)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/acme/train:1.4"
    assert c["command"][:6] == ["ckrun", "run", "--run", "demo", "--storage", "s3://acme-ckpt/runs"]
    assert c["command"][-2:] == ["python", "train.py"]
    assert not list(tmp_path.glob("state/demo/job.json"))  # nothing was submitted


def test_dry_run_without_image_names_the_fix(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            str(CKRUN),
            "submit",
            "--profile",
            "k8s",
            "--run",
            "demo",
            "--dry-run",
            "--",
            "python",
            "train.py",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={
            **{k: v for k, v in os.environ.items() if k != "CKRUN_IMAGE"},
            "CKRUN_STATE_DIR": str(tmp_path / "state"),
        },
    )
    assert r.returncode == 3 and "--image" in r.stderr, r.stderr


def test_dry_run_with_pvc_storage(tmp_path: Path) -> None:
    """Needs launch to keep ``pvc:CLAIM`` as it is (config.is_local_storage)."""
    r = _dry_run(tmp_path, "--storage", "pvc:ckpt-claim")
    assert r.returncode == 0, r.stderr
    pod = _job(r.stdout)["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "ckpt-claim"}
    (c,) = pod["containers"]
    assert c["command"][4:6] == ["--storage", "/ckrun-storage"]


def test_script_form_runs_the_images_python(tmp_path: Path) -> None:
    """`ckrun submit train.py` puts this machine's interpreter first; the pod uses `python`."""
    env = dict(os.environ, CKRUN_IMAGE="img:1", CKRUN_STATE_DIR=str(tmp_path / "state"))
    env.pop("KUBERNETES_SERVICE_HOST", None)
    r = subprocess.run(
        [
            str(CKRUN),
            "submit",
            "--profile",
            "k8s",
            "--run",
            "demo",
            "--dry-run",
            "train.py",
            "--lr",
            "3e-4",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (c,) = _job(r.stdout)["spec"]["template"]["spec"]["containers"]
    assert c["command"][c["command"].index("--") + 1 :] == ["python", "train.py", "--lr", "3e-4"]
