"""Issue 13 on S3 (moto's server on 127.0.0.1): corruption falls back, dropped reads are
retried, saves never buffer a whole tensor, one Checkpointer per run and process."""

from __future__ import annotations

from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.errors import RunLocked
from s3_server import FaultProxy, MotoS3

pytestmark = pytest.mark.s3


def test_second_checkpointer_refused_on_s3_too(moto_s3: MotoS3) -> None:
    url = f"s3://{moto_s3.new_bucket()}/run"
    a = ckrun.Checkpointer(moto_s3.storage(url), rng=False)
    a.save(1, {"w": torch.ones(1)})
    b = ckrun.Checkpointer(moto_s3.storage(url), rng=False)
    with pytest.raises(RunLocked, match="in this process"):
        b.load({"w": torch.ones(1)})
    a.close()
    assert b.load({"w": torch.ones(1)}) is not None
    b.close()


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300_000, generator=g), "extra": {"seed": seed}}


def test_bit_flip_in_an_s3_shard_falls_back(moto_s3: MotoS3) -> None:
    url = f"s3://{moto_s3.new_bucket()}/run"
    with ckrun.Checkpointer(moto_s3.storage(url), rng=False) as ck:
        ck.save(1, _state(1))
        m2 = ck.save(2, _state(2))
    st = moto_s3.storage(url)
    obj = st.object_key(m2.shards[0].key)
    old = moto_s3.client.get_object(Bucket=st.bucket, Key=obj)
    data = bytearray(old["Body"].read())
    data[len(data) // 2] ^= 0x10  # one bit, in the tensor bytes
    # the object now holds other bytes than ckrun wrote (its CRC32C metadata kept)
    moto_s3.client.put_object(Bucket=st.bucket, Key=obj, Body=bytes(data), Metadata=old["Metadata"])
    state = {"w": torch.zeros(300_000), "extra": {}}
    with ckrun.Checkpointer(moto_s3.storage(url), rng=False) as ck:
        m = ck.load(state)
    assert m is not None and m.step == 1
    assert torch.equal(state["w"], _state(1)["w"])
    assert any("step 2" in s and "CRC32C mismatch" in s for s in ck.skipped), ck.skipped
    from ckrun.checkpoint.verify import Problem, verify_shards

    problems = verify_shards(st, m2)  # typed: what `ckrun verify` and the commit act on
    assert [(p.kind, p.conclusive) for p in problems] == [(Problem.CHECKSUM, True)]


def test_connection_dropped_mid_read_is_resumed(moto_s3: MotoS3, fault_proxy: FaultProxy) -> None:
    url = f"s3://{moto_s3.new_bucket()}/run"
    with ckrun.Checkpointer(moto_s3.storage(url), rng=False) as ck:
        m = ck.save(1, _state(1))
    via_proxy = moto_s3.storage(url, endpoint=fault_proxy.endpoint)
    fault_proxy.drop_next(2, match=m.shards[0].key, after_bytes=200_000)
    state = {"w": torch.zeros(300_000), "extra": {}}
    with ckrun.Checkpointer(via_proxy, rng=False) as ck:
        got = ck.load(state)
    assert got is not None and got.step == 1 and not ck.skipped
    assert torch.equal(state["w"], _state(1)["w"])
    assert fault_proxy.dropped == 2


def test_get_file_download_is_concurrent_ranged_and_retried(
    moto_s3: MotoS3, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    bucket = moto_s3.new_bucket()
    body = bytes(range(256)) * (48 * 1024)  # 12 MiB: 3 ranged parts of 5 MiB (< 3 full)
    MiB = 1 << 20
    direct = moto_s3.storage(
        bucket, s3_multipart_chunk_bytes=5 * MiB, s3_multipart_threshold_bytes=5 * MiB
    )
    direct.put("blob", body)
    st = moto_s3.storage(
        bucket,
        endpoint=fault_proxy.endpoint,
        s3_multipart_chunk_bytes=5 * MiB,
        s3_max_concurrency=3,
    )
    fault_proxy.drop_next(1, match="blob", after_bytes=MiB)
    st.get_file("blob", str(tmp_path / "out"))
    assert (tmp_path / "out").read_bytes() == body
    assert fault_proxy.dropped == 1
    assert fault_proxy.forwarded >= 4  # head + 3 ranged GETs (+ the retried one)


_RSS_CHILD = """
import json, resource, sys, threading
import ckrun, torch
from ckrun.storage.s3 import S3Options, S3Storage

MiB = 1 << 20
url, endpoint, size_mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
opts = S3Options(
    endpoint_url=endpoint,
    s3_multipart_chunk_bytes=5 * MiB,
    s3_multipart_threshold_bytes=5 * MiB,
    s3_max_concurrency=2,
)
ck = ckrun.Checkpointer(S3Storage.from_url(url, opts), rng=False)
ck.save(0, {"w": torch.ones(3 * MiB)})  # warm-up: client, pools, a multipart upload
state = {"w": torch.ones(size_mib * MiB // 4)}  # one tensor, touched


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


now = rss()
high = [now]
done = threading.Event()


def sample():  # the whole-tensor buffer of a bad writer lives for the whole upload
    while not done.wait(0.001):
        high[0] = max(high[0], rss())


threading.Thread(target=sample, daemon=True).start()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
m = ck.save(1, state)
done.set()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
exact = peak - now if peak > before else 0  # ru_maxrss: exact when the save set the peak
print(json.dumps({"extra_bytes": max(high[0] - now, exact), "size": m.total_size_bytes}))
"""


@pytest.mark.slow
def test_saving_a_large_tensor_to_s3_keeps_memory_bounded(moto_s3: MotoS3) -> None:
    """Peak RSS above the state while one 96 MiB tensor streams to S3 in 5 MiB parts,
    2 in flight: bounded by the writer's parts (~25 MiB), not the tensor (96 MiB).
    The saver is a child process: moto (in this process) holds the uploaded bytes."""
    import json
    import subprocess
    import sys

    url = f"s3://{moto_s3.new_bucket()}/run"
    r = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, url, moto_s3.endpoint, "96"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["size"] > 96 << 20
    assert out["extra_bytes"] < 48 << 20, f"{out['extra_bytes'] >> 20} MiB above the state"
