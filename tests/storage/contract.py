"""The Storage contract (DESIGN.md §3), backend-agnostic; collected by test_contract.py.

Every test takes the parametrized ``storage`` fixture (tests/storage/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from ckrun.errors import InvalidKey, ObjectExists, ObjectNotFound, PreconditionFailed
from ckrun.storage.base import ObjectWriter, PublishesAfter, Storage

BAD_KEYS = ["../escape", "a/../../b", "/abs/key", "a//b", "a/./b", "", "a\\b", "a/b/", "x\x00"]


def test_is_a_storage(storage: Any) -> None:
    assert isinstance(storage, Storage)


def test_put_get_head_roundtrip(storage: Storage) -> None:
    info = storage.put("a/b/obj.bin", b"hello")
    assert info.key == "a/b/obj.bin" and info.size_bytes == 5
    assert storage.get("a/b/obj.bin") == b"hello"
    head = storage.head("a/b/obj.bin")
    assert head is not None and head.size_bytes == 5


def test_put_replaces_whole_object(storage: Storage) -> None:
    storage.put("k", b"x" * 100)
    storage.put("k", memoryview(b"short"))
    assert storage.get("k") == b"short"


def test_empty_object(storage: Storage) -> None:
    storage.put("empty", b"")
    assert storage.get("empty") == b""
    head = storage.head("empty")
    assert head is not None and head.size_bytes == 0


def test_missing_object(storage: Storage) -> None:
    assert storage.head("nope") is None
    with pytest.raises(ObjectNotFound):
        storage.get("nope")
    with pytest.raises(ObjectNotFound):
        storage.open_read("nope")


def test_conditional_create(storage: Storage) -> None:
    storage.put("once", b"1", if_absent=True)
    with pytest.raises(ObjectExists):
        storage.put("once", b"2", if_absent=True)
    assert storage.get("once") == b"1"


def test_streaming_write_invisible_until_commit(storage: Storage) -> None:
    w = storage.open_write("stream/obj")
    assert isinstance(w, ObjectWriter)
    w.write(b"a" * 1000)
    w.write(memoryview(bytearray(b"b" * 24)))
    assert storage.head("stream/obj") is None
    assert [o.key for o in storage.list("stream/")] == []
    info = w.commit()
    assert info.size_bytes == 1024
    assert storage.get("stream/obj") == b"a" * 1000 + b"b" * 24


def test_abort_leaves_nothing(storage: Storage) -> None:
    w = storage.open_write("gone/obj")
    w.write(b"partial")
    w.abort()
    w.abort()  # idempotent
    assert storage.head("gone/obj") is None
    with pytest.raises(RuntimeError), storage.open_write("gone/obj2") as w2:
        w2.write(b"partial")
        raise RuntimeError("boom")
    assert storage.head("gone/obj2") is None
    assert storage.list("gone/") == []


def test_context_manager_commits(storage: Storage) -> None:
    with storage.open_write("cm/obj") as w:
        w.write(b"data")
    assert storage.get("cm/obj") == b"data"


def test_large_streaming_write(storage: Storage) -> None:
    chunk = os.urandom(1 << 20)
    with storage.open_write("big/obj") as w:
        for _ in range(40):
            w.write(chunk)
    head = storage.head("big/obj")
    assert head is not None and head.size_bytes == 40 << 20
    with storage.open_read("big/obj") as f:
        assert f.read(1 << 20) == chunk


def test_list_prefix_sorted(storage: Storage) -> None:
    for k in ["p/b", "p/a", "p/c/d", "pq/x", "other"]:
        storage.put(k, k.encode())
    assert [o.key for o in storage.list("p/")] == ["p/a", "p/b", "p/c/d"]
    assert [o.key for o in storage.list("p")] == ["p/a", "p/b", "p/c/d", "pq/x"]
    assert [o.key for o in storage.list()] == ["other", "p/a", "p/b", "p/c/d", "pq/x"]
    assert {o.key: o.size_bytes for o in storage.list("p/c")} == {"p/c/d": 5}
    assert storage.list("nothing/") == []


def test_delete_idempotent(storage: Storage) -> None:
    storage.put("d/1", b"1")
    storage.put("d/2", b"2")
    storage.delete(["d/1", "d/missing"])
    assert storage.head("d/1") is None and storage.get("d/2") == b"2"
    storage.delete(["d/1"])
    storage.delete([])


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_rejected(storage: Storage, key: str) -> None:
    with pytest.raises(InvalidKey):
        storage.put(key, b"x")
    with pytest.raises(InvalidKey):
        storage.get(key)
    with pytest.raises(InvalidKey):
        storage.head(key)
    with pytest.raises(InvalidKey):
        storage.delete([key])


def test_put_file_get_file(storage: Storage, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    data = os.urandom(3 << 20)
    src.write_bytes(data)
    assert storage.put_file("files/f", str(src)).size_bytes == len(data)
    dst = tmp_path / "out" / "dst.bin"
    dst.parent.mkdir()
    storage.get_file("files/f", str(dst))
    assert dst.read_bytes() == data


def test_open_read_streams(storage: Storage) -> None:
    storage.put("r", bytes(range(256)) * 10)
    with storage.open_read("r") as f:
        assert f.read(3) == b"\x00\x01\x02"
        assert len(f.read()) == 2560 - 3


def test_conditional_update_compare_and_swap(storage: Storage) -> None:
    created = storage.put("cas/obj", b"v1", if_absent=True)
    data, v1 = storage.get_versioned("cas/obj")
    assert data == b"v1" and created.version == v1
    upd = storage.put("cas/obj", b"v2", if_match=v1)
    data, v2 = storage.get_versioned("cas/obj")
    assert data == b"v2" and upd.version == v2 and v2 != v1
    with pytest.raises(PreconditionFailed):  # a stale version is refused
        storage.put("cas/obj", b"stale", if_match=v1)
    assert storage.get("cas/obj") == b"v2"
    with pytest.raises(PreconditionFailed):  # no object: nothing to compare with
        storage.put("cas/missing", b"x", if_match=v1)
    assert storage.head("cas/missing") is None
    with pytest.raises(ObjectNotFound):
        storage.get_versioned("cas/missing")


def test_conditional_update_one_winner(storage: Storage) -> None:
    """Two writers holding the same version: exactly one update succeeds."""
    import threading

    storage.put("cas/race", b"base", if_absent=True)
    _, v = storage.get_versioned("cas/race")
    outcomes: list[str] = []
    barrier = threading.Barrier(4)

    def writer(i: int) -> None:
        barrier.wait()
        try:
            storage.put("cas/race", f"writer-{i}".encode(), if_match=v)
            outcomes.append(f"writer-{i}")
        except PreconditionFailed:
            outcomes.append("refused")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o != "refused"]
    assert len(winners) == 1 and outcomes.count("refused") == 3
    assert storage.get("cas/race") == winners[0].encode()


# -- the run's lease (ckrun.checkpoint.lease) over every backend ----------------------


class _Clock:
    """A monotonic clock the test advances (expiry without sleeping)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _lease(storage: Storage, clock: _Clock, ttl_s: float = 30.0, attempt: int = 0) -> Any:
    from ckrun.checkpoint.lease import Lease

    return Lease(storage, "r1", ttl_s=ttl_s, attempt=attempt, clock=clock, sleep=lambda s: None)


