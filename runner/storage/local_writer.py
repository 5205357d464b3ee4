"""The durable local file write under every :class:`~ckrun.storage.local.LocalStorage`
object: temp file in the destination directory, fsync, ``os.replace`` (or ``link(2)`` for
a conditional create), directory fsync (see :mod:`ckrun.storage.local` for the contract).

An *unreferenced* writer (``in_place=True``, issue 19) writes straight under its final,
attempt-unique key (``O_EXCL``, no temp name, no rename) and its commit leaves the file
complete but not yet durable: the paths to fsync are in :attr:`LocalWriter.unsynced`,
and a later commit given them as ``after`` fsyncs them concurrently with its own data
(independent durability points: the journal batches them into one commit) before it
publishes its own name.

:class:`LocalWriter` is the buffered writer; the ``O_DIRECT`` writers of
:mod:`ckrun.storage.direct` subclass it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import time
from collections.abc import Sequence
from typing import Protocol

from ckrun.errors import ObjectExists, PreconditionFailed, StorageError, map_os_error
from ckrun.storage.base import ObjectInfo, validate_key
from ckrun.storage.fsutil import (
    SFR_WAIT_AFTER,
    SFR_WAIT_BEFORE,
    SFR_WRITE,
    fsync_dir,
    fsync_paths,
    make_dirs,
    sync_file_range,
)
from ckrun.storage.version_token import read_versioned, token, version_of

__all__ = [
    "TEMP_PREFIX",
    "WRITE_BEHIND_BYTES",
    "DirectUnsupported",
    "LocalRoot",
    "LocalWriter",
    "fsync_dir",
    "fsync_paths",
    "make_dirs",
    "object_path",
    "read_versioned",
    "version_of",
]

TEMP_PREFIX = ".ckrun-tmp-"
WRITE_BEHIND_BYTES = 32 * 1024 * 1024
#: Writes smaller than this (bytes) are gathered, up to :data:`GATHER_BYTES`, into one
#: ``write(2)``: a shard of a model's many small tensors (a 50-layer MLP's 800 entries
#: of 0.25-16 KiB) costs one system call per MiB instead of one per entry (issue 19).
GATHER_BELOW = 64 << 10
GATHER_BYTES = 1 << 20
_MAX_WRITE = 1 << 30  # Linux writes at most 0x7ffff000 bytes per call
_sync_file_range = sync_file_range  # None where libc has none


class DirectUnsupported(StorageError):
    """The filesystem refused ``O_DIRECT`` (e.g. tmpfs); the caller falls back."""


class LocalRoot(Protocol):
    """What a :class:`LocalWriter` needs of its storage: the root directory and URL."""

    @property
    def root(self) -> str: ...

    @property
    def url(self) -> str: ...


def object_path(root: str, key: str) -> str:
    """The file of ``key`` under ``root``.

    Raises:
        InvalidKey: ``key`` is not a valid storage key.
    """
    return os.path.join(root, *validate_key(key).split("/"))


class LocalWriter:
    """A streaming write to one key; see :class:`ckrun.storage.base.ObjectWriter`.

    Args:
        in_place: an unreferenced object (module docstring): written under ``key``
            itself, created with ``O_EXCL``; :meth:`commit` closes it without an fsync
            and sets :attr:`unsynced`.  Only for attempt-unique keys that no reader opens
            until a later, durable object names them (a shard before its manifest).
        versioned: hash the bytes as they are written (SHA-256), so a conditional
            commit's version token (:func:`version_of`) needs no read-back; for small
            objects (``put``), not for shards.

    Attributes:
        key: the destination key.
        bytes_written: bytes written so far.
        unsynced: after an in-place commit, the paths that must be fsynced before an
            object naming this one is published (the file, its directory, the parents
            of directories it created); empty otherwise.
    """

    def __init__(
        self,
        storage: LocalRoot,
        key: str,
        *,
        write_behind: bool = True,
        extra_flags: int = 0,
        in_place: bool = False,
        versioned: bool = False,
    ):
        self.key = key
        self._sha = hashlib.sha256() if versioned else None
        self._storage = storage
        self._final = object_path(storage.root, key)
        d = os.path.dirname(self._final)
        # new directories are made durable at the commit, after the file (issue 19)
        self._new_dir_parents = make_dirs(storage.root, d, sync=False)
        self._in_place = in_place
        self._committed = False
        self.unsynced: list[str] = []
        if in_place:
            self._tmp = self._final
        else:
            name = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{os.path.basename(key)}"
            self._tmp = os.path.join(d, name)
        try:
            self._fd: int | None = os.open(
                self._tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | extra_flags,
                0o644,
            )
        except OSError as e:
            if extra_flags and e.errno == errno.EINVAL:
                raise DirectUnsupported(f"{d} does not support O_DIRECT") from e
            if in_place and e.errno == errno.EEXIST:
                raise ObjectExists(
                    f"{key} already exists in {storage.url}: an unreferenced object is "
                    "written only under a fresh (attempt-unique) key"
                ) from e
            raise map_os_error(e, path=self._final) from e
        self.bytes_written = 0
        self._gathered = bytearray()  # small writes not yet written (GATHER_BELOW)
        self._on_fd = 0  # bytes written to the file itself
        self._behind = write_behind and _sync_file_range is not None
        self._flushed = 0  # bytes handed to sync_file_range(WRITE)
        self._waited = 0  # bytes known written back

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data`` (any size); returns ``len(data)`` in bytes.  A write under
        :data:`GATHER_BELOW` bytes may reach the file only at the next larger write or
        at the commit.

        Raises:
            StorageFull: ENOSPC/EDQUOT, naming the key and the bytes of this write.
            StorageError: any other I/O error.
        """
        if self._fd is None:
            raise StorageError(f"write to {self.key} after commit/abort")
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self._sha is not None:
            self._sha.update(mv)
        self.bytes_written += n
        if n < GATHER_BELOW:
            self._gathered += mv
            if len(self._gathered) >= GATHER_BYTES:
                self._drain()
            return n
        self._drain()
        self._write_out(mv)
        return n

    def _drain(self) -> None:
        """Write the gathered small writes out.  The next ones gather into a new
        buffer: a ``bytearray`` cannot grow while a memoryview of it exists."""
        if self._gathered:
            buf, self._gathered = self._gathered, bytearray()
            self._write_out(memoryview(buf))

    def _write_out(self, mv: memoryview) -> None:
        """``write(2)`` all of ``mv`` to the file, starting write-back per window.

        Raises:
            StorageFull, StorageError: as :meth:`write`.
        """
        assert self._fd is not None
        step = WRITE_BEHIND_BYTES if self._behind else _MAX_WRITE
        done, n = 0, len(mv)
        try:
            while done < n:
                k = os.write(self._fd, mv[done : done + step])
                done += k
                self._on_fd += k
                if self._behind and self._on_fd - self._flushed >= WRITE_BEHIND_BYTES:
                    self._write_behind()
        except OSError as e:
            raise map_os_error(e, path=self._final, nbytes=n) from e

    def _write_behind(self) -> None:
        """Start write-back of the new window; wait for the one before the previous.

        Raises:
            OSError: the wait reported a write-back error (EIO, ENOSPC).  It must be
                raised here: the kernel reports a write-back error once per file
                description, so a later fsync through this or a new descriptor would
                return 0 and a manifest would name data that never reached the disk.
        """
        assert self._fd is not None and _sync_file_range is not None
        fn = _sync_file_range
        start, end = self._flushed, self._on_fd
        fn(self._fd, start, end - start, SFR_WRITE)  # type: ignore[operator]
        if start - self._waited >= WRITE_BEHIND_BYTES:
            w0, w1 = self._waited, start
            flags = SFR_WAIT_BEFORE | SFR_WRITE | SFR_WAIT_AFTER
            if fn(self._fd, w0, w1 - w0, flags) != 0:  # type: ignore[operator]
                e = ctypes.get_errno()
                if e not in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE):  # not offered here
                    raise OSError(e, os.strerror(e), self._final)
            # the pages are clean now: drop them so a big save does not evict the cache
            os.posix_fadvise(self._fd, w0, w1 - w0, os.POSIX_FADV_DONTNEED)
            self._waited = w1
        self._flushed = end

    def commit(self, *, if_absent: bool = False, after: Sequence[str] = ()) -> ObjectInfo:
        """fsync, rename over the final key, fsync the directory and then the parents of
        directories this writer created (deepest first: on ext4 the file's fsync already
        committed them, so these add no journal commit); returns its info.

        An in-place writer instead closes its file and records :attr:`unsynced`
        (nothing is fsynced: a later ``commit(after=...)`` makes it durable).

        Args:
            if_absent: create only: ``link(2)`` instead of the rename, so an existing
                key is never replaced; the info then carries the new version token.
            after: paths (the :attr:`unsynced` of in-place writers) fsynced together
                with this file's data, all before this object's name is published: what
                this object names is durable first (:func:`fsync_paths`).

        Raises:
            ObjectExists: ``if_absent`` and the key exists (nothing is written).
            StorageFull, StorageError: the write could not be made durable; the temp
                file is removed and nothing appears under the key.
        """
        if self._fd is None:
            raise StorageError(f"commit of {self.key} after commit/abort")
        if self._in_place:
            return self._commit_unsynced()
        version: str | None = None
        try:
            version = self._sync(versioned=if_absent, after=after)
            if if_absent:
                try:
                    os.link(self._tmp, self._final)
                except FileExistsError as e:
                    raise ObjectExists(
                        f"{self.key} already exists in {self._storage.url}: a conditional "
                        "create lost the race"
                    ) from e
                finally:
                    self.abort()  # the temp name goes; the linked file stays
                self._committed = True
            else:
                os.replace(self._tmp, self._final)
                self._committed = True  # the temp name is gone: nothing left to abort
            fsync_dir(os.path.dirname(self._final))
            for p in self._new_dir_parents:  # the entries of directories made for it
                fsync_dir(p)
        except OSError as e:
            self.abort()
            # a failed fsync of an ``after`` path (fsync_path names it) is that file's
            where = e.filename if e.filename in after else self._final
            raise map_os_error(e, path=where, nbytes=self.bytes_written) from e
        return ObjectInfo(self.key, self.bytes_written, time.time(), version)

    def commit_if_match(self, if_match: str) -> ObjectInfo:
        """Commit only over the version ``if_match`` (compare-and-swap under an exclusive
        ``flock(2)`` of the key's directory: read the current version, compare, rename).
        ``flock`` is local to one kernel: across machines use S3, or a filesystem whose
        ``flock`` is cluster-wide.

        Returns:
            The object's info with its new version token.

        Raises:
            PreconditionFailed: ``if_match`` is not the current version (or no object);
                nothing changed.
            StorageFull, StorageError: as :meth:`commit`.
        """
        if self._fd is None:
            raise StorageError(f"commit of {self.key} after commit/abort")
        try:
            version = self._sync(versioned=True)
            dfd = os.open(os.path.dirname(self._final), os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX)
                try:
                    current: str | None = read_versioned(self._final)[1]
                except FileNotFoundError:
                    current = None
                if current != if_match:
                    raise PreconditionFailed(
                        f"{self.key} in {self._storage.url} changed (version "
                        f"{current or 'absent'}, expected {if_match}): a conditional update "
                        "lost the race"
                    )
                os.replace(self._tmp, self._final)
            finally:
                os.close(dfd)  # releases the flock
            fsync_dir(os.path.dirname(self._final))
        except OSError as e:
            raise map_os_error(e, path=self._final, nbytes=self.bytes_written) from e
        finally:
            self.abort()  # the temp file if it is still there; no-op after the rename
        assert version is not None
        return ObjectInfo(self.key, self.bytes_written, time.time(), version)

    def _commit_unsynced(self) -> ObjectInfo:
        """The in-place commit: close the complete file, leave its fsyncs to the object
        that will name it (:attr:`unsynced`)."""
        assert self._fd is not None
        self._drain()
        fd, self._fd = self._fd, None
        self._committed = True
        try:
            self._start_write_back(fd)
            os.close(fd)
        except OSError as e:
            raise map_os_error(e, path=self._final, nbytes=self.bytes_written) from e
        self.unsynced = [self._final, os.path.dirname(self._final), *self._new_dir_parents]
        return ObjectInfo(self.key, self.bytes_written, time.time())

    def _start_write_back(self, fd: int) -> None:
        """Hand the pages not yet handed to write-back to the device now, without
        waiting (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` to the end of the file), when
        this writer writes behind: the fsync of the commit that names the object then
        waits for I/O already in flight instead of starting it, so the object's write-back
        overlaps building and writing that commit (issue 19, small states; measured in
        bench/README.md, "Eighth session").  Durability still comes from that fsync
        alone.  A call that does not wait never consumes a write-back error (Linux 4.16+
        reports it to the later fsync), so its result is not checked; the waiting call of
        :meth:`_write_behind` is."""
        if self._behind and _sync_file_range is not None:
            _sync_file_range(fd, self._flushed, 0, SFR_WRITE)  # type: ignore[operator]
            self._flushed = self._on_fd

    def _sync(self, *, versioned: bool, after: Sequence[str] = ()) -> str | None:
        """fsync (with the ``after`` paths, concurrently) and close the temp file; its
        version token when ``versioned`` (from the hash kept while writing, else the
        bytes are read back: the fd is write-only)."""
        assert self._fd is not None
        self._drain()
        if after:
            fsync_paths(after, also=self._fd)
        else:
            os.fsync(self._fd)
        version = None
        if versioned and self._sha is not None:
            version = token(os.fstat(self._fd), self._sha.hexdigest())
        os.close(self._fd)
        self._fd = None
        if versioned and version is None:
            version = read_versioned(self._tmp)[1]
        return version

    def abort(self) -> None:
        """Close and remove the temp file (an in-place writer: its file, unless it was
        committed); idempotent."""
        if self._committed:
            return
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            os.unlink(self._tmp)
        except OSError:
            pass

    def __enter__(self) -> LocalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.abort()
        elif self._fd is not None:
            self.commit()
