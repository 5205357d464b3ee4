"""Local POSIX storage backend (DESIGN.md §3, "Storage").

Every object is a regular file under :attr:`LocalStorage.root`.  Writes go to a temp
file in the destination directory (``.ckrun-tmp-<pid>-<rand>-<name>``), are fsynced,
renamed over the final name with ``os.replace`` and the directory is fsynced, so a
reader sees nothing or the whole object and a returned ``put``/``commit`` is durable
(POSIX rename atomicity; ext4/xfs need the directory fsync for the new entry to survive
a power cut).  Temp files are invisible to :meth:`LocalStorage.list`; ones left by a
killed process are removed by :meth:`LocalStorage.sweep_temp`.

Streaming writes (:meth:`LocalStorage.open_write`, used for checkpoint shards) go
through ``O_DIRECT`` staging buffers by default (:mod:`ckrun.storage.direct`), at
the disk's limit without filling the page cache.  Where ``O_DIRECT`` is refused (tmpfs)
or with ``direct=False`` they go through the page cache and start write-back early with
``sync_file_range(2)`` every :data:`WRITE_BEHIND_BYTES`, waiting for the window before
the previous one, so the final fsync has little left to do and dirty pages stay bounded.
Measurements: bench/README.md.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import os
import secrets
import time
from collections.abc import Iterable
from typing import IO

from ckrun.errors import ObjectExists, ObjectNotFound, StorageError, map_os_error
from ckrun.storage.base import ObjectInfo, validate_key

TEMP_PREFIX = ".ckrun-tmp-"
WRITE_BEHIND_BYTES = 32 * 1024 * 1024
_MAX_WRITE = 1 << 30  # Linux writes at most 0x7ffff000 bytes per call

_SFR_WAIT_BEFORE = 1
_SFR_WRITE = 2
_SFR_WAIT_AFTER = 4


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


_sync_file_range = _load_sync_file_range()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectUnsupported(StorageError):
    """The filesystem refused ``O_DIRECT`` (e.g. tmpfs); the caller falls back."""


class LocalWriter:
    """A streaming write to one key; see :class:`ckrun.storage.base.ObjectWriter`.

    Attributes:
        key: the destination key.
        bytes_written: bytes written so far.
    """

    def __init__(
        self, storage: LocalStorage, key: str, *, write_behind: bool = True, extra_flags: int = 0
    ):
        self.key = key
        self._storage = storage
        self._final = storage._path(key)
        d = os.path.dirname(self._final)
        storage._makedirs(d)
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
            raise map_os_error(e, path=self._final) from e
        self.bytes_written = 0
        self._behind = write_behind and _sync_file_range is not None
        self._flushed = 0  # bytes handed to sync_file_range(WRITE)
        self._waited = 0  # bytes known written back

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data`` (any size); returns ``len(data)`` in bytes.

        Raises:
            StorageFull: ENOSPC/EDQUOT, naming the key and the bytes of this write.
            StorageError: any other I/O error.
        """
        if self._fd is None:
            raise StorageError(f"write to {self.key} after commit/abort")
        mv = memoryview(data).cast("B")
        n = len(mv)
        step = WRITE_BEHIND_BYTES if self._behind else _MAX_WRITE
        done = 0
        try:
            while done < n:
                k = os.write(self._fd, mv[done : done + step])
                done += k
                self.bytes_written += k
                if self._behind and self.bytes_written - self._flushed >= WRITE_BEHIND_BYTES:
                    self._write_behind()
        except OSError as e:
            raise map_os_error(e, path=self._final, nbytes=n) from e
        return n

    def _write_behind(self) -> None:
        """Start write-back of the new window; wait for the one before the previous."""
        assert self._fd is not None and _sync_file_range is not None
        fn = _sync_file_range
        start, end = self._flushed, self.bytes_written
        fn(self._fd, start, end - start, _SFR_WRITE)  # type: ignore[operator]
        if start - self._waited >= WRITE_BEHIND_BYTES:
            w0, w1 = self._waited, start
            flags = _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER
            fn(self._fd, w0, w1 - w0, flags)  # type: ignore[operator]
            # the pages are clean now: drop them so a big save does not evict the cache
            os.posix_fadvise(self._fd, w0, w1 - w0, os.POSIX_FADV_DONTNEED)
            self._waited = w1
        self._flushed = end

    def commit(self) -> ObjectInfo:
        """fsync, rename over the final key, fsync the directory; returns its info.

        Raises:
            StorageFull, StorageError: the write could not be made durable; the temp
                file is removed and nothing appears under the key.
        """
        if self._fd is None:
            raise StorageError(f"commit of {self.key} after commit/abort")
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self._tmp, self._final)
            _fsync_dir(os.path.dirname(self._final))
        except OSError as e:
            self.abort()
            raise map_os_error(e, path=self._final, nbytes=self.bytes_written) from e
        return ObjectInfo(self.key, self.bytes_written, time.time())

    def abort(self) -> None:
        """Close and remove the temp file; idempotent."""
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


