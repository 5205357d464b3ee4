"""Ranged reads of local objects (:class:`ckrun.storage.local.LocalStorage`).

:class:`LocalRanges` is the :class:`ckrun.storage.base.ReadsInOrder` reader: one file
descriptor for many ranges of one object, read in increasing offset order with the
kernel told the access is sequential (``posix_fadvise(POSIX_FADV_SEQUENTIAL)``, which
doubles the readahead window on Linux).  Measured on this project's 2-vCPU virtio disk
(issue 19, page cache dropped, 96 pieces of a 0.30 GB shard): one descriptor in file
order 0.14-0.16 s, the plain 64 MiB-buffer read of the whole file 0.18-0.23 s, and the
same pieces as ranged reads four in flight on a fresh descriptor each 0.22-0.24 s: the
parallel reads defeat readahead, which a local disk needs more than queue depth.
"""

from __future__ import annotations

import errno
import os

from ckrun.errors import ObjectNotFound, StorageError, map_os_error

__all__ = ["LocalRanges", "pread_into", "read_error"]

MAX_READ = 64 << 20  # bytes per preadv call


def read_error(e: OSError, key: str, url: str) -> StorageError:
    """The storage error for a failed read of ``key``: ``ObjectNotFound`` when it is
    missing, else :func:`ckrun.errors.map_os_error`."""
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return ObjectNotFound(f"{key} does not exist in {url}")
    return map_os_error(e, path=f"{url}/{key}")


def pread_into(fd: int, offset: int, buf: memoryview, key: str, url: str) -> None:
    """Fill ``buf`` from ``offset`` of the open file ``fd`` (``preadv``, at most
    :data:`MAX_READ` bytes a call).

    Raises:
        StorageError: the file ends before ``offset + len(buf)`` (names the key), or the
            read failed (:func:`read_error`).
    """
    done, n = 0, len(buf)
    try:
        while done < n:
            got = os.preadv(fd, [buf[done : done + MAX_READ]], offset + done)
            if not got:
                raise StorageError(
                    f"{url}/{key}: ends before byte {offset + n} "
                    f"(read {offset + done}); the object is truncated"
                )
            done += got
    except OSError as e:
        raise read_error(e, key, url) from e


class LocalRanges:
    """Ranges of one local object read through one descriptor (module docstring).

    Raises (constructor):
        ObjectNotFound: the object does not exist.
        StorageError: it cannot be opened.
    """

    def __init__(self, path: str, key: str, url: str, *, sequential: bool = True) -> None:
        self.key, self.url = key, url
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise read_error(e, key, url) from e
        if sequential and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # advice only: some filesystems refuse it

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from byte ``offset`` (see :func:`pread_into`); callers go in
        increasing offset order to keep the readahead sequential.

        Raises:
            StorageError: truncated object, read error, or the reader was closed.
        """
        if self._fd is None:
            raise StorageError(f"{self.url}/{self.key}: read after close")
        pread_into(self._fd, offset, buf, self.key, self.url)

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> LocalRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
