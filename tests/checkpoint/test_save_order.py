"""The order of a synchronous save's work (issue 19, small states saved every few
steps): what the written shard does not depend on runs while the disk writes it back,
and retention's thread is woken only when nothing of the save is left; a failure
before the commit leaves no shard behind.  Real saves on the local disk; each test
records the calls themselves, never a timing (the figures are in bench/README.md,
"Eleventh session")."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch
from ckrun.checkpoint import facade_save, pipeline, sharding
from ckrun.checkpoint.checkpointer import Checkpointer
from ckrun.checkpoint.manifest import Manifest
from ckrun.storage.local import LocalStorage


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": opt, "extra": {"w": torch.randn(1000)}}


def _record(monkeypatch: pytest.MonkeyPatch, calls: list[str], owner: Any, name: str) -> None:
    real = getattr(owner, name)

    def recorded(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        calls.append(name)
        return out

    monkeypatch.setattr(owner, name, recorded)


def test_the_compat_block_is_built_after_the_shard_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compat block and the model signature do not go into the shard: a one-rank
    save builds them after the shard's write-back has started, and the manifest still
    records them (the state cannot change before the save returns)."""
    calls: list[str] = []
    _record(monkeypatch, calls, sharding, "write_object")
    _record(monkeypatch, calls, Checkpointer, "compat_block")
    state = _state()
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
        m = ck.save(1, state)
    assert calls == ["write_object", "compat_block"]
    assert m.compat["optimizer"] == "SGD"
    assert m.signature is not None and set(m.signature["modules"]["model"]) == {"weight", "bias"}
    loaded = Manifest.loads(LocalStorage(str(tmp_path)).get(m.key), key=m.key)
    assert loaded.compat == m.compat and loaded.signature == m.signature


def _fails_in_compat(call: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``call()`` (a save or finalize) with a compat block that raises: it raises."""

    def broken(self: Any, state: Any = None) -> dict[str, Any]:
        raise RuntimeError("compat failed")

    with monkeypatch.context() as mp:
        mp.setattr(Checkpointer, "compat_block", broken)
        with pytest.raises(RuntimeError, match="compat failed"):
            call()


def test_a_compat_block_that_fails_after_the_shard_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built later, a compat block that raises still fails the save before its commit:
    the error reaches the caller, no manifest, and the shard already written is removed
    at once (nothing names it); the next save commits."""
    state = _state()
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
        _fails_in_compat(lambda: ck.save(1, state), monkeypatch)
        assert ck.latest() is None
        assert [p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()] == []
        assert ck.save(2, state).step == 2


def test_a_finalize_retried_after_a_failure_before_its_commit_has_one_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final artifact has no retention behind it: a finalize that failed before its
    commit and is then retried leaves exactly the retry's shard in ``final/``."""
    state = _state()
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
        _fails_in_compat(lambda: ck.finalize(1, state), monkeypatch)
        m = ck.finalize(1, state)
    files = sorted(p.name for p in (tmp_path / "final").rglob("*") if p.is_file())
    assert files == sorted([m.shards[0].key.rsplit("/", 1)[1], "manifest.json"]), files


def test_retention_starts_after_the_save_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waking the retention thread is the save's last step: after its report and the
    preemption bookkeeping, so the woken thread does not delay the save's return.  It
    still runs, once per committed save (keep_last=2 leaves two of four)."""
    calls: list[str] = []
    _record(monkeypatch, calls, facade_save, "report_save")
    _record(monkeypatch, calls, facade_save, "record_notice_save")
    _record(monkeypatch, calls, pipeline, "retain_later")
    state = _state()
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False, keep_last=2) as ck:
        for step in range(1, 5):
            ck.save(step, state)
        ck.save(4, state)  # already committed by this process: nothing to retain
    assert calls == ["report_save", "record_notice_save", "retain_later"] * 4 + [
        "report_save",
        "record_notice_save",
    ]
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == ["step-0000000003", "step-0000000004"], steps


def test_retention_runs_even_when_the_report_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report that raises after the commit does not leave the committed save without
    its retention pass."""
    state = _state()

    def failing_report(*a: Any, **kw: Any) -> None:
        raise OSError("events log unwritable")

    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False, keep_last=1) as ck:
        ck.save(1, state)
        monkeypatch.setattr(facade_save, "report_save", failing_report)
        with pytest.raises(OSError, match="unwritable"):
            ck.save(2, state)
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == ["step-0000000002"], steps