class LocalStorage:
    """:class:`~ckrun.storage.base.Storage` on a local (or network) POSIX directory.

    Args:
        path: the root directory; created (with parents) if missing.
        write_behind: start write-back every :data:`WRITE_BEHIND_BYTES` during streaming
            writes (``sync_file_range``); False leaves it all to the final fsync.
        direct: streaming writes use ``O_DIRECT`` through aligned staging buffers
            (:mod:`ckrun.storage.direct`); falls back where unsupported.

    Raises:
        StorageError: the root cannot be created (``StoragePermissionError`` when
            read-only or denied).
    """

    def __init__(self, path: str, *, write_behind: bool = True, direct: bool = True):
        self.url = path
        self.write_behind = write_behind
        self.direct = direct
        self.root = os.path.abspath(path)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise map_os_error(e, path=self.root) from e

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *validate_key(key).split("/"))

    def _makedirs(self, d: str) -> None:
        """Create ``d`` and fsync each new entry's parent so the directories persist."""
        missing: list[str] = []
        cur = d
        while not os.path.isdir(cur) and cur != self.root:
            missing.append(cur)
            cur = os.path.dirname(cur)
        for m in reversed(missing):
            try:
                os.mkdir(m)
            except FileExistsError:
                continue
            except OSError as e:
                raise map_os_error(e, path=m) from e
            _fsync_dir(os.path.dirname(m))

    def open_write(self, key: str) -> LocalWriter:
        """Start a streaming, atomic write to ``key`` (see :class:`LocalWriter`)."""
        if self.direct:
            from ckrun.storage.direct import DirectWriter

            try:
                return DirectWriter(self, key)
            except DirectUnsupported:
                self.direct = False
        return LocalWriter(self, key, write_behind=self.write_behind)

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> ObjectInfo:
        """Store ``data`` under ``key`` atomically and durably.

        Args:
            if_absent: create only; ``ObjectExists`` when the key exists (``link(2)``
                fails with EEXIST instead of replacing).
        """
        w = LocalWriter(self, key, write_behind=False)
        try:
            w.write(data)
            if not if_absent:
                return w.commit()
            assert w._fd is not None
            os.fsync(w._fd)
            os.close(w._fd)
            w._fd = None
            try:
                os.link(w._tmp, w._final)
            except FileExistsError as e:
                raise ObjectExists(
                    f"{key} already exists in {self.url}: a conditional create lost the race"
                ) from e
            _fsync_dir(os.path.dirname(w._final))
            return ObjectInfo(key, len(memoryview(data).cast("B")), time.time())
        except OSError as e:
            raise map_os_error(e, path=w._final) from e
        finally:
            w.abort()  # closes a still-open temp file and removes it; no-op after commit

    def put_file(self, key: str, path: str) -> ObjectInfo:
        """Copy the local file ``path`` to ``key`` (atomic, durable)."""
        with open(path, "rb") as src, self.open_write(key) as w:
            buf = bytearray(16 << 20)
            while n := src.readinto(buf):
                w.write(memoryview(buf)[:n])
        return ObjectInfo(key, w.bytes_written, time.time())

    def get(self, key: str) -> bytes:
        """The whole object; ``ObjectNotFound`` if absent."""
        p = self._path(key)
        try:
            with open(p, "rb") as f:
                return f.read()
        except OSError as e:
            raise _read_error(e, key, self.url) from e

    def get_file(self, key: str, path: str) -> None:
        """Copy ``key`` to the local ``path``, replaced atomically."""
        dest = LocalStorage(os.path.dirname(os.path.abspath(path)))
        dest.put_file(os.path.basename(path), self._path(key))

    def open_read(self, key: str) -> IO[bytes]:
        """An unbuffered binary file (supports ``readinto`` and ``fileno``)."""
        try:
            return open(self._path(key), "rb", buffering=0)
        except OSError as e:
            raise _read_error(e, key, self.url) from e

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset`` of ``key`` with ``preadv`` (see ``Storage``)."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise _read_error(e, key, self.url) from e
        try:
            done, n = 0, len(buf)
            while done < n:
                got = os.preadv(fd, [buf[done : done + (64 << 20)]], offset + done)
                if not got:
                    raise StorageError(
                        f"{self.url}/{key}: ends before byte {offset + n} "
                        f"(read {offset + done}); the object is truncated"
                    )
                done += got
        except OSError as e:
            raise _read_error(e, key, self.url) from e
        finally:
            os.close(fd)

    def local_path(self, key: str) -> str | None:
        """The absolute path of ``key``."""
        return self._path(key)

    def head(self, key: str) -> ObjectInfo | None:
        """Size and mtime of ``key``, or None when absent (or not a regular file)."""
        try:
            st = os.stat(self._path(key), follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _read_error(e, key, self.url) from e
        if not _is_regular(st.st_mode):
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every regular file whose key starts with ``prefix``, sorted by key.

        Temp files of in-flight or killed writes and symlinks are not objects.
        """
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self._path(base) if base else self.root
        out: builtins.list[ObjectInfo] = []
        self._walk(top, base, prefix, out)
        out.sort(key=lambda o: o.key)
        return out

    def _walk(self, d: str, rel: str, prefix: str, out: builtins.list[ObjectInfo]) -> None:
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            raise _read_error(e, rel or ".", self.url) from e
        for ent in entries:
            key = f"{rel}/{ent.name}" if rel else ent.name
            if ent.name.startswith(TEMP_PREFIX) or ent.is_symlink():
                continue
            if ent.is_dir(follow_symlinks=False):
                if key.startswith(prefix) or prefix.startswith(key + "/"):
                    self._walk(ent.path, key, prefix, out)
            elif ent.is_file(follow_symlinks=False) and key.startswith(prefix):
                st = ent.stat(follow_symlinks=False)
                out.append(ObjectInfo(key, st.st_size, st.st_mtime))

    def delete(self, keys: Iterable[str]) -> None:
        """Unlink ``keys`` (missing ones ignored), fsync their directories, and remove
        directories left empty (never the root)."""
        dirs: set[str] = set()
        for key in keys:
            p = self._path(key)
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise map_os_error(e, path=p) from e
            dirs.add(os.path.dirname(p))
        for d in sorted(dirs, key=len, reverse=True):
            self._prune(d)

    def _prune(self, d: str) -> None:
        while d != self.root and d.startswith(self.root + os.sep):
            try:
                os.rmdir(d)
            except OSError:
                _fsync_dir_quiet(d)
                return
            d = os.path.dirname(d)
        _fsync_dir_quiet(d)

    def sweep_temp(self, prefix: str = "", min_age_s: float = 900.0) -> builtins.list[str]:
        """Remove temp files of killed writers under ``prefix`` (not a Storage method).

        Args:
            prefix: key prefix (directory) to sweep.
            min_age_s: only files not modified for this many seconds (in-flight writes
                of live processes keep touching theirs); files of this process are kept.

        Returns:
            The paths removed, relative to the root.
        """
        removed: builtins.list[str] = []
        now = time.time()
        mine = f"{TEMP_PREFIX}{os.getpid()}-"
        top = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if not name.startswith(TEMP_PREFIX) or name.startswith(mine):
                    continue
                p = os.path.join(dirpath, name)
                try:
                    if now - os.stat(p).st_mtime >= min_age_s:
                        os.unlink(p)
                        removed.append(os.path.relpath(p, self.root))
                except OSError:
                    continue
        return removed


def _is_regular(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


def _fsync_dir_quiet(d: str) -> None:
    try:
        _fsync_dir(d)
    except OSError:
        pass


def _read_error(e: OSError, key: str, url: str) -> StorageError:
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return ObjectNotFound(f"{key} does not exist in {url}")
    return map_os_error(e, path=f"{url}/{key}")
