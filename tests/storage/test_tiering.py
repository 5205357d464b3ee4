"""Two-tier checkpoints (local commit, background upload to S3 on moto) with the real
Checkpointer; the deadline decision uses upload throughput measured on a bandwidth-capped
S3 storage, not an injected number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch
from ckrun import control
from ckrun.checkpoint import layout
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.tiering import TieredStorage, UploadPolicy
from ckrun.errors import ConfigError
from ckrun.notices import PREEMPTION, Notice
from ckrun.storage.local import LocalStorage
from ckrun.storage.s3_transfer import RateLimiter
from s3_server import MotoS3

pytestmark = pytest.mark.s3


def make_state(seed: int = 0, width: int = 8) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, width)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def train_step(state: dict) -> None:
    x = torch.randn(4, state["model"].in_features)
    loss = state["model"](x).pow(2).mean()
    state["optimizer"].zero_grad()
    loss.backward()
    state["optimizer"].step()


def steps_in(st, area: str = "checkpoints/") -> list[int]:
    return sorted(p.step for i in st.list(area) if (p := layout.parse(i.key)) and p.is_manifest)


@pytest.fixture(autouse=True)
def _no_notice(monkeypatch, tmp_path):
    control.reset_for_tests()
    monkeypatch.setenv("CKRUN_CONTROL_DIR", str(tmp_path / "state" / "control"))
    yield
    control.reset_for_tests()


def tiered(moto_s3: MotoS3, tmp_path: Path, bucket: str, **kw) -> TieredStorage:
    opts = {k: kw.pop(k) for k in list(kw) if k.startswith("s3_")}
    remote = moto_s3.storage(f"s3://{bucket}/runs/r1", **opts)
    return TieredStorage(LocalStorage(str(tmp_path / "local")), remote, **kw)


def test_commit_local_upload_remote_manifest_last_retention(moto_s3, tmp_path) -> None:
    t = tiered(moto_s3, tmp_path, moto_s3.new_bucket(), keep_last=2)
    state = make_state()
    with ckrun.Checkpointer(t, keep_last=2, rng=False) as ck:
        for step in range(1, 6):
            train_step(state)
            ck.save(step, state)
    assert t.flush(30)
    assert steps_in(t.local) == [4, 5]
    assert steps_in(t.remote) == [4, 5]
    for step in (4, 5):
        key = layout.manifest_key(step)
        assert t.remote.get(key) == t.local.get(key)
        m = ckrun.Manifest.loads(t.remote.get(key), key=key)
        for s in m.shards:  # S3's full-object CRC32C equals the manifest's
            assert f"crc32c:{t.remote.crc32c(s.key):08x}" == s.checksum
    assert t.stats["failed"] == 0 and t.stats["upload_bps"]  # uploads that the local tier
    assert t.stats["uploads"] + t.stats["superseded"] == 5  # deleted first are superseded


def test_fresh_machine_resumes_from_remote(moto_s3, tmp_path) -> None:
    bucket = moto_s3.new_bucket()
    state = make_state(seed=1)
    t = tiered(moto_s3, tmp_path / "vm1", bucket)
    with ckrun.Checkpointer(t, rng=False) as ck:
        for step in range(1, 4):
            train_step(state)
            ck.save(step, state)
    assert t.flush(30)
    fresh = tiered(moto_s3, tmp_path / "vm2", bucket)  # empty local tier
    assert fresh.local.list() == []
    other = make_state(seed=99)
    with ckrun.Checkpointer(fresh, rng=False) as ck2:
        m = ck2.load(other)
    assert m is not None and m.step == 3
    for a, b in zip(state["model"].parameters(), other["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_policy_milestones_and_final_marker_last(moto_s3, tmp_path) -> None:
    t = tiered(
        moto_s3,
        tmp_path,
        moto_s3.new_bucket(),
        policy=UploadPolicy.parse("milestones"),
        keep_last=10,
    )
    state = make_state()
    with ckrun.Checkpointer(t, keep_last=10, milestone_every=3, rng=False) as ck:
        for step in range(1, 7):
            ck.save(step, state)
        ck.finalize(7, state)
    assert t.flush(30)
    assert steps_in(t.local) == [1, 2, 3, 4, 5, 6]
    assert steps_in(t.remote) == [3, 6]
    assert steps_in(t.remote, "final/") == [7]
    assert t.remote.head(layout.COMPLETE) is not None


def test_policy_parse() -> None:
    assert UploadPolicy.parse("every:3") == UploadPolicy("every_n", 3)
    assert UploadPolicy("every_n", 3).selects(
        ckrun.Manifest.__new__(ckrun.Manifest), emergency=True, ordinal=1
    )
    with pytest.raises(ConfigError, match="every:N"):
        UploadPolicy.parse("sometimes")


def test_local_corruption_is_not_uploaded(moto_s3, tmp_path) -> None:
    t = tiered(moto_s3, tmp_path, moto_s3.new_bucket(), policy=UploadPolicy("emergency"))
    state = make_state()
    with ckrun.Checkpointer(t, rng=False) as ck:
        m = ck.save(1, state)
    path = t.local.local_path(m.shards[0].key)
    with open(path, "r+b") as f:  # bit rot on the local disk after the commit
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ckrun.CorruptCheckpoint, match="changed since its commit"):
        t.upload(m)
    assert t.remote.list() == []  # neither shard nor manifest


def _notice_in(seconds: float) -> None:
    cdir = control.control_dir()
    assert cdir
    control.write_notice(cdir, Notice.with_lead(PREEMPTION, "aws", seconds))


def test_emergency_upload_that_cannot_finish_is_not_started(moto_s3, tmp_path) -> None:
    t = tiered(
        moto_s3, tmp_path, moto_s3.new_bucket(), s3_bandwidth_bytes_per_s=8 << 20, margin_s=0.5
    )
    small, big = make_state(width=1024), make_state(width=4096)  # ~4 MB, ~64 MB
    with ckrun.Checkpointer(t, rng=False) as ck:
        ck.save(1, small)
        assert t.flush(30)
        ck.save(2, small)  # a second upload: throughput measured under the 8 MiB/s cap
        assert t.flush(30)
        bps = t.stats["upload_bps"]
        # the token bucket lets a quarter second's worth (RateLimiter.BURST_S) go at
        # once, so an upload of n bytes takes at least (n - burst) / rate: for these
        # ~4 MB uploads the measured rate may reach ~1.5-2x the cap, never more
        n = t.stats["bytes"] / t.stats["uploads"]
        rate = 8 << 20
        burst = rate * RateLimiter.BURST_S
        assert n > 2 * burst and bps <= rate * n / (n - burst), (bps, n)
        _notice_in(3.0)  # 64 MB at ~8 MiB/s needs ~8 s: cannot finish
        ck.save(3, big)
    assert t.flush(30)
    assert steps_in(t.local)[-1] == 3  # committed locally
    assert steps_in(t.remote) == [1, 2]  # remote keeps the previous checkpoint
    assert t.stats["skipped"] == 1
    events = [json.loads(x) for x in (tmp_path / "state" / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["kind"] == "upload_skipped"]
    assert skipped and skipped[0]["step"] == 3 and "local tier only" in skipped[0]["message"]


_CHILD = textwrap.dedent("""
    import sys, torch, ckrun
    from ckrun.checkpoint.tiering import TieredStorage, UploadPolicy
    from ckrun.storage.local import LocalStorage
    from ckrun.storage.s3 import S3Storage
    t = TieredStorage(LocalStorage(sys.argv[1]), S3Storage.from_url(sys.argv[2]),
                      policy=UploadPolicy("emergency"))
    torch.manual_seed(0)
    m = torch.nn.Linear(512, 512)
    ck = ckrun.Checkpointer(t, rng=False)
    ck.save(1, {"model": m})          # not uploaded: policy emergency, no notice
    ckrun.control._flag.set()         # as the notice signal handler would
    ck.save(2, {"model": m})          # the emergency checkpoint: upload queued
    sys.exit(75)                      # atexit drains the upload before the exit