def test_lease_acquire_renew_release(storage: Storage) -> None:
    from ckrun.checkpoint.lease import read_lease

    clock = _Clock()
    a = _lease(storage, clock)
    rec = a.acquire()
    assert rec.epoch == 1 and a.epoch == 1 and rec.holder is not None
    cur = read_lease(storage)
    assert cur is not None and cur[0] == rec
    a.renew()
    a.renew()
    cur = read_lease(storage)
    assert cur is not None and cur[0].renewals == 2 and cur[0].epoch == 1
    a.release()
    cur = read_lease(storage)
    assert cur is not None and cur[0].holder is None and cur[0].epoch == 1
    b = _lease(storage, clock, attempt=1)
    assert b.acquire().epoch == 2  # a released lease is taken at once, next epoch


def test_lease_held_refuses_then_expires_and_is_taken_over(storage: Storage) -> None:
    from ckrun.checkpoint.lease import Fence
    from ckrun.errors import LeaseHeld, LeaseLost

    clock = _Clock()
    a = _lease(storage, clock, ttl_s=30)
    a.holder = _foreign(a.holder)
    a.acquire()
    b = _lease(storage, clock)
    with pytest.raises(LeaseHeld, match="owned by host .* pid .* epoch 1"):
        b.acquire(wait_s=0)
    watch: dict[str, Any] = {}
    assert b.try_acquire(watch) is None  # B starts watching A's version
    clock.t += 20
    a.renew()  # A is alive: a new version restarts B's count
    assert b.try_acquire(watch) is None
    clock.t += 29.9
    assert b.try_acquire(watch) is None  # not silent for a whole TTL yet
    clock.t += 0.2
    rec = b.try_acquire(watch)  # silent for 30.1 s on B's clock: taken over
    assert rec is not None and rec.epoch == 2 and b.epoch == 2
    with pytest.raises(LeaseLost, match="epoch 1 was lost"):
        a.renew()  # conditional write of the stale holder refused
    with pytest.raises(LeaseLost, match="refused"):
        Fence(storage, 1).check("step 10")
    Fence(storage, 2).check("step 10")
    Fence(storage, None).check("step 10")  # unfenced: no supervisor


