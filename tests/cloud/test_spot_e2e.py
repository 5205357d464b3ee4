"""End to end on "spot VMs": `ckrun run --profile aws-spot|gcp-spot` with S3 storage (moto)
and the loopback metadata server of that cloud.

VM 1 trains; the metadata server announces the interruption (AWS: a 120 s
``instance-action``; GCP: ``preempted`` flips to TRUE, 30 s); the checkpoint must be
committed in S3 before the deadline; then VM 1 dies (SIGKILL of its whole process group,
its state dir thrown away).  VM 2 (fresh state dir, new process, no notice) runs the same
command, resumes from S3 and finishes with parameters bitwise equal to an uninterrupted
run.  VM 3 runs it once more and exits 0 without starting the child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ckrun.checkpoint import layout
from ckrun.checkpoint.manifest import Manifest
from ckrun.notices import parse_utc
from metaservers import AwsImds, AzureImds, GcpMetadata
from s3_server import MotoS3  # tests/storage, put on sys.path by tests/cloud/conftest.py

pytestmark = [pytest.mark.slow, pytest.mark.s3]
HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "spot_train.py")
CKRUN = str(Path(sys.executable).parent / "ckrun")

CLOUDS = {
    # profile: (server class, endpoint variable, endpoint value, notice window s)
    "aws-spot": (AwsImds, "AWS_EC2_METADATA_SERVICE_ENDPOINT", lambda s: s.url, 120),
    "gcp-spot": (GcpMetadata, "GCE_METADATA_HOST", lambda s: f"127.0.0.1:{s.port}", 30),
    # Azure Scheduled Events: a Preempt event with NotBefore 30 s ahead (issue 12)
    "azure-spot": (AzureImds, "CKRUN_AZURE_METADATA_ENDPOINT", lambda s: s.url, 30),
}


def _announce(profile: str, srv: Any, window_s: float) -> Any:
    """The cloud's interruption notice; the stated deadline when the notice has one."""
    if profile == "aws-spot":
        return srv.arm(deadline_s=window_s)
    if profile == "azure-spot":
        return srv.schedule("Preempt", not_before_s=window_s)
    return srv.preempt()


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


def events(tmp: Path, name: str) -> list[dict[str, Any]]:
    path = tmp / name / "state" / "r1" / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def vm(tmp: Path, name: str, profile: str, server: Any, bucket: str):
    _, var, value, _ = CLOUDS[profile]
    env = dict(
        os.environ,
        CKRUN_STATE_DIR=str(tmp / name / "state"),
        SPOT_PROGRESS=str(tmp / name / "p"),
        SPOT_OUT=str(tmp / name / "out.json"),
    )
    env[var] = value(server)
    (tmp / name).mkdir()
    storage = f"s3://{bucket}/runs"
    cmd = [CKRUN, "run", "--run", "r1", "--profile", profile, "--storage", storage, "--",
           sys.executable, TRAIN]  # fmt: skip
    return cmd, env


def reference_run(tmp: Path) -> Any:
    env = dict(os.environ, SPOT_REF_STORAGE=str(tmp / "ref"), SPOT_OUT=str(tmp / "ref.json"),
               SPOT_STEP_SLEEP_S="0")  # fmt: skip
    r = subprocess.run([sys.executable, TRAIN], env=env, timeout=300, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return read_json(tmp / "ref.json")


@pytest.mark.parametrize("profile", sorted(CLOUDS))
def test_notice_s3_commit_and_resume_on_a_new_vm(profile: str, moto_s3: MotoS3,
                                                  tmp_path: Path) -> None:  # fmt: skip
    server_cls, _, _, window_s = CLOUDS[profile]
    bucket = moto_s3.new_bucket()
    remote = moto_s3.storage(f"s3://{bucket}/runs/r1")
    expected = reference_run(tmp_path)

    # VM 1: train, get the cloud's notice, commit to S3, die.
    srv1 = server_cls()
    cmd, env = vm(tmp_path, "vm1", profile, srv1, bucket)
    p = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: (read_json(tmp_path / "vm1" / "p") or {}).get("step", 0) >= 30, 120,
                 "vm1 training")  # fmt: skip
        armed = _announce(profile, srv1, window_s)
        wait_for(lambda: any(e["kind"] == "preempted" for e in events(tmp_path, "vm1")), 60,
                 "the preemption to be handled")  # fmt: skip
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the VM is gone
        p.wait()
        srv1.close()
    ev1 = events(tmp_path, "vm1")
    notice = next(e for e in ev1 if e["kind"] == "notice")
    pre = next(e for e in ev1 if e["kind"] == "preempted")
    assert notice["source"] == profile.split("-")[0] and 0 < notice["seconds_left"] <= window_s
    assert pre["new_checkpoint"] and pre["exit_code"] == 75
    m = Manifest.loads(remote.get(layout.manifest_key(pre["step"])))  # committed in S3 ...
    deadline = parse_utc(notice["deadline_utc"])
    assert parse_utc(m.committed_utc) < deadline  # ... before the deadline
    if armed is not None:
        assert deadline <= armed  # AWS, Azure: the document's own time (NotBefore)

    # VM 2: fresh disk, same command, no notice: resumes from S3 and finishes.
    srv2 = server_cls()
    try:
        cmd, env = vm(tmp_path, "vm2", profile, srv2, bucket)
        r = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        start = next(e for e in events(tmp_path, "vm2") if e["kind"] == "attempt_start")
        assert start["message"] == f"started, resuming from step {pre['step']}"
        assert read_json(tmp_path / "vm2" / "out.json") == expected  # bitwise, as floats
        assert remote.head(layout.COMPLETE) is not None

        # VM 3: the run is complete: exit 0 at once, the child never starts.
        cmd, env = vm(tmp_path, "vm3", profile, srv2, bucket)
        r3 = subprocess.run(cmd, env=env, timeout=120, capture_output=True, text=True)
        assert r3.returncode == 0, r3.stderr[-3000:]
        assert not (tmp_path / "vm3" / "p").exists()
    finally:
        srv2.close()