""")


def test_child_exit_waits_for_emergency_upload(moto_s3, tmp_path) -> None:
    bucket = moto_s3.new_bucket()
    url = f"s3://{bucket}/runs/child"
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path / "ctl"))
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "local"), url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 75, r.stderr
    remote = moto_s3.storage(url)
    assert steps_in(remote) == [2]


def test_open_from_env(moto_s3, tmp_path) -> None:
    from ckrun.checkpoint.tiering import open_from_env

    url = f"s3://{moto_s3.new_bucket()}/runs/r7"
    assert open_from_env(url, {}) is None
    assert open_from_env(str(tmp_path), {"CKRUN_LOCAL_TIER": str(tmp_path)}) is None
    t = open_from_env(
        url, {"CKRUN_LOCAL_TIER": str(tmp_path / "nvme"), "CKRUN_UPLOAD_POLICY": "every:4"}
    )
    assert t is not None and t.url == url and t.policy == UploadPolicy("every_n", 4)
    assert t.local.url.endswith("nvme/r7")
    with pytest.raises(ConfigError):
        open_from_env(url, {"CKRUN_LOCAL_TIER": "/x", "CKRUN_REMOTE_KEEP_LAST": "0"})


def test_lease_lives_in_the_remote_tier_and_fences_uploads(moto_s3, tmp_path, monkeypatch) -> None:
    """Issue 12: a stale owner's local commit is refused, and so is its remote upload."""
    from ckrun.checkpoint.lease import EPOCH_ENV, Lease, read_lease

    bucket = moto_s3.new_bucket()
    t = tiered(moto_s3, tmp_path, bucket)
    lease = Lease(t, "r1", ttl_s=30)
    lease.acquire()
    assert read_lease(t.remote) is not None and t.local.head(layout.LEASE) is None
    monkeypatch.setenv(EPOCH_ENV, str(lease.epoch))
    state = make_state()
    t = tiered(moto_s3, tmp_path, bucket)  # the fence is read from the environment
    with ckrun.Checkpointer(t, rng=False) as ck:
        ck.save(1, state)
        assert t.flush(30) and steps_in(t.remote) == [1]
        m = json.loads(t.remote.get(layout.manifest_key(1)))
        assert m["lease_epoch"] == lease.epoch
        lease.release()  # another owner may take the run now: this writer is stale
        with pytest.raises(ckrun.errors.LeaseLost):
            ck.save(2, state)  # the local commit is refused
        committed = Manifest.loads(t.local.get(layout.manifest_key(1)), key=layout.manifest_key(1))
        with pytest.raises(ckrun.errors.LeaseLost):
            t.upload(committed)  # and so is a remote commit (and the retention after it)
    assert steps_in(t.local) == [1] and steps_in(t.remote) == [1]


