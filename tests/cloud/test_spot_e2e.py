"""End to end on "spot VMs": `ckrun run --profile aws-spot` with S3 storage (moto) and the
loopback IMDS.  VM 1 trains; the IMDS arms a 120 s interruption notice; the checkpoint
must be committed in S3 before the deadline; then VM 1 dies (SIGKILL of its whole process
group, state dir thrown away).  VM 2 (fresh state dir, new process, no notice) runs the
same command, resumes from S3 and finishes with parameters bitwise equal to an
uninterrupted run.  VM 3 runs it once more and exits 0 without starting the child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckrun.checkpoint import layout
from ckrun.checkpoint.manifest import Manifest
from ckrun.notices import parse_utc
from metaservers import AwsImds
from s3_server import MotoS3  # tests/storage, put on sys.path by tests/cloud/conftest.py

pytestmark = [pytest.mark.slow, pytest.mark.s3]
HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "spot_train.py")
CKRUN = str(Path(sys.executable).parent / "ckrun")


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def vm(tmp: Path, name: str, imds: AwsImds, bucket: str) -> tuple[list[str], dict[str, str]]:
    env = dict(
        os.environ,
        AWS_EC2_METADATA_SERVICE_ENDPOINT=imds.url,
        CKRUN_STATE_DIR=str(tmp / name / "state"),
        SPOT_PROGRESS=str(tmp / name / "p"),
        SPOT_OUT=str(tmp / name / "out.json"),
    )
    (tmp / name).mkdir()
    cmd = [
        CKRUN,
        "run",
        "--run",
        "r1",
        "--profile",
        "aws-spot",
        "--storage",
        f"s3://{bucket}/runs",
        "--",
        sys.executable,
        TRAIN,
    ]
    return cmd, env


def test_spot_notice_s3_commit_and_resume_on_a_new_vm(moto_s3: MotoS3, tmp_path: Path) -> None:
    bucket = moto_s3.new_bucket()
    remote = moto_s3.storage(f"s3://{bucket}/runs/r1")

    ref = subprocess.run(
        [sys.executable, TRAIN],
        env=dict(
            os.environ,
            SPOT_REF_STORAGE=str(tmp_path / "ref"),
            SPOT_OUT=str(tmp_path / "ref.json"),
            SPOT_STEP_SLEEP_S="0",
        ),
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert ref.returncode == 0, ref.stderr

    # VM 1: train, get the AWS notice, commit to S3, die.
    imds1 = AwsImds()
    cmd, env = vm(tmp_path, "vm1", imds1, bucket)
    p = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(
            lambda: (read_json(tmp_path / "vm1" / "p") or {}).get("step", 0) >= 30,
            120,
            "vm1 training",
        )
        deadline = imds1.arm(deadline_s=120)
        events = tmp_path / "vm1" / "state" / "r1" / "events.jsonl"
        wait_for(
            lambda: events.exists() and '"preempted"' in events.read_text(),
            60,
            "the preemption to be handled",
        )
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the VM is gone
        p.wait()
        imds1.close()
    pre = [json.loads(x) for x in events.read_text().splitlines() if '"preempted"' in x][0]
    assert pre["new_checkpoint"] and pre["exit_code"] == 75
    key = layout.manifest_key(pre["step"])
    m = Manifest.loads(remote.get(key), key=key)  # committed in S3 ...
    assert parse_utc(m.committed_utc) < deadline  # ... before the deadline
    assert pre["step"] < int(os.environ.get("SPOT_STEPS", "300"))

    # VM 2: fresh disk, same command, no notice: resumes from S3 and finishes.
    imds2 = AwsImds()
    try:
        cmd, env = vm(tmp_path, "vm2", imds2, bucket)
        r = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        ev2 = (tmp_path / "vm2" / "state" / "r1" / "events.jsonl").read_text()
        starts = [e for e in map(json.loads, ev2.splitlines()) if e["kind"] == "attempt_start"]
        assert starts[0]["message"] == f"started, resuming from step {pre['step']}"
        assert read_json(tmp_path / "vm2" / "out.json") == read_json(tmp_path / "ref.json")
        assert remote.head(layout.COMPLETE) is not None

        # VM 3: the run is complete: exit 0 at once, the child never starts.
        cmd, env = vm(tmp_path, "vm3", imds2, bucket)
        r3 = subprocess.run(cmd, env=env, timeout=120, capture_output=True, text=True)
        assert r3.returncode == 0, r3.stderr[-3000:]
        assert not (tmp_path / "vm3" / "p").exists()
    finally:
        imds2.close()
