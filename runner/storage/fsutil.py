"""Small durable-file helpers shared by the supervisor and the training-side library:
an atomic JSON write, pieces written to a file (atomically or under a temp name),
directory and path fsyncs (one at a time or concurrently, batched by the filesystem
journal), and directory creation whose new entries are made durable.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import tempfile
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from ckrun.errors import map_os_error
from ckrun.storage import priority

__all__ = [
    "SYNC_THREADS",
    "fsync_dir",
    "fsync_path",
    "fsync_paths",
    "make_dirs",
    "write_json_atomic",
    "write_pieces",
    "write_pieces_atomic",
]


def write_json_atomic(path: str, body: dict[str, Any], *, durable: bool = True) -> None:
    """Write ``body`` to ``path`` via a temp file, (fsync) and ``os.replace``.

    Args:
        durable: fsync the file before the rename (skip for records that only matter
            while this process lives, such as the lock holder).
    """
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_pieces(path: str, pieces: Iterable[bytes | memoryview]) -> None:
    """Create ``path`` from ``pieces`` written in order, then fsync it (not atomic: for a
    temporary name that a rename publishes)."""
    with open(path, "wb") as f:
        for part in pieces:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


def write_pieces_atomic(path: str, pieces: Iterable[bytes | memoryview]) -> None:
    """Write ``pieces`` to ``path`` atomically: a temp file in the same directory, fsync,
    ``os.replace``, fsync of the directory.  An exception from ``pieces`` (a failed
    checksum, say) removes the temp file and leaves ``path`` as it was."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckrun-restore-", dir=d)
    os.close(fd)
    try:
        write_pieces(tmp, pieces)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` so its new entries (a rename, a new file) survive a
    power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SFR_WAIT_BEFORE = 1  # sync_file_range(2) flags
SFR_WRITE = 2
SFR_WAIT_AFTER = 4


def _load_sync_file_range() -> object | None:
    """``sync_file_range`` from libc via ctypes (releases the GIL), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


#: ``sync_file_range(fd, offset, nbytes, flags)`` (returns 0 or -1 with ``errno`` set,
#: ``ctypes.get_errno``), or None where libc has none
sync_file_range = _load_sync_file_range()


def fsync_path(path: str) -> None:
    """fsync the file or directory ``path`` (through a read-only descriptor: fsync
    flushes the inode's dirty pages and metadata whatever descriptor wrote them)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:  # name the file whose data was lost, not the caller's
        raise OSError(e.errno, e.strerror, path) from e
    finally:
        os.close(fd)


SYNC_THREADS = 4  # fsyncs issued at once by fsync_paths (a shard, its directories)


class _Job:
    """One fsync handed to the crew: its path, a lock held until it is done, and the
    error it raised (None: durable)."""

    __slots__ = ("done", "error", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()


class _Crew:
    """The kept fsync threads of one process: ``SYNC_THREADS`` daemon threads taking
    :class:`_Job` s from one queue.  A hand-off is a queue put and a lock release, a
    fraction of a ``ThreadPoolExecutor.submit`` and its ``Future`` (issue 19, small
    states: three hand-offs per save; bench/README.md, "Thirteenth session").  Daemon
    threads: a caller always waits for its jobs, so none is left at exit unless the
    caller was interrupted, and then no name was published after them."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._work, name=f"ckrun-fsync_{i}", daemon=True)
            for i in range(SYNC_THREADS)
        ]
        self._ready = threading.Semaphore(0)
        for t in self.threads:
            t.start()
        for _ in self.threads:  # each has left SCHED_IDLE before its first job
            self._ready.acquire()

    def _work(self) -> None:
        # started by whichever thread fsyncs first: a SCHED_IDLE persist's threads would
        # leave the crew at SCHED_IDLE for good, and synchronous saves wait on it
        priority.normal_policy()
        self._ready.release()
        while True:
            job = self.queue.get()
            try:
                fsync_path(job.path)
            except BaseException as e:  # handed to the waiting caller, who raises it
                job.error = e
            finally:
                job.done.release()


_crew: _Crew | None = None
_crew_lock = threading.Lock()


def _forget_crew_in_child() -> None:
    """After ``fork``: the parent's crew threads do not exist here, and ``_crew_lock``
    may have been copied held (another thread was starting the crew), so both are new."""
    global _crew, _crew_lock
    _crew, _crew_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_crew_in_child)


def _sync_crew() -> _Crew:
    """The fsync crew of this process, started on first use (a forked child starts its
    own: :func:`_forget_crew_in_child`)."""
    global _crew
    with _crew_lock:
        if _crew is None:
            _crew = _Crew()
        return _crew


def fsync_paths(paths: Sequence[str], also: int | None = None) -> None:
    """fsync every path in ``paths`` and the descriptor ``also`` concurrently; returns
    once all are durable.  Independent fsyncs in flight together are batched by the
    filesystem journal (ext4/xfs: one commit and one cache flush instead of one each;
    measured in bench/README.md, "Small saves"); use it only for durability points no
    ordering is required between.

    Raises:
        OSError: the first fsync that failed (every one is waited for first).
    """
    crew = _sync_crew()
    jobs = [_Job(p) for p in paths]
    for job in jobs:
        crew.queue.put(job)
    err: BaseException | None = None
    if also is not None:
        try:
            os.fsync(also)
        except OSError as e:
            err = e
    for job in jobs:
        job.done.acquire()
        err = err or job.error
    if err is not None:
        raise err


def make_dirs(root: str, d: str, *, sync: bool = True) -> list[str]:
    """Create ``d`` (under ``root``); returns the parents of the new entries, deepest
    first, and fsyncs them now unless ``sync`` is False (then the caller must fsync them
    before relying on ``d``: :meth:`ckrun.storage.local_writer.LocalWriter.commit` does,
    after the file's own fsync, so one journal commit covers the new directories and the
    file on ext4).

    Raises:
        StorageError: a directory cannot be created or synced.
    """
    created: list[str] = []  # parents of the directories made, shallowest first
    if not os.path.isdir(d):  # an existing directory costs one stat
        _make_dir(root, d, created)
    parents = created[::-1]
    if sync:
        for p in parents:
            fsync_dir(p)
    return parents


def _make_dir(root: str, d: str, created: list[str]) -> None:
    """``mkdir`` of the missing directory ``d``, first its missing parents up to
    ``root`` (which exists: the storage made it); the parent of each directory made is
    appended to ``created``.  The parents are looked at only when the ``mkdir`` says one
    is missing: a save's new step directory costs one ``mkdir`` after
    :func:`make_dirs`'s ``stat``.

    Raises:
        StorageError: a directory cannot be created (or exists as a non-directory).
    """
    if d == root:
        return
    try:
        made = _mkdir(d)
    except FileNotFoundError as e:
        parent = os.path.dirname(d)
        if parent == d:
            raise map_os_error(e, path=d) from e
        _make_dir(root, parent, created)
        try:
            made = _mkdir(d)  # once more, now under its parent
        except FileNotFoundError as e2:
            raise map_os_error(e2, path=d) from e2
    if made:
        created.append(os.path.dirname(d))


def _mkdir(d: str) -> bool:
    """``mkdir(d)``; False when ``d`` is already a directory (another writer made it).

    Raises:
        FileNotFoundError: a parent is missing (unmapped: the caller makes it).
        StorageError: any other failure, or ``d`` exists as a non-directory.
    """
    try:
        os.mkdir(d)
    except FileExistsError as e:
        if os.path.isdir(d):
            return False
        raise map_os_error(e, path=d) from e
    except FileNotFoundError:
        raise
    except OSError as e:
        raise map_os_error(e, path=d) from e
    return True