def test_lease_takeover_race_has_one_winner(storage: Storage) -> None:
    import threading

    clock = _Clock()
    a = _lease(storage, clock, ttl_s=5)
    a.holder = _foreign(a.holder)
    a.acquire()
    rivals = [_lease(storage, clock, ttl_s=5, attempt=i) for i in range(4)]
    watches: list[dict[str, Any]] = [{} for _ in rivals]
    for r, w in zip(rivals, watches, strict=True):
        assert r.try_acquire(w) is None
    clock.t += 6
    barrier = threading.Barrier(len(rivals))
    won: list[int] = []

    def go(i: int) -> None:
        barrier.wait()
        if rivals[i].try_acquire(watches[i]) is not None:
            won.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(rivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and rivals[won[0]].epoch == 2
    assert [r.epoch for i, r in enumerate(rivals) if i != won[0]] == [None] * 3


def test_lease_creation_race_has_one_winner(storage: Storage) -> None:
    import threading

    clock = _Clock()
    rivals = [_lease(storage, clock, attempt=i) for i in range(4)]
    barrier = threading.Barrier(len(rivals))
    won: list[int] = []

    def go(i: int) -> None:
        barrier.wait()
        if rivals[i].try_acquire({}) is not None:
            won.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(rivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and rivals[won[0]].epoch == 1


def test_lease_dead_holder_on_this_machine_is_taken_at_once(storage: Storage) -> None:
    import subprocess
    import sys

    clock = _Clock()
    a = _lease(storage, clock)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that is gone
    from dataclasses import replace

    a.holder = replace(a.holder, pid=p.pid, started=1)
    a.acquire()
    b = _lease(storage, clock)
    assert b.acquire(wait_s=0).epoch == 2


def _foreign(holder: Any) -> Any:
    """The holder as seen from another machine (never provably dead from here)."""
    from dataclasses import replace

    return replace(holder, machine="another-machine")


def test_read_into_reads_a_byte_range(storage: Storage) -> None:
    """Ranged reads (issue 14): exactly the bytes asked for; a range past the end or a
    missing object is an error, never a short buffer."""
    from ckrun.errors import StorageError

    data = os.urandom(300_000)
    storage.put("r/obj.bin", data)
    buf = bytearray(1000)
    storage.read_into("r/obj.bin", 123_457, memoryview(buf))
    assert bytes(buf) == data[123_457:124_457]
    storage.read_into("r/obj.bin", 0, memoryview(buf)[:0])  # empty range: nothing to read
    with pytest.raises(StorageError):
        storage.read_into("r/obj.bin", len(data) - 10, memoryview(bytearray(20)))
    with pytest.raises(ObjectNotFound):
        storage.read_into("r/missing.bin", 0, memoryview(bytearray(4)))


def _unreferenced(storage: Storage) -> PublishesAfter:
    if not isinstance(storage, PublishesAfter):
        pytest.skip(f"{storage!r} has no unreferenced objects (optional capability)")
    return storage


@pytest.mark.parametrize("size", [1000, (40 << 20) + 123])
def test_unreferenced_object_published_after(storage: Storage, size: int) -> None:
    """An unreferenced object lies under its key at its commit (no temp name, no
    rename); ``put_after`` publishes the object naming it; both read back whole."""
    st = _unreferenced(storage)
    data = os.urandom(size)
    w = st.open_unreferenced("unref/step/shard-1")
    assert w is not None
    for i in range(0, size, 1 << 20):
        w.write(data[i : i + (1 << 20)])
    assert w.commit().size_bytes == size
    w.abort()  # after the commit: nothing to undo, the object stays
    assert storage.get("unref/step/shard-1") == data
    st.put_after("unref/step/manifest", b"names shard-1", [w], if_absent=True)
    assert storage.get("unref/step/manifest") == b"names shard-1"
    with pytest.raises(ObjectExists):  # still a conditional create
        st.put_after("unref/step/manifest", b"other", [w], if_absent=True)
    assert storage.get("unref/step/manifest") == b"names shard-1"
    assert [o.key for o in storage.list("unref/")] == ["unref/step/manifest", "unref/step/shard-1"]


def test_unreferenced_abort_and_fresh_keys(storage: Storage) -> None:
    """An aborted unreferenced write leaves nothing; its key must be fresh; put_after
    accepts only committed unreferenced writers."""
    st = _unreferenced(storage)
    w = st.open_unreferenced("unref2/a")
    assert w is not None
    w.write(b"partial")
    w.abort()
    assert storage.head("unref2/a") is None and storage.list("unref2/") == []
    storage.put("unref2/b", b"x")
    with pytest.raises(ObjectExists):
        st.open_unreferenced("unref2/b")
    assert storage.get("unref2/b") == b"x"
    pending = st.open_unreferenced("unref2/c")
    assert pending is not None
    with pytest.raises(TypeError, match="open_unreferenced"):
        st.put_after("unref2/m", b"m", [pending])  # not committed yet
    with pytest.raises(TypeError, match="open_unreferenced"):
        st.put_after("unref2/m", b"m", [storage.open_write("unref2/d")])
    assert storage.head("unref2/m") is None
    pending.abort()


def test_ranges_read_in_order_through_one_handle(storage: Storage) -> None:
    """``open_ranges`` (issue 19, optional :class:`ReadsInOrder`): the exact bytes of
    each range in file order; a range past the end, a missing object and a read after
    close are errors, never a short buffer."""
    from ckrun.errors import StorageError
    from ckrun.storage.base import ReadsInOrder

    if not isinstance(storage, ReadsInOrder):
        pytest.skip(f"{storage!r} reads ranges independently (optional capability)")
    data = os.urandom(3 << 20)
    storage.put("rr/obj.bin", data)
    reader = storage.open_ranges("rr/obj.bin")
    assert reader is not None
    with reader as r:
        for lo, hi in [(0, 10), (10, 1 << 20), ((1 << 20) + 5, (3 << 20) - 1)]:
            buf = bytearray(hi - lo)
            r.read_into(lo, memoryview(buf))
            assert bytes(buf) == data[lo:hi]
        r.read_into(5, memoryview(bytearray(0)))  # empty range: nothing to read
        with pytest.raises(StorageError, match="truncated"):
            r.read_into(len(data) - 10, memoryview(bytearray(20)))
    with pytest.raises(StorageError, match="after close"):
        r.read_into(0, memoryview(bytearray(4)))
    with pytest.raises(ObjectNotFound):
        storage.open_ranges("rr/missing.bin")
