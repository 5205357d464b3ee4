"""What a save fsyncs, and when (issue 19: batched directory fsyncs, same durability).

``os.fsync`` of :mod:`ckrun.storage.local_writer` and of :mod:`ckrun.storage.direct`
(the same function object) is wrapped to record the path of each fsynced descriptor;
the files and directories are real.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import discovery, layout, pipeline
from ckrun.storage import local_writer
from ckrun.storage.base import lazy_delete
from ckrun.storage.local import LocalStorage


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = os.fsync

    def rec(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(local_writer.os, "fsync", rec)  # type: ignore[attr-defined]
    return seen


def _name(p: str, root: Path) -> str:
    rel = os.path.relpath(p, root)
    base = os.path.basename(rel)
    if base.startswith(local_writer.TEMP_PREFIX):  # the temp file: data fsync
        kind = "shard" if base.endswith(".ckpt") else base.rsplit("-", 1)[-1]
        return os.path.join(os.path.dirname(rel), "<tmp>" + kind)
    return rel


def test_new_directories_are_synced_after_the_file(tmp_path: Path, fsynced: list[str]) -> None:
    """The parents of directories a writer creates are fsynced at its commit, after the
    file's data and its rename (one journal commit covers them on ext4), not at open."""
    st = LocalStorage(str(tmp_path), direct=False)
    w = st.open_write("a/b/obj")
    assert fsynced == []  # nothing synced at open: nothing is promised before the commit
    w.write(b"x" * 10)
    w.commit()
    assert [_name(p, tmp_path) for p in fsynced] == ["a/b/<tmp>obj", "a/b", "a", "."]
    assert st.get("a/b/obj") == b"x" * 10


def test_what_a_save_fsyncs_and_when(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synchronous save (issue 19): the shard is written under its final key (never
    renamed, never fsynced alone); then the shard, its directory, the parents of the new
    step directory and the manifest's temp file are fsynced *concurrently* (all five in
    flight at once: a barrier of five parties in the fsync wrapper, which a sequential
    implementation breaks), all done before ``manifest.json`` is linked; after the link
    only the step directory is fsynced, before the save returns; retention's deletes
    come later, off the save's return."""
    events: list[tuple[str, str]] = []
    linked = threading.Event()
    barrier = threading.Barrier(5, timeout=30)  # only a failing run waits this long
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def rec_fsync(fd: int) -> None:
        p = os.readlink(f"/proc/self/fd/{fd}")
        if not linked.is_set():
            barrier.wait()  # BrokenBarrierError: the five were not in flight together
        real_fsync(fd)
        events.append(("fsync", _name(p, tmp_path)))

    def rec_link(src: str, dst: str, **kw: object) -> None:
        real_link(src, dst, **kw)  # type: ignore[arg-type]
        events.append(("link", _name(dst, tmp_path)))
        linked.set()

    def rec_replace(src: str, dst: str, **kw: object) -> None:
        real_replace(src, dst, **kw)  # type: ignore[arg-type]
        events.append(("replace", _name(dst, tmp_path)))

    monkeypatch.setattr(local_writer.os, "fsync", rec_fsync)  # type: ignore[attr-defined]
    monkeypatch.setattr(local_writer.os, "link", rec_link)  # type: ignore[attr-defined]
    monkeypatch.setattr(local_writer.os, "replace", rec_replace)  # type: ignore[attr-defined]
    ck = ckrun.Checkpointer(str(tmp_path), rng=False, lock=False, keep_last=1)
    state = {"w": torch.arange(1000.0)}
    m = ck.save(1, state)
    shard = m.shards[0].key
    step_dir = os.path.dirname(shard)
    man = layout.manifest_key(1)
    assert os.path.dirname(man) == step_dir and shard.endswith(".ckpt")
    before, after = events[:5], events[5:]
    assert sorted(before) == sorted(
        [
            ("fsync", shard),
            ("fsync", step_dir),
            ("fsync", os.path.dirname(step_dir)),
            ("fsync", "."),
            ("fsync", os.path.join(step_dir, "<tmp>" + os.path.basename(man))),
        ]
    ), events
    assert after == [("link", man), ("fsync", step_dir)], events
    ck.close()


