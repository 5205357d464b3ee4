"""What the background persist takes from training (issue 19): the host arena on huge
pages (fewer, larger O_DIRECT requests), every shard byte hashed once, the persist's
threads at SCHED_IDLE and raised back to the normal policy when someone waits for them.
Real threads, real files on the local disk; the kernel's own view (``/proc/self/smaps``,
``sched_getscheduler``) is what the tests assert, never a timing."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckrun
import crc32c
import pytest
import torch
from ckpt_helpers import make_state, params_equal
from ckrun.checkpoint import crc_beside, pipeline, sharding, st_format
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.host_buffers import HostBuffers
from ckrun.errors import ConfigError
from ckrun.storage import priority
from ckrun.storage.direct import ArenaWriter
from ckrun.storage.hugepages import HUGE_PAGE, advised_in_smaps
from ckrun.storage.local import LocalStorage

IDLE_OK = hasattr(os, "SCHED_IDLE") and priority.can_leave_idle(priority.PERSIST_NICE)


def _thp_available() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_arena_is_huge_page_aligned_and_advised() -> None:
    hb = HostBuffers()
    hb.stage(fmt.snapshot({"w": torch.ones(3 << 20), "b": torch.arange(5)}))  # 12 MiB
    assert hb.data_ptr() % HUGE_PAGE == 0
    if not _thp_available():
        pytest.skip("transparent huge pages are off on this kernel")
    assert hb.hugepages
    assert advised_in_smaps(hb.data_ptr()) is True  # VmFlags "hg": MADV_HUGEPAGE in force


def test_each_shard_byte_is_hashed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed = [0]
    real = crc32c.crc32c
    counting = threading.Lock()  # a big entry is hashed on crc_beside's thread

    class Counting:
        @staticmethod
        def crc32c(buf: Any, value: int = 0) -> int:
            with counting:
                hashed[0] += memoryview(buf).nbytes
            return real(buf, value)

    monkeypatch.setattr(st_format, "crc32c", Counting)
    monkeypatch.setattr(crc_beside, "crc32c", Counting)
    big = torch.randn(1 << 20)  # 4 MiB: hashed once, combined into the file's CRC
    tree = {"big": big, "odd": torch.randn(300_001), "small": torch.arange(7), "n": 3}
    snap = fmt.snapshot(tree)
    st = LocalStorage(str(tmp_path))
    w = st.open_write("s.ckpt")
    out = st_format.write(w, snap.tree, snap.tensors, sharding.tensor_paths(snap.tree))
    w.commit()
    data = (tmp_path / "s.ckpt").read_bytes()
    small = sum(
        fmt.nbytes(t) for t in snap.tensors if fmt.nbytes(t) < st_format.REHASH_BELOW
    )  # below the threshold a second pass costs less than a combine
    assert hashed[0] == len(data) + small
    assert out.checksum == f"crc32c:{real(data):08x}" and out.size_bytes == len(data)
    for begin, end, crc in out.entries.values():
        assert crc == f"crc32c:{real(data[begin:end]):08x}"


def _watch_persist(monkeypatch: pytest.MonkeyPatch, gate: threading.Event | None) -> list[Any]:
    """Record (worker tid, its policy) as each persist starts, and the I/O thread's policy
    at each O_DIRECT request; hold the persist at ``gate`` when given."""
    seen: list[Any] = []
    persist, pwrite = pipeline.persist, ArenaWriter._pwrite

    def watched(*a: Any, **k: Any) -> Any:
        tid = threading.get_native_id()
        seen.append(("worker", tid, os.sched_getscheduler(0)))
        if gate is not None:
            assert gate.wait(60)
        return persist(*a, **k)

    def io(self: ArenaWriter, mv: memoryview, off: int) -> None:
        seen.append(("io", threading.get_native_id(), os.sched_getscheduler(0)))
        pwrite(self, mv, off)

    monkeypatch.setattr(pipeline, "persist", watched)
    monkeypatch.setattr(ArenaWriter, "_pwrite", io)
    return seen


def _held_idle_persist(
    monkeypatch: pytest.MonkeyPatch, bound_s: str
) -> tuple[threading.Event, list[Any]]:
    """The default (idle) persist with lag bound ``bound_s``, held until the gate is set."""
    monkeypatch.delenv("CKRUN_PERSIST_SCHED", raising=False)
    monkeypatch.setenv("CKRUN_PERSIST_IDLE_S", bound_s)
    gate = threading.Event()
    return gate, _watch_persist(monkeypatch, gate)


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_persist_threads_run_at_sched_idle(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKRUN_PERSIST_SCHED", raising=False)
    seen = _watch_persist(monkeypatch, None)
    s = make_state(3)
    with ckrun.Checkpointer(storage=str(run_dir)) as ck:
        h = ck.async_save(5, s)
        _until(h.done, "the persist committed")  # polled: result() would raise it
        assert h.result().step == 5
        assert ck._async is not None and ck._async.policy == "idle"
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training thread is untouched
    kinds = {k for k, _, _ in seen}
    assert kinds == {"worker", "io"}  # the zero-copy writer ran
    assert all(p == os.SCHED_IDLE for _, _, p in seen), seen
    fresh = make_state(9)
    with ckrun.Checkpointer(storage=str(run_dir)) as ck2:
        assert ck2.load(fresh).step == 5
    assert params_equal(s, fresh)


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_a_waiter_raises_the_persist_thread(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKRUN_PERSIST_SCHED", raising=False)
    gate = threading.Event()
    seen = _watch_persist(monkeypatch, gate)
    with ckrun.Checkpointer(storage=str(run_dir)) as ck:
        h = ck.async_save(1, make_state(1))
        _until(lambda: bool(seen), "the persist started")
        tid = seen[0][1]
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        waiter = threading.Thread(target=h.result, args=(60,))
        waiter.start()
        _until(lambda: os.sched_getscheduler(tid) == os.SCHED_OTHER, "raised by the waiter")
        assert os.getpriority(os.PRIO_PROCESS, tid) >= priority.PERSIST_NICE  # nice kept
        gate.set()
        waiter.join(60)
        assert h.done() and h.result().step == 1
        gate.set()
        h2 = ck.async_save(2, make_state(2))
        _until(h2.done, "the second persist committed")  # it lowered itself again
        assert h2.result().step == 2
    assert seen[-1][0] == "io" and seen[-1][2] == os.SCHED_IDLE


def _until(cond: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Wait for another thread's progress (bounded; an event we cannot hook)."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting: {what}"
        time.sleep(0.005)


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_inherited_io_threads_are_registered_and_raised() -> None:
    out: dict[str, Any] = {}

    def worker() -> None:
        out["policy"] = priority.lower(12)
        out["tid"] = threading.get_native_id()
        with priority.inheriting_pool(1, "ckrun-test-io") as io:
            out["io"] = io.submit(threading.get_native_id).result()
            out["io policy"] = io.submit(os.sched_getscheduler, 0).result()
            out["registered"] = priority.registered()
            out["raised"] = priority.raise_waited()
            out["after"] = io.submit(os.sched_getscheduler, 0).result()
            out["nice"] = io.submit(os.getpriority, os.PRIO_PROCESS, 0).result()

        out["again"] = priority.lower(12)
        out["other"] = priority.lower(12, idle=False)  # an idle thread is moved back

    t = threading.Thread(target=worker)
    t.start()
    t.join(30)
    assert out["again"] == "idle" and out["other"] == "other nice 12"
    assert out["policy"] == "idle" and out["io policy"] == os.SCHED_IDLE
    assert {out["tid"], out["io"]} <= out["registered"]
    assert out["raised"] >= 2 and out["after"] == os.SCHED_OTHER and out["nice"] == 12


def test_persist_sched_other_and_bad_value(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKRUN_PERSIST_SCHED", "other")
    seen = _watch_persist(monkeypatch, None)
    with ckrun.Checkpointer(storage=str(run_dir)) as ck:
        ck.async_save(1, make_state(1)).result(60)
        assert ck._async is not None and ck._async.policy == "other nice 10"
    assert all(p == os.SCHED_OTHER for _, _, p in seen)
    monkeypatch.setenv("CKRUN_PERSIST_SCHED", "fifo")
    with ckrun.Checkpointer(storage=str(run_dir / "b")) as ck, pytest.raises(ConfigError) as e:
        ck.async_save(1, make_state(1))
    assert "CKRUN_PERSIST_SCHED" in str(e.value)


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_an_idle_persist_nobody_waits_for_is_raised_after_the_lag_bound(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SCHED_IDLE may starve a persist for as long as the cores stay busy; a hard kill
    then loses every step since the previous commit.  The lag bound
    (``CKRUN_PERSIST_IDLE_S``) raises the persist to the normal policy on its own, with
    nobody waiting, so the durability lag of an async save stays bounded."""
    gate, seen = _held_idle_persist(monkeypatch, "0.3")
    with ckrun.Checkpointer(storage=str(run_dir)) as ck:
        h = ck.async_save(1, make_state(1))
        _until(lambda: bool(seen), "the persist started")
        tid = seen[0][1]
        _until(lambda: os.sched_getscheduler(tid) == os.SCHED_OTHER, "raised by the bound", 20)
        assert not h.done()  # nobody waited: the bound alone raised it
        assert os.getpriority(os.PRIO_PROCESS, tid) >= priority.PERSIST_NICE  # nice kept
        gate.set()
        _until(h.done, "the persist committed")
        assert h.result().step == 1


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_the_lag_bound_itself_never_runs_idle(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound's timer was started by the persist after it had lowered itself, and a
    thread inherits its creator's policy: the timer ran at SCHED_IDLE, so with the cores
    busy, when the bound matters, it would not fire.  It runs at the normal policy."""
    gate, seen = _held_idle_persist(monkeypatch, "60")
    with ckrun.Checkpointer(storage=str(run_dir)) as ck:
        h = ck.async_save(1, make_state(1))
        try:
            _until(lambda: bool(seen), "the persist started")
            assert seen[0][2] == os.SCHED_IDLE  # the persist itself runs idle
            timers = [t for t in threading.enumerate() if t.name == "ckrun-persist-lag-bound"]
            assert len(timers) == 1 and timers[0].native_id is not None
            assert os.sched_getscheduler(timers[0].native_id) == os.SCHED_OTHER
        finally:
            gate.set()
        assert h.result(60).step == 1
    timers[0].join(10)
    assert not timers[0].is_alive()  # cancelled when the persist ended


def test_the_lag_bound_rejects_a_bad_value(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKRUN_PERSIST_IDLE_S", "-1")
    with ckrun.Checkpointer(storage=str(run_dir)) as ck, pytest.raises(ConfigError) as e:
        ck.async_save(1, make_state(1))
    assert "CKRUN_PERSIST_IDLE_S" in str(e.value)


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_shared_pools_started_by_an_idle_persist_do_not_stay_idle(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process-wide fsync pool is started by whichever thread fsyncs first; started
    by a SCHED_IDLE persist, its threads inherited SCHED_IDLE for good, and every later
    synchronous save's fsyncs ran on them (the training thread waiting on threads that
    only run on idle cores).  They leave SCHED_IDLE as they start."""
    from ckrun.storage import fsutil

    monkeypatch.setattr(fsutil, "_crew", None)  # a fresh crew, started below
    f = tmp_path / "f"
    f.write_bytes(b"x")
    out: dict[str, Any] = {}

    def persist() -> None:
        out["policy"] = priority.lower(12)
        fsutil.fsync_paths([str(f), str(tmp_path)])  # starts the shared crew from here
        crew = fsutil._sync_crew()
        assert crew.threads and all(t.native_id for t in crew.threads)
        out["crew"] = {os.sched_getscheduler(t.native_id or 0) for t in crew.threads}

    t = threading.Thread(target=persist)
    t.start()
    t.join(30)
    assert out["policy"] == "idle"
    assert out["crew"] == {os.SCHED_OTHER}


def test_small_entries_are_gathered_into_few_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's many small tensors (here 600 of 1-16 KiB, as a 50-layer MLP's biases,
    norms and weights) reach the file in one ``write(2)`` per ``GATHER_BYTES`` (issue
    19, small states), not one each; a write of ``GATHER_BELOW`` or more goes to the
    file from the tensor itself.  The file is the same: every entry and the whole file
    verify against their CRC32C."""
    from ckrun.storage import local_writer

    tree: dict[str, Any] = {f"p{i}": torch.randn(256 * (1 + i % 16)) for i in range(600)}
    tree["big"] = torch.randn(1 << 19)  # 2 MiB
    snap = fmt.snapshot(tree)
    st = LocalStorage(str(tmp_path), direct=False)
    w = st.open_write("s.ckpt")
    sizes: list[int] = []
    real_write = os.write

    def counted(fd: int, data: Any) -> int:
        sizes.append(memoryview(data).nbytes)
        return real_write(fd, data)

    monkeypatch.setattr(local_writer.os, "write", counted)
    out = st_format.write(w, snap.tree, snap.tensors, sharding.tensor_paths(snap.tree))
    w.commit()
    monkeypatch.undo()
    data = (tmp_path / "s.ckpt").read_bytes()
    small = sum(fmt.nbytes(t) for t in snap.tensors if fmt.nbytes(t) < local_writer.GATHER_BELOW)
    assert small > 4 * local_writer.GATHER_BYTES
    assert len(sizes) <= small // local_writer.GATHER_BYTES + 3  # + the big entry, the tail
    assert (1 << 21) in sizes  # the big entry, straight from its tensor
    assert sum(sizes) == len(data)
    assert out.checksum == f"crc32c:{crc32c.crc32c(data):08x}" and out.size_bytes == len(data)
    for begin, end, crc in out.entries.values():
        assert crc == f"crc32c:{crc32c.crc32c(data[begin:end]):08x}"