def test_the_storage_factory_reads_no_environment_and_ckrun_open_storage_does(
    moto_s3, tmp_path, monkeypatch
) -> None:
    """ckrun.storage.open_storage is the storage layer's factory: CKRUN_LOCAL_TIER plays
    no part; ckrun.open_storage (the public name) adds the local tier it names, or the
    one passed as local_tier."""
    from ckrun.storage import open_storage
    from ckrun.storage.s3 import S3Storage

    url = f"s3://{moto_s3.new_bucket()}/runs/r8"
    monkeypatch.setenv("CKRUN_LOCAL_TIER", str(tmp_path / "nvme"))
    assert type(open_storage(url)) is S3Storage
    t = ckrun.open_storage(url)
    assert isinstance(t, TieredStorage) and t.local.url == str(tmp_path / "nvme" / "r8")
    monkeypatch.delenv("CKRUN_LOCAL_TIER")
    assert type(ckrun.open_storage(url)) is S3Storage
    t = ckrun.open_storage(url, local_tier=str(tmp_path / "ssd"))
    assert isinstance(t, TieredStorage) and t.local.url == str(tmp_path / "ssd" / "r8")
    assert type(ckrun.open_storage(str(tmp_path / "run"))) is LocalStorage


def _held_tier(tmp_path: Path) -> tuple[TieredStorage, Any, Any]:
    """A two-tier storage whose remote tier (a second local directory) holds each
    manifest commit until ``release`` is set; ``entered`` is set when one arrives."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class HeldRemote(LocalStorage):
        def put(self, key: str, data: bytes | memoryview, **kw: Any) -> Any:
            if key.endswith("manifest.json"):
                entered.set()
                assert release.wait(30)
            return super().put(key, data, **kw)

    local, remote = LocalStorage(str(tmp_path / "local")), HeldRemote(str(tmp_path / "remote"))
    return TieredStorage(local, remote, keep_last=9), entered, release


def test_local_retention_keeps_what_the_running_upload_reads(tmp_path: Path) -> None:
    """Saves faster than uploads: local retention reached the checkpoint being uploaded
    and the upload failed on missing files.  Now the running upload's files stay until
    it is done, then go; queued uploads of checkpoints retention deletes are dropped
    (superseded), so local disk stays bounded by ``keep_last``."""
    t, entered, release = _held_tier(tmp_path)
    state = make_state()
    with ckrun.Checkpointer(t, keep_last=1, rng=False, lock=False) as ck:
        ck.save(1, state)
        assert entered.wait(30)  # step 1's upload is running, held at its commit
        for step in range(2, 6):
            train_step(state)
            ck.save(step, state)
    assert steps_in(t.local) == [1, 5]  # 2-4 deleted at once, 1 waits for its upload
    release.set()
    assert t.flush(30)
    assert (t.stats["uploads"], t.stats["superseded"], t.stats["failed"]) == (2, 3, 0)
    assert steps_in(t.remote) == [1, 5]
    assert steps_in(t.local) == [5]  # the deferred deletes ran after the upload
    m = Manifest.loads(t.local.get(layout.manifest_key(5)), key=layout.manifest_key(5))
    assert {i.key for i in t.local.list("checkpoints/")} == {m.key, *(s.key for s in m.shards)}


def test_a_plain_delete_is_immediate_and_drops_the_queued_upload(tmp_path: Path) -> None:
    """A delete that is not retention's (a manifest withdrawn after the lease moved on,
    a corrupt one replaced) takes effect at once, even for the running upload's files,
    and a queued upload of it is dropped: a withdrawn commit never lingers behind it."""
    t, entered, release = _held_tier(tmp_path)
    state = make_state()
    with ckrun.Checkpointer(t, keep_last=9, rng=False, lock=False) as ck:
        ck.save(1, state)
        assert entered.wait(30)
        ck.save(2, state)
    t.delete([layout.manifest_key(2), layout.manifest_key(1)])
    assert steps_in(t.local) == []
    release.set()
    assert t.flush(30)
    assert t.stats["superseded"] == 1 and t.stats["uploads"] + t.stats["failed"] == 1
    assert layout.manifest_key(2) not in {i.key for i in t.remote.list("checkpoints/")}


def test_a_failed_deferred_delete_stays_deferred() -> None:
    from ckrun.checkpoint.tiering_util import Pins
    from ckrun.errors import StorageError

    calls: list[list[str]] = []
    fail = [False]

    def delete(keys: Any) -> None:
        calls.append(list(keys))
        if fail[0]:
            fail[0] = False
            raise StorageError("injected")

    pins = Pins(delete)
    pins.pin(["a", "b"])
    pins.delete(["a", "c"])  # c now, a deferred
    assert calls == [["c"]]
    calls.clear()
    fail[0] = True
    with pytest.raises(StorageError):
        pins.unpin(["a", "b"])
    pins.unpin([])  # the next unpin retries it
    assert calls == [["a"], ["a"]] and pins.held() == 0
