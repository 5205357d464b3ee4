"""S3Storage against moto's S3 server on 127.0.0.1 (real HTTP; see s3_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from ckrun.errors import ObjectExists, ObjectNotFound, StorageError, StoragePermissionError
from ckrun.storage import open_storage
from ckrun.storage.s3 import MiB, S3Options, S3Storage, parse_s3_url
from s3_server import FaultProxy, MotoS3

pytestmark = pytest.mark.s3

SMALL_PARTS = {"s3_multipart_threshold_bytes": 5 * MiB, "s3_multipart_chunk_bytes": 5 * MiB}


def uploads(st: S3Storage) -> list[dict]:
    return st.client.list_multipart_uploads(Bucket=st.bucket).get("Uploads", [])


def test_parse_url_and_open_storage(moto_s3: MotoS3) -> None:
    assert parse_s3_url("s3://b-kt/a/b/") == ("b-kt", "a/b")
    st = open_storage(f"s3://{moto_s3.new_bucket()}/p")  # endpoint from AWS_ENDPOINT_URL_S3
    assert isinstance(st, S3Storage)
    st.put("k", b"v")
    assert st.get("k") == b"v"


def test_roundtrip_under_prefix(s3_storage: S3Storage) -> None:
    st = s3_storage
    st.put("step-0000000001/shard-0", b"a" * 10)
    st.put("step-0000000001/manifest.json", b"{}")
    st.put("step-0000000002/shard-0", b"b")
    assert [o.key for o in st.list("step-0000000001/")] == [
        "step-0000000001/manifest.json",
        "step-0000000001/shard-0",
    ]
    assert [o.size_bytes for o in st.list()] == [2, 10, 1]
    raw = st.client.list_objects_v2(Bucket=st.bucket)["Contents"]
    assert all(o["Key"].startswith("runs/test/") for o in raw)
    info = st.head("step-0000000001/shard-0")
    assert info is not None and info.size_bytes == 10 and info.mtime
    assert st.head("nope") is None
    with pytest.raises(ObjectNotFound):
        st.get("nope")
    st.delete(["step-0000000002/shard-0", "never-existed"])
    st.delete(["step-0000000002/shard-0"])  # idempotent
    assert len(st.list()) == 2


def test_multipart_full_object_crc32c(moto_s3: MotoS3) -> None:
    st = moto_s3.storage(moto_s3.new_bucket(), **SMALL_PARTS)
    data = os.urandom(13 * MiB + 7)
    st.put("big", data)
    h = st.client.head_object(Bucket=st.bucket, Key="big", ChecksumMode="ENABLED")
    assert h["ChecksumType"] == "FULL_OBJECT" and h["ChecksumCRC32C"]
    assert st.get("big") == data
    with st.open_read("big") as f:
        assert f.read(100) == data[:100]


def test_open_write_invisible_until_commit(moto_s3: MotoS3) -> None:
    st = moto_s3.storage(moto_s3.new_bucket(), **SMALL_PARTS)
    w = st.open_write("shard")
    for _ in range(3):
        w.write(os.urandom(4 * MiB))
    assert uploads(st), "parts are being uploaded"
    assert st.head("shard") is None and st.list() == []
    info = w.commit()
    assert info.size_bytes == 12 * MiB == st.head("shard").size_bytes
    assert uploads(st) == []


def test_abort_and_exception_leave_nothing(moto_s3: MotoS3) -> None:
    st = moto_s3.storage(moto_s3.new_bucket(), **SMALL_PARTS)
    w = st.open_write("a")
    w.write(os.urandom(11 * MiB))
    w.abort()
    w.abort()  # idempotent
    with pytest.raises(RuntimeError), st.open_write("b") as w2:
        w2.write(os.urandom(11 * MiB))
        raise RuntimeError("training crashed mid-save")
    assert st.list() == [] and uploads(st) == []


def test_conditional_create_single_and_multipart(moto_s3: MotoS3) -> None:
    st = moto_s3.storage(moto_s3.new_bucket(), **SMALL_PARTS)
    st.put("step-0000000005/manifest.json", b"first", if_absent=True)
    with pytest.raises(ObjectExists):
        st.put("step-0000000005/manifest.json", b"second", if_absent=True)
    with pytest.raises(ObjectExists):
        st.put("step-0000000005/manifest.json", os.urandom(12 * MiB), if_absent=True)
    assert st.get("step-0000000005/manifest.json") == b"first"
    assert uploads(st) == []  # the losing multipart upload was aborted


def test_corruption_detected_on_read(s3_storage: S3Storage) -> None:
    """An object whose bytes differ from its recorded CRC32C (stands in for bit rot)."""
    st = s3_storage
    st.client.put_object(
        Bucket=st.bucket,
        Key=st.object_key("k"),
        Body=b"payload",
        Metadata={"ckrun-crc32c": "AAAAAQ=="},
    )
    with pytest.raises(StorageError, match="CRC32C mismatch"):
        st.get("k")
    with pytest.raises(StorageError, match="CRC32C mismatch"):
        st.get_file("k", "/tmp/ckrun-never-written")
    assert not os.path.exists("/tmp/ckrun-never-written")


def test_put_file_get_file(moto_s3: MotoS3, tmp_path) -> None:
    st = moto_s3.storage(moto_s3.new_bucket(), **SMALL_PARTS)
    src = tmp_path / "src.bin"
    data = os.urandom(11 * MiB)
    src.write_bytes(data)
    assert st.put_file("x/y.bin", str(src)).size_bytes == len(data)
    dst = tmp_path / "out" / "y.bin"
    st.get_file("x/y.bin", str(dst))
    assert dst.read_bytes() == data
    assert [p.name for p in dst.parent.iterdir()] == ["y.bin"]  # no temp left


def test_check_missing_bucket_and_denied(moto_s3: MotoS3, fault_proxy: FaultProxy) -> None:
    moto_s3.storage(moto_s3.new_bucket()).check()
    with pytest.raises(StorageError, match="does not exist.*aws s3 mb"):
        moto_s3.storage("s3://no-such-bucket-ckrun/x").check()
    st = moto_s3.storage(moto_s3.new_bucket(), endpoint=fault_proxy.endpoint)
    fault_proxy.fail_next(1, status=403, code="AccessDenied")
    with pytest.raises(StoragePermissionError, match="access denied"):
        st.check()


def test_no_credentials(moto_s3: MotoS3, monkeypatch) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(StoragePermissionError, match="no AWS credentials"):
        moto_s3.storage(moto_s3.new_bucket()).check()


def test_unreachable_endpoint(moto_s3: MotoS3) -> None:
    st = moto_s3.storage(
        "s3://bkt-x", endpoint="http://127.0.0.1:9", s3_max_attempts=1, s3_timeout_s=1.0
    )
    with pytest.raises(StorageError, match="cannot reach the S3 endpoint"):
        st.check()


def test_500_storm_is_retried(moto_s3: MotoS3, fault_proxy: FaultProxy) -> None:
    """Faults injected by a loopback HTTP proxy (not botocore hooks): real 500/503 answers
    over HTTP, so botocore's standard retry mode is what recovers."""
    st = moto_s3.storage(
        moto_s3.new_bucket(), endpoint=fault_proxy.endpoint, s3_max_attempts=6, **SMALL_PARTS
    )
    data = os.urandom(11 * MiB)  # multipart: create, 3 parts in parallel, complete
    fault_proxy.fail_next(2, match="?uploads")  # CreateMultipartUpload
    fault_proxy.fail_next(3, match="partNumber=")  # UploadPart
    fault_proxy.fail_next(1, status=503, code="SlowDown")  # CompleteMultipartUpload
    st.put("shard", data)
    fault_proxy.fail_next(2, status=503, code="SlowDown")
    assert st.get("shard") == data
    assert fault_proxy.injected == 8
    assert uploads(st) == []