def test_the_entries_are_hashed_after_the_shard_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CRC32C of the shard's entries is not needed to write them: a one-rank save
    writes the bytes, commits the shard (its write-back starts) and only then hashes
    the same host arrays.  The manifest's checksums are those of the bytes on disk:
    the whole file's, the header's and each entry's, recomputed here from the file."""
    import crc32c
    from ckrun.checkpoint import st_format
    from ckrun.storage import local_writer

    calls: list[str] = []
    _record(monkeypatch, calls, local_writer.LocalWriter, "commit")
    real_crc = crc32c.crc32c

    def crc(data: Any, value: int = 0) -> int:
        calls.append("crc32c")
        return int(real_crc(data, value))

    monkeypatch.setattr(st_format.crc32c, "crc32c", crc)
    state = {"extra": {"w": torch.randn(300_000), "v": torch.randn(7)}}
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
        m = ck.save(1, state)
    first_commit = calls.index("commit")
    assert "crc32c" in calls and calls.index("crc32c") > first_commit
    assert calls[first_commit + 1 :].count("commit") == 1  # then the manifest's
    data = (tmp_path / m.shards[0].key).read_bytes()
    assert m.shards[0].checksum == f"crc32c:{real_crc(data):08x}"
    assert m.tensor_layout is not None
    shard = m.tensor_layout["shards"][0]
    assert shard["header_crc"] == f"crc32c:{real_crc(data[: shard['header_bytes']]):08x}"
    assert len(shard["entries"]) == 2
    for begin, end, entry_crc in shard["entries"].values():
        assert entry_crc == f"crc32c:{real_crc(data[begin:end]):08x}"
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
        fresh = {"extra": {"w": torch.zeros(300_000), "v": torch.zeros(7)}}
        ck.load(fresh)
    assert torch.equal(fresh["extra"]["w"], state["extra"]["w"])


def test_a_hash_that_fails_after_the_commit_leaves_no_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashing runs after the shard's commit and before the manifest's: when it fails
    (here the CRC32C raises once the shard is committed), the save fails, nothing names
    the shard, and the shard is removed at once, as any failure before the manifest."""
    from ckrun.checkpoint import st_format
    from ckrun.storage import local_writer

    committed: list[str] = []
    _record(monkeypatch, committed, local_writer.LocalWriter, "commit")
    real_crc = st_format.crc32c.crc32c

    def crc(data: Any, value: int = 0) -> int:
        if committed:
            raise MemoryError("hashing after the commit failed")
        return int(real_crc(data, value))

    monkeypatch.setattr(st_format.crc32c, "crc32c", crc)
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
        with pytest.raises(MemoryError):
            ck.save(1, {"extra": {"w": torch.randn(1000)}})
        assert committed == ["commit"]
        assert ck.latest() is None
    left = [p.name for p in tmp_path.rglob("*") if p.is_file() and "shard" in p.name]
    assert left == []


class _OnDevice(torch.Tensor):
    """A host tensor that says it lives on a CUDA device (this test needs no GPU): its
    ``to("cpu")`` returns a new host copy, as a device tensor's does, and records it."""

    copies: list[Any] = []

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def to(self, *a: Any, **kw: Any) -> torch.Tensor:  # type: ignore[override]
        import weakref

        with torch._C.DisableTorchFunctionSubclass():
            host = torch.Tensor.clone(self)
        _OnDevice.copies.append(weakref.ref(host))
        return host


def test_a_device_entry_is_written_from_a_host_copy_that_is_alive() -> None:
    """A device tensor's entry is copied to the host one tensor at a time and written
    and hashed from that copy: the copy stays alive until both are done (a byte view
    does not keep it alive; a freed copy wrote freed memory or crashed the process)."""
    import crc32c
    from ckrun.checkpoint import st_format

    source = torch.arange(16_384, dtype=torch.float32)
    alive_at_write: list[bool] = []

    class Writer:
        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, b: Any) -> None:
            alive_at_write.append(all(r() is not None for r in _OnDevice.copies))
            self.data += bytes(b)

        def commit(self) -> None:
            pass

        def abort(self) -> None:
            pass

    _OnDevice.copies.clear()
    w = Writer()
    out = st_format.write_unhashed(
        w,  # type: ignore[arg-type]
        {"x": 0},
        [source.as_subclass(_OnDevice)],
        ["x"],
    ).hash()
    assert len(_OnDevice.copies) == 1 and alive_at_write == [True, True]
    begin, end, entry_crc = out.entries["x"]
    assert bytes(w.data[begin:end]) == source.numpy().tobytes()
    assert entry_crc == f"crc32c:{crc32c.crc32c(bytes(w.data[begin:end])):08x}"