def test_a_failed_manifest_leaves_the_shard_unreferenced(tmp_path: Path) -> None:
    """A save whose manifest cannot be created leaves its in-place shard as an orphan
    (no manifest names it: load never sees it), and a later save's retention collects
    it (the commit protocol's crash state after the shard, before the manifest)."""
    st = LocalStorage(str(tmp_path))
    ck = ckrun.Checkpointer(storage=st, rng=False, lock=False, keep_last=1)
    st.put(layout.manifest_key(1), b"{not json")  # corrupt, and made undeletable below
    real_delete = st.delete
    st.delete = lambda keys: None  # type: ignore[method-assign]
    with pytest.raises(ckrun.errors.CheckpointError):
        ck.save(1, {"w": torch.arange(10.0)})
    orphans = [o.key for o in st.list("checkpoints/") if o.key.endswith(".ckpt")]
    assert len(orphans) == 1, orphans
    st.delete = real_delete  # type: ignore[method-assign]
    st.delete([layout.manifest_key(1)])
    ck.save(2, {"w": torch.arange(10.0)})
    ck.close()  # joins the retention pass
    left = [o.key for o in st.list("checkpoints/")]
    assert orphans[0] not in left and len(left) == 2, left


def _page_states(path: Path) -> tuple[int, int]:
    """(dirty, under write-back) pages of ``path`` in the page cache, from Linux's
    ``cachestat(2)`` (syscall 451 on x86-64 and arm64, Linux 6.5+)."""
    import ctypes

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_uint64)
            for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")
        ]

    libc = ctypes.CDLL(None, use_errno=True)
    rng, st = Range(0, 0), Stat()  # len 0: to the end of the file
    fd = os.open(path, os.O_RDONLY)
    try:
        rc = libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(st), 0)
    finally:
        os.close(fd)
    if rc != 0 and ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        pytest.skip("cachestat(2) is not offered here (Linux before 6.5, or a seccomp filter)")
    assert rc == 0, f"cachestat(2) failed: {os.strerror(ctypes.get_errno())}"
    return st.dirty, st.writeback


@pytest.mark.parametrize("behind", [True, False])
def test_an_unreferenced_commit_starts_the_write_back(tmp_path: Path, behind: bool) -> None:
    """An unreferenced writer's commit fsyncs nothing, but hands its pages to the device
    at once (issue 19: the fsync of the manifest's commit then waits for I/O in flight):
    right after the commit none of the file's pages is still only dirty.  A storage that
    does not write behind leaves them to the kernel (the control: the pages are dirty,
    so the check can see the difference)."""

    def committed(behind: bool, key: str) -> int:
        st = LocalStorage(str(tmp_path), direct=False, write_behind=behind)
        w = st.open_unreferenced(key, 4 << 20)
        assert w is not None
        w.write(os.urandom(4 << 20))
        w.commit()
        return _page_states(tmp_path / key)[0]

    if committed(False, "control/shard") == 0:  # tmpfs: no page is ever dirty there
        pytest.skip(f"{tmp_path} keeps no dirty pages (no write-back to start)")
    dirty = committed(behind, "d/shard")
    if behind:
        assert dirty == 0, f"{dirty} pages were not handed to write-back at the commit"
    else:
        assert dirty > 0


