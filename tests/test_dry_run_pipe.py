"""``ckrun submit ... --dry-run`` writes only the job on stdout, so it pipes: the Job YAML
into ``kubectl apply -f -`` (checked here against the Kubernetes schema with
kubernetes-validate, no cluster), the sbatch script into ``sbatch`` (checked with
``bash -n``), the local command line into a shell; the configuration only with
``--show-config``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CKRUN = str(Path(sys.executable).with_name("ckrun"))


def dry(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, **(env or {}))
    for key in ("KUBERNETES_SERVICE_HOST", "SLURM_JOB_ID", "CKRUN_STORAGE_BASE"):
        full.pop(key, None)
    r = subprocess.run(
        [CKRUN, "submit", "--run", "demo", "--dry-run", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=full, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "dry run of run demo" in r.stderr and "nothing started" in r.stderr
    return r


def test_k8s_job_yaml_pipes_into_a_schema_check(tmp_path: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    r = dry(
        tmp_path, "--profile", "k8s", "--storage", "s3://bucket/runs", "--", "python", "t.py",
        env={"CKRUN_IMAGE": "ghcr.io/acme/train:1", "CKRUN_STATE_DIR": str(tmp_path / "st")},
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(r.stdout) if d is not None]
    assert docs and all(isinstance(d, dict) and "apiVersion" in d for d in docs), r.stdout[:300]
    for d in docs:
        kv.validate(d, "1.37", strict=True)
    assert any(d["kind"] == "Job" for d in docs)


def test_sbatch_script_pipes_into_sbatch(tmp_path: Path) -> None:
    r = dry(tmp_path, "--profile", "slurm", "--storage", "runs", "--", "python", "t.py")
    assert r.stdout.startswith("#!/bin/bash"), r.stdout[:200]
    check = subprocess.run(["bash", "-n"], input=r.stdout, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "ckrun" in r.stdout and "run --run demo" in r.stdout and '"run":' not in r.stdout


def test_local_command_line_is_one_pasteable_line(tmp_path: Path) -> None:
    r = dry(tmp_path, "--storage", "runs", "t.py", "--", "--steps", "5")
    (line,) = r.stdout.splitlines()
    argv = shlex.split(line)
    assert argv[1:5] == ["-m", "ckrun.cli", "run", "--run"] and argv[-2:] == ["--steps", "5"]
    assert not (tmp_path / "runs").exists()
    r = dry(tmp_path, "--storage", "runs", "--show-config", "t.py")
    body = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert body["run"] == "demo" and r.stdout.rstrip().endswith("t.py")