def test_a_big_entry_is_hashed_while_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19: an entry of BESIDE_BYTES or more is hashed on a second thread beside
    its own write, not after the shard's commit (where it added about a quarter to a
    write-behind save).  The big entry's write waits until its hash has begun, which a
    hash after the commit never does (the write waits out its 10 s and records False).
    The manifest's checksums are still those of the bytes on disk."""
    import crc32c
    from ckrun.checkpoint import crc_beside
    from ckrun.storage import local_writer, probe

    monkeypatch.setenv("CKRUN_WRITER", "writebehind")  # the writer this test watches
    probe.forget()
    began = threading.Event()
    hashers: set[str] = set()
    waited: list[bool] = []
    real_crc, real_write = crc32c.crc32c, local_writer.LocalWriter.write

    def crc(data: Any, value: int = 0) -> int:
        if len(memoryview(data).cast("B")) >= crc_beside.BESIDE_BYTES:
            hashers.add(threading.current_thread().name)
            began.set()
        return int(real_crc(data, value))

    def write(self: local_writer.LocalWriter, data: Any) -> int:
        if len(memoryview(data).cast("B")) >= crc_beside.BESIDE_BYTES and not waited:
            waited.append(began.wait(10))
        return real_write(self, data)

    monkeypatch.setattr(crc32c, "crc32c", crc)
    monkeypatch.setattr(local_writer.LocalWriter, "write", write)
    state = {"extra": {"w": torch.randn(crc_beside.BESIDE_BYTES // 2), "v": torch.randn(7)}}
    try:
        with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
            m = ck.save(1, state)
    finally:
        probe.forget()
    assert waited == [True] and all(n.startswith("ckrun-hash") for n in hashers)
    data = (tmp_path / m.shards[0].key).read_bytes()
    assert m.shards[0].checksum == f"crc32c:{real_crc(data):08x}"
    assert m.tensor_layout is not None
    for begin, end, entry_crc in m.tensor_layout["shards"][0]["entries"].values():
        assert entry_crc == f"crc32c:{real_crc(data[begin:end]):08x}"
    with ckrun.Checkpointer(storage=str(tmp_path), rng=False, lock=False) as ck:
        fresh = {"extra": {"w": torch.zeros_like(state["extra"]["w"]), "v": torch.zeros(7)}}
        ck.load(fresh)
    assert torch.equal(fresh["extra"]["w"], state["extra"]["w"])


def test_a_hash_beside_the_writes_keeps_its_array_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor's byte view does not keep the tensor alive, so the hash thread keeps
    the array itself until its hash is done: a save that fails before collecting the
    hash (its writer's commit raised) may drop its arrays meanwhile, and a hash of a
    freed array would read unmapped memory."""
    import gc
    import weakref

    import crc32c
    from ckrun.checkpoint import crc_beside
    from ckrun.checkpoint import shard as fmt

    gate = threading.Event()
    alive: list[bool] = []
    real = crc32c.crc32c
    t = torch.randn(crc_beside.BESIDE_BYTES // 4)
    want = real(t.numpy().tobytes())
    ref = weakref.ref(t)

    def crc(data: Any, value: int = 0) -> int:
        assert gate.wait(10)
        alive.append(ref() is not None)
        return int(real(data, value)) if alive[-1] else 0  # never read freed memory

    monkeypatch.setattr(crc32c, "crc32c", crc)
    beside = crc_beside.Beside()
    fut = beside.start(fmt.bytes_view(t), t)
    del t
    gc.collect()
    gate.set()
    assert fut is not None and fut.result() == want
    beside.close()
    assert alive == [True]


def test_a_shard_whose_commit_fails_leaves_no_hash_thread() -> None:
    """A big entry's hash runs on a thread of the save; when the shard's commit raises
    (an I/O error, a lazy snapshot's final check), the save ends that thread before the
    error leaves it, even while the error is still referenced."""
    from ckrun.checkpoint import crc_beside, sharding
    from ckrun.checkpoint import shard as fmt
    from ckrun.checkpoint.process_group import Group

    class Writer:
        def write(self, b: Any) -> None:
            pass

        def commit(self) -> None:
            raise OSError("commit failed")

        def abort(self) -> None:
            pass

    snap = fmt.snapshot({"w": torch.randn(crc_beside.BESIDE_BYTES // 2)})
    planned = sharding.plan(snap, Group(0, 1))
    with pytest.raises(OSError, match="commit failed") as err:
        sharding.write_object(Writer(), planned)  # type: ignore[arg-type]
    assert err.value is not None
    assert [t for t in threading.enumerate() if t.name.startswith("ckrun-hash")] == []
