"""The checkpoint writer lock ``locks/writer.lock`` (filelock, ``flock(2)``).

One process writes checkpoints of a run at a time.  The holder's host, pid, attempt and
start time go to ``locks/writer.holder.json`` right after the lock is taken, so a second
writer gets :class:`ckrun.errors.RunLocked` naming the holder.  The OS releases the lock
when the holder dies (even by SIGKILL), so a stale holder file never blocks a new one.
Non-local storage (S3) has no lock file; there the supervisor's lock is the guard.

A ``flock`` is shared by every descriptor copied by ``fork``: a process forked by the
holder (a DataLoader worker, a helper) keeps the lock after the holder died.  Such a
lock whose recorded holder is a dead process of this host is stale: :func:`take_over`
breaks it (a new lock file replaces the old one, with a log line) instead of refusing
every later start with "being written by another process".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import weakref
from typing import Any

from ckrun.checkpoint import layout
from ckrun.checkpoint.manifest import utc_now
from ckrun.errors import RunLocked, StorageError
from ckrun.storage.base import Storage
from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

# run identity (lock path, or storage URL without one) -> the WriterLock holding it in
# this process, so a second Checkpointer on one run is told about the first one.
_HELD: dict[str, tuple[weakref.ref[WriterLock], str]] = {}
_HELD_LOCK = threading.Lock()


def holder_dead(holder: dict[str, Any]) -> bool:
    """True when ``holder`` (``host``, ``pid``) names a process of this host that is gone."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def take_over(path: str, holder: dict[str, Any], what: str) -> FileLock | None:
    """Break the stale lock ``path`` whose recorded ``holder`` is dead and take it.

    Returns:
        The held new lock, or None when the holder is alive (or the new lock is taken
        by someone else first).
    """
    if not holder_dead(holder):
        return None
    log.warning(
        "%s: holder pid %s on %s is dead but the lock is still held (by a process it "
        "forked); taking it over",
        what,
        holder.get("pid"),
        holder.get("host"),
    )
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    lock = FileLock(path, timeout=0, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock


class WriterLock:
    """Exclusive writer lock on a run root.

    Within one process, a second lock object on the same run (a second ``Checkpointer``)
    is refused by name before the file lock is tried: the message names where the first
    one was created (``owner``), not "another process".  This holds on every storage,
    S3 included.

    Args:
        storage: the run root.
        run: run id (for messages).
        attempt: this process's attempt number.
        owner: who holds this lock, for messages (e.g. ``Checkpointer created at
            train.py:42``).
    """

    def __init__(self, storage: Storage, *, run: str, attempt: int, owner: str = ""):
        self._storage = storage
        self._run = run
        self._attempt = attempt
        self._owner = owner or "a Checkpointer"
        path = storage.local_path(layout.WRITER_LOCK)
        self._ident = path or storage.url.rstrip("/")
        self._lock: FileLock | None = None
        if path is not None:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._lock = FileLock(path, timeout=0, thread_local=False)

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._lock is not None and self._lock.is_locked

    def _claim(self) -> None:
        """Register this lock as the process's writer of the run.

        Raises:
            RunLocked: another live lock object of this process holds the run.
        """
        with _HELD_LOCK:
            ref, owner = _HELD.get(self._ident, (None, ""))
            other = ref() if ref is not None else None
            if other is not None and other is not self:
                raise RunLocked(
                    f"run {self._run!r} at {self._storage.url} is already open for writing "
                    f"in this process by {owner}; close() that Checkpointer (or use it in a "
                    "`with` block) before creating another one, or reuse it",
                    holder={"pid": os.getpid(), "owner": owner},
                )
            _HELD[self._ident] = (weakref.ref(self), self._owner)

    def acquire(self) -> None:
        """Take the lock (no waiting) and record the holder.

        Raises:
            RunLocked: another live process holds it; the message names host, pid and
                attempt from the holder file.
        """
        self._claim()
        if self._lock is None or self._lock.is_locked:
            return
        try:
            self._lock.acquire(timeout=0)
        except Timeout as e:
            self._unclaim()
            holder = self.holder()
            path = self._storage.local_path(layout.WRITER_LOCK)
            stale = take_over(path, holder, f"run {self._run!r} writer lock") if path else None
            if stale is not None:
                self._lock = stale
                return self._record()
            who = (
                ", ".join(
                    f"{k} {holder[k]}" for k in ("host", "pid", "attempt", "since") if k in holder
                )
                or "holder unknown"
            )
            raise RunLocked(
                f"run {self._run!r} at {self._storage.url} is being written by another "
                f"process ({who}); stop that process or use another run directory",
                holder=holder,
            ) from e
        self._record()

    def _record(self) -> None:
        assert self._lock is not None
        body = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "attempt": self._attempt,
            "run": self._run,
            "since": utc_now(),
        }
        try:
            self._storage.put(layout.WRITER_HOLDER, json.dumps(body).encode())
        except StorageError:
            self._lock.release()
            self._unclaim()
            raise

    def holder(self) -> dict[str, Any]:
        """The recorded holder (``host``, ``pid``, ``attempt``, ``since``), or ``{}``."""
        try:
            body = json.loads(self._storage.get(layout.WRITER_HOLDER))
        except (StorageError, ValueError):
            return {}
        return body if isinstance(body, dict) else {}

    def _unclaim(self) -> None:
        with _HELD_LOCK:
            ref, _ = _HELD.get(self._ident, (None, ""))
            if ref is not None and ref() in (self, None):
                del _HELD[self._ident]

    def release(self) -> None:
        """Release the lock (idempotent)."""
        self._unclaim()
        if self._lock is not None and self._lock.is_locked:
            self._lock.release(force=True)