def test_storm_longer_than_retries_fails_cleanly(moto_s3: MotoS3, fault_proxy) -> None:
    st = moto_s3.storage(moto_s3.new_bucket(), endpoint=fault_proxy.endpoint, s3_max_attempts=2)
    fault_proxy.fail_next(2)
    with pytest.raises(StorageError, match="kept failing"):
        st.put("other", b"x")
    assert fault_proxy.injected == 2
    assert st.head("other") is None


def test_bandwidth_cap(moto_s3: MotoS3) -> None:
    st = moto_s3.storage(moto_s3.new_bucket(), s3_bandwidth_bytes_per_s=1 * MiB)
    t0 = time.monotonic()
    st.put("a", b"\0" * (MiB // 2))  # within the 1 s burst
    st.put("b", b"\0" * (2 * MiB))
    assert time.monotonic() - t0 >= 2.0  # 2.5 MiB at 1 MiB/s, 0.25 s burst


def test_options_validation() -> None:
    from ckrun.errors import ConfigError

    assert S3Options.from_mapping({"s3_max_attempts": "3", "grace_s": 5}).s3_max_attempts == 3
    with pytest.raises(ConfigError, match="5 MiB"):
        S3Options.from_mapping({"s3_multipart_chunk_bytes": 1024})
    with pytest.raises(ConfigError, match="standard or adaptive"):
        S3Options.from_mapping({"s3_retry_mode": "yolo"})
    env = {"CKRUN_ENDPOINT_URL": "http://x:1", "CKRUN_S3_MAX_CONCURRENCY": "2"}
    o = S3Options.from_env(env)
    assert (o.endpoint_url, o.s3_max_concurrency) == ("http://x:1", 2)


_UPLOADER = textwrap.dedent("""
    import os, sys
    from ckrun.storage.s3 import S3Options, S3Storage
    st = S3Storage.from_url(sys.argv[1], S3Options(
        s3_multipart_threshold_bytes=5 << 20, s3_multipart_chunk_bytes=5 << 20,
        s3_bandwidth_bytes_per_s=4 << 20, s3_max_concurrency=1))
    w = st.open_write("step-0000000007/shard-00000.pt")
    for i in range(40):
        w.write(os.urandom(1 << 20))
        if i == 12:
            print("uploading", flush=True)
    w.commit()
    st.put("step-0000000007/manifest.json", b"{}")
""")


def test_sigkill_during_upload_leaves_nothing_visible(moto_s3: MotoS3) -> None:
    bucket = moto_s3.new_bucket()
    st = moto_s3.storage(f"s3://{bucket}/r")
    p = subprocess.Popen(
        [sys.executable, "-c", _UPLOADER, st.url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "uploading"
        deadline = time.monotonic() + 20
        while not uploads(st):  # wait for the multipart upload to be under way
            assert time.monotonic() < deadline
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert st.list() == []  # neither the shard nor the manifest is visible
    assert st.head("step-0000000007/shard-00000.pt") is None
    assert st.abort_incomplete_uploads(older_than_s=0) == 1
    assert uploads(st) == []


def test_ckrun_run_refuses_missing_bucket_at_preflight(moto_s3: MotoS3, tmp_path) -> None:
    """The supervisor's preflight lists the S3 run root: exit 5 before the child starts."""
    marker = tmp_path / "child-ran"
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ckrun"),
        "run",
        "--run",
        "r1",
        "--storage",
        "s3://no-such-bucket-ckrun/runs",
        "--",
        "touch",
        str(marker),
    ]
    env = dict(os.environ, CKRUN_STATE_DIR=str(tmp_path / "state"))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 5, r.stderr
    assert "does not exist" in r.stderr and "aws s3 mb" in r.stderr
    assert not marker.exists()