def test_a_write_back_error_seen_while_writing_behind_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (``sync_file_range`` replaced for the writer's module): the
    kernel reports a write-back error once per file description, so when the write-behind
    wait sees EIO a later fsync returns 0.  The writer must raise it there, naming the
    file: nothing is committed and no manifest can name the lost data."""
    from ckrun.errors import StorageError

    real = local_writer._sync_file_range
    assert real is not None

    def failing(fd: int, off: int, n: int, flags: int) -> int:
        if flags & local_writer.SFR_WAIT_AFTER:
            import ctypes

            ctypes.set_errno(errno.EIO)
            return -1
        return int(real(fd, off, n, flags))  # type: ignore[operator]

    monkeypatch.setattr(local_writer, "_sync_file_range", failing)
    monkeypatch.setattr(local_writer, "WRITE_BEHIND_BYTES", 1 << 20)
    st = LocalStorage(str(tmp_path), direct=False, write_behind=True)
    w = st.open_unreferenced("d/shard", 8 << 20)
    assert w is not None
    with pytest.raises(StorageError, match="d/shard"):
        for _ in range(8):
            w.write(bytes(1 << 20))
        w.commit()
    w.abort()
    assert st.head("d/shard") is None


def test_a_failed_fsync_of_the_shard_names_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (``os.fsync`` replaced for the storage modules): when the shard's
    fsync fails at the manifest's commit, the error names the shard, not the manifest,
    and no manifest is published."""
    from ckrun.errors import StorageError
    from ckrun.storage import fsutil

    st = LocalStorage(str(tmp_path), direct=False)
    w = st.open_unreferenced("d/shard", 10)
    assert w is not None
    w.write(b"x" * 10)
    w.commit()
    real = os.fsync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/d/shard"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(fsutil.os, "fsync", failing)
    with pytest.raises(StorageError, match="d/shard") as e:
        st.put_after("d/manifest.json", b"{}", [w], if_absent=True)
    assert "manifest" not in str(e.value)
    assert st.head("d/manifest.json") is None


def test_a_child_forked_while_the_fsync_crew_starts_gets_its_own(
    tmp_path: Path,
    fork_call: Callable[[Callable[[], object]], int],
    reap_child: Callable[[int], int | None],
) -> None:
    """``fork`` copies ``_crew_lock`` as it is: held, when another thread was starting
    the fsync crew at that moment (the lock is held here to make that moment
    deterministic).  The child still fsyncs: it starts its own crew under a new lock
    instead of waiting forever for a thread that does not exist in it."""
    from ckrun.storage import fsutil

    fsutil.fsync_paths([str(tmp_path)])  # the parent's crew exists
    with fsutil._crew_lock:
        pid = fork_call(lambda: fsutil.fsync_paths([str(tmp_path)]))
    code = reap_child(pid)
    assert code is not None, "the forked child hung on the copied lock of the fsync crew"
    assert code == 0


def test_a_retention_pass_flushes_nothing_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 (small saves every few steps): each retention pass fsynced the step
    directory after the manifest's unlink and the area after the shard's unlink and the
    ``rmdir``: two journal commits and two device cache flushes per save beside the
    save's own two.  On the loop-device disk they made the next saves wait (bench/README.md,
    "Twentieth session").  The pass now fsyncs nothing: its deletes are visible at once
    and ride on the next save's flush.  The next save still makes exactly its own five
    concurrent fsyncs and the step directory's (test above)."""
    by_thread: list[tuple[str, str]] = []
    real = os.fsync

    def rec(fd: int) -> None:
        p = os.readlink(f"/proc/self/fd/{fd}")
        by_thread.append((threading.current_thread().name, _name(p, tmp_path)))
        real(fd)

    monkeypatch.setattr(local_writer.os, "fsync", rec)  # type: ignore[attr-defined]
    ck = ckrun.Checkpointer(str(tmp_path), rng=False, lock=False, keep_last=1)
    state = {"w": torch.arange(1000.0)}
    m1 = ck.save(1, state)
    ck.save(2, state)  # its pass deletes step 1 on the retention thread
    pipeline.wait_retention(ck._ctx)
    retention_fsyncs = [p for t, p in by_thread if t.startswith("ckrun-retention")]
    assert retention_fsyncs == [], retention_fsyncs
    assert not (tmp_path / layout.manifest_key(1)).exists()
    assert not (tmp_path / m1.shards[0].key).parent.exists()  # its directory went too
    assert [m.step for m in discovery.committed(ck.storage)] == [2]
    ck.close()


def test_delete_is_durable_on_return_and_delete_lazily_flushes_nothing(
    tmp_path: Path, fsynced: list[str]
) -> None:
    """``delete`` keeps the storage contract's durable delete (a withdrawn manifest):
    the first directory left standing is fsynced.  ``delete_lazily`` removes the same
    files and empty directories, never the root, and fsyncs nothing (retention's
    delete, through ``lazy_delete``; the two-tier storage's retire too).  A subclass
    that overrides ``delete`` keeps seeing every delete."""
    st = LocalStorage(str(tmp_path), direct=False)
    for k in ("a/b/x", "a/b/y", "c/z"):
        st.put(k, b"1")
    fsynced.clear()
    st.delete(["a/b/x", "a/b/y", "missing/key"])
    assert [_name(p, tmp_path) for p in fsynced] == ["."]  # a/b and a removed, root kept
    assert not (tmp_path / "a").exists() and (tmp_path / "c" / "z").exists()
    fsynced.clear()
    st.delete_lazily(["c/z"])
    assert fsynced == [] and not (tmp_path / "c").exists() and tmp_path.is_dir()
    assert lazy_delete(st) == st.delete_lazily

    class Audited(LocalStorage):  # overrides delete: its override sees lazy deletes too
        seen: list[str] = []

        def delete(self, keys: Iterable[str]) -> None:
            keys = list(keys)
            self.seen += keys
            super().delete(keys)

    au = Audited(str(tmp_path))
    au.put("d/k", b"1")
    au.delete_lazily(["d/k"])
    assert au.seen == ["d/k"] and not (tmp_path / "d").exists()

    class Plain:  # a storage without the capability (S3): its own delete
        def delete(self, keys: object) -> None: ...

    plain = Plain()
    assert lazy_delete(plain) == plain.delete  # type: ignore[arg-type]
