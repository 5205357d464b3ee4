"""S3 keys from the profile / CLI (``endpoint_url``, ``s3_*``) reach the supervisor's
preflight and the child's Checkpointer, with no ``AWS_ENDPOINT_URL*`` in the environment.

Runs against moto's real S3 HTTP server on 127.0.0.1 (the ``moto_s3`` fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.s3

CHILD = """
import os, sys, torch, ckrun
assert os.environ["CKRUN_ENDPOINT_URL"].startswith("http://127.0.0.1")
ckpt = ckrun.Checkpointer.from_env(compat={"model_version": "t"})
w = torch.zeros(4)
m = ckpt.load({"w": w})
ckpt.save(0, {"w": w + 1})
ckpt.finalize(1, {"w": w + 2})
print("finalized", flush=True)
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    env["CKRUN_STATE_DIR"] = str(tmp_path / "state")
    return env


def test_endpoint_from_cli_reaches_preflight_and_child(tmp_path: Path, moto_s3: Any) -> None:
    bucket = moto_s3.new_bucket()
    argv = [
        sys.executable,
        "-m",
        "ckrun",
        "submit",
        "--run",
        "r1",
        "--storage",
        f"s3://{bucket}/runs",
        "--set",
        f"endpoint_url={moto_s3.endpoint}",
        "--set",
        "s3_max_attempts=3",
        "--",
        sys.executable,
        "-c",
        CHILD,
    ]
    r = subprocess.run(argv, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "finalized" in r.stdout
    keys = [o["Key"] for o in moto_s3.client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert "runs/r1/COMPLETE.json" in keys
    assert not any(".ckrun-preflight-" in k for k in keys)  # the probe cleaned up


def test_missing_bucket_fails_at_preflight(tmp_path: Path, moto_s3: Any) -> None:
    argv = [
        sys.executable,
        "-m",
        "ckrun",
        "submit",
        "--run",
        "r2",
        "--storage",
        "s3://no-such-bucket-ckrun/runs",
        "--set",
        f"endpoint_url={moto_s3.endpoint}",
        "--",
        sys.executable,
        "-c",
        "print('child started')",
    ]
    r = subprocess.run(argv, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 5, r.stdout + r.stderr
    assert "child started" not in r.stdout
    assert "no-such-bucket-ckrun" in r.stdout + r.stderr
