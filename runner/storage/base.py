"""The ``Storage`` protocol: objects, not directories (DESIGN.md §3).

Every backend (local POSIX, S3) keeps the same contract, which the checkpoint commit
protocol relies on:

* a reader sees nothing or the whole object, never a prefix of it;
* ``put``/``commit`` return only once the object is durable (local: fsync of the file
  and of its directory; S3: the PUT or CompleteMultipartUpload returned 200);
* ``delete`` is idempotent; there is no rename, so directory atomicity is the
  checkpointer's job (publish the manifest last);
* conditional writes: ``put(if_absent=True)`` creates only (local ``link(2)``, S3
  ``If-None-Match: *``); ``put(if_match=version)`` replaces only the version read by
  :meth:`Storage.get_versioned` (a compare-and-swap: local, a ``flock(2)`` on the
  directory around read-compare-rename; S3, ``If-Match`` on the ETag).  Conditional
  writes of one key are linearizable with each other; a plain ``put``/``delete`` racing a
  conditional update may be lost, so a key managed by compare-and-swap (the run's lease)
  is written only conditionally.  A version token identifies the bytes *and* the write
  where the backend can (local: inode, mtime and content hash) but S3's ETag of a single
  PUT is the MD5 of the content, so two writes of identical bytes may carry the same
  token: a compare-and-swap user makes every write's bytes unique (the lease carries a
  renewal counter);
* optional, :class:`PublishesAfter` (local storage; issue 19): an *unreferenced* object
  (a shard no reader opens until a manifest names it) is written straight under its
  attempt-unique key, without a temp name or a rename, and made durable by the
  ``put_after`` that publishes the object naming it, before that name appears; a
  listing may show such an object partially written (a killed save), and only
  retention (orphaned shards) ever deletes it;
* optional, :class:`ReadsInOrder` (local storage; issue 19): ranges of one object read
  through one handle in file order, for readers of many pieces;
* optional, :class:`DeletesLazily` (local storage; issue 19): a delete that flushes
  nothing of its own, durable with the filesystem's next commit (:func:`lazy_delete`),
  for deletes whose loss to a crash is harmless (retention);
* keys are relative POSIX paths (``a/b/c``); :func:`validate_key` rejects absolute keys,
  ``..``, empty components and backslashes, so a manifest cannot name a file outside the
  run.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Protocol, cast, runtime_checkable

from ckrun.errors import InvalidKey


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one stored object.

    Attributes:
        key: the object's key relative to the storage root.
        size_bytes: its size in bytes.
        mtime: modification time, seconds since the epoch (UTC), when known.
        version: the version token of this write (S3 ETag; local: inode, mtime and
            content hash), set by conditional writes and :meth:`Storage.get_versioned`;
            None when not known.
    """

    key: str
    size_bytes: int
    mtime: float | None = None
    version: str | None = None


@runtime_checkable
class ObjectWriter(Protocol):
    """A streaming write to one key; invisible under its key until :meth:`commit`.

    Use as a context manager: leaving the block with an exception aborts the write
    (the temp file or multipart upload is removed), leaving normally commits.
    """

    key: str

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; returns the number of bytes written."""
        ...

    def commit(self) -> ObjectInfo:
        """Make the object durable and visible under its key (atomic)."""
        ...

    def abort(self) -> None:
        """Discard everything written; idempotent."""
        ...

    def __enter__(self) -> ObjectWriter: ...

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """Durable object storage rooted at :attr:`url`.

    Errors: every method raises a :class:`ckrun.errors.StorageError` subclass
    (``StorageFull``, ``StoragePermissionError``, ``ObjectNotFound``, ``ObjectExists``,
    ``InvalidKey``, ``PreconditionFailed``), chained from the backend's own exception.
    """

    url: str

    def put(
        self,
        key: str,
        data: bytes | memoryview,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
    ) -> ObjectInfo:
        """Store ``data`` under ``key`` atomically and durably.

        Args:
            if_absent: conditional create; raise ``ObjectExists`` if the key exists
                (local: ``link(2)``; S3: ``If-None-Match: *``).
            if_match: conditional update (compare-and-swap): replace the object only if
                its current version token is ``if_match`` (from :meth:`get_versioned` or
                a previous conditional write); otherwise raise ``PreconditionFailed``
                (also when the key is absent).  Exclusive with ``if_absent``.

        Returns:
            The object's info; ``version`` is set after a conditional write.
        """
        ...

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The whole object and its version token, read together (one GET / one open).

        Raises:
            ObjectNotFound: ``key`` does not exist.
        """
        ...

    def put_file(self, key: str, path: str) -> ObjectInfo:
        """Upload a local file under ``key`` (atomic, durable)."""
        ...

    def open_write(self, key: str) -> ObjectWriter:
        """Start a streaming write to ``key`` (see :class:`ObjectWriter`)."""
        ...

    def get(self, key: str) -> bytes:
        """Return the whole object; ``ObjectNotFound`` if absent."""
        ...

    def get_file(self, key: str, path: str) -> None:
        """Download ``key`` to the local ``path`` (atomically replaced)."""
        ...

    def open_read(self, key: str) -> IO[bytes]:
        """Open ``key`` for streaming reads (a binary file-like object)."""
        ...

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with bytes ``[offset, offset + len(buf))`` of ``key`` (a ranged
        read: local ``preadv``, S3 ``GetObject`` with ``Range``).

        Raises:
            ObjectNotFound: ``key`` does not exist.
            StorageError: the object ends before ``offset + len(buf)`` (names the key).
        """
        ...

    def local_path(self, key: str) -> str | None:
        """The POSIX path of ``key`` when the backend is a local filesystem, else None."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """Metadata of ``key``, or None when it does not exist."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``; missing keys are ignored (idempotent).  Durable on return
        where the backend makes it so: S3 once the DELETE returned; local once the
        directory is fsynced (a failed directory fsync is not raised: the unlinks are
        done).  :class:`DeletesLazily` is the variant without the flush."""
        ...


@runtime_checkable
class WritesInPlace(Protocol):
    """Optional capability of a :class:`Storage`: shard writes straight from a buffer.

    The caller owns ``length`` bytes of page-aligned memory at address ``base`` (host
    buffers of an async save) laid out as the data region of the file it writes; the
    returned factory opens writers that send those bytes to the medium without a staging
    copy (local ``O_DIRECT``: :class:`ckrun.storage.direct.ArenaWriter`).
    """

    def in_place_writer(self, base: int, length: int) -> Callable[[str], ObjectWriter] | None:
        """A writer factory over the buffer, or None when this storage declines (then
        the caller uses :meth:`Storage.open_write`)."""
        ...


@runtime_checkable
class PublishesAfter(Protocol):
    """Optional capability of a :class:`Storage`: unreferenced objects, made durable
    together with the object that names them (module docstring; issue 19: one journal
    commit fewer per small checkpoint, and the independent fsyncs batched).

    The commit protocol keeps its order: everything ``after`` names is durable before
    ``key`` is published, and ``key`` is durable when ``put_after`` returns.
    """

    def open_unreferenced(self, key: str, size_hint: int | None = None) -> ObjectWriter | None:
        """A writer straight under ``key`` (a fresh, attempt-unique key); its
        ``commit()`` leaves the object complete but not durable until a ``put_after``
        names it.  None when this storage declines (then use :meth:`Storage.open_write`).
        ``size_hint``: the expected size in bytes if known (it may pick the writer).

        Raises:
            ObjectExists: ``key`` exists.
        """
        ...

    def put_after(
        self,
        key: str,
        data: bytes | memoryview,
        after: Sequence[ObjectWriter],
        *,
        if_absent: bool = False,
    ) -> ObjectInfo:
        """:meth:`Storage.put` that first makes the committed writers ``after`` (from
        :meth:`open_unreferenced`) durable, concurrently with ``data`` itself.

        Raises:
            TypeError: a writer in ``after`` is not an unreferenced writer of this
                storage.  Otherwise as :meth:`Storage.put`.
        """
        ...


@functools.cache
def publishes_after(cls: type) -> bool:
    """Whether a storage of class ``cls`` offers :class:`PublishesAfter`, decided once
    per class: on Python 3.11 an ``isinstance`` against a runtime Protocol lists the
    protocol's members again on every call (20-40 µs on each small save, issue 19)."""
    return issubclass(cls, PublishesAfter)


@runtime_checkable
class DeletesLazily(Protocol):
    """Optional capability of a :class:`Storage`: deletes without a flush of their own.

    :meth:`Storage.delete` returns once the deletion is durable (local: the directory
    fsynced, one journal commit and one device cache flush each time).  A retention pass
    after every save does not need that: a deletion lost to a crash brings back an old
    checkpoint, or leaves a file the next pass deletes again.  Its flushes are pure cost,
    and on a busy or virtual disk they delay the saves next to them (bench/README.md,
    "Twentieth session").  A storage that overrides ``delete`` (to audit or inject
    faults) keeps seeing every delete: local storage's ``delete_lazily`` calls such an
    override; a wrapper that delegates attributes to another storage gets its own
    ``delete`` unless its class defines ``delete_lazily`` (:func:`lazy_delete` asks the
    class, not the instance).
    """

    def delete_lazily(self, keys: Iterable[str]) -> None:
        """As :meth:`Storage.delete`, visible at once, durable only with the storage's
        next flush (local, ext4 and xfs: the next fsync, which commits the whole journal;
        other filesystems: their next commit, at the latest their commit interval).

        Raises:
            StorageError: a key could not be deleted (as :meth:`Storage.delete`).
        """
        ...


@functools.cache
def _deletes_lazily(cls: type) -> bool:
    """Whether storages of class ``cls`` offer :class:`DeletesLazily`, decided once per
    class (as :func:`publishes_after`: an ``isinstance`` against a runtime Protocol
    lists its members again on every call, on every retention pass here)."""
    return issubclass(cls, DeletesLazily)


def lazy_delete(storage: Storage) -> Callable[[Iterable[str]], None]:
    """``storage``'s :meth:`DeletesLazily.delete_lazily` where its class offers one,
    else its :meth:`Storage.delete`."""
    if _deletes_lazily(type(storage)):
        return cast(DeletesLazily, storage).delete_lazily
    return storage.delete


class RangeReader(Protocol):
    """Ranged reads of one object through one open handle (:class:`ReadsInOrder`)."""

    def read_into(self, offset: int, buf: memoryview) -> None:
        """As :meth:`Storage.read_into` on the object this reader was opened on."""
        ...

    def close(self) -> None:
        """Release the handle (idempotent)."""
        ...

    def __enter__(self) -> RangeReader: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class ReadsInOrder(Protocol):
    """Optional capability of a :class:`Storage`: many ranges of one object are read
    fastest in file order through one handle (a local disk: one descriptor, kernel
    readahead in sequential mode; measured in :mod:`ckrun.storage.local_read`) rather
    than as independent ranged reads in flight together (S3: parallel ``Range`` GETs).
    A reader of many pieces (the in-place load, issue 19) asks for this first.
    """

    def open_ranges(self, key: str) -> RangeReader | None:
        """A reader over ``key``; None when this storage declines for this key (then
        use :meth:`Storage.read_into`, several in flight).

        Raises:
            ObjectNotFound: ``key`` does not exist.
        """
        ...


def validate_key(key: str) -> str:
    """Check that ``key`` is a safe relative object key and return it normalised.

    Raises:
        InvalidKey: for an empty key, an absolute path, a ``..`` or ``.`` component, a
            backslash, a NUL byte or an empty component (``a//b``).
    """
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"invalid object key {key!r}: keys are non-empty relative paths")
    if "\\" in key or "\x00" in key:
        raise InvalidKey(f"invalid object key {key!r}: backslashes and NUL are not allowed")
    if key.startswith("/") or posixpath.isabs(key):
        raise InvalidKey(f"invalid object key {key!r}: absolute keys are not allowed")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidKey(
            f"invalid object key {key!r}: '..', '.' and empty components are not allowed"
        )
    return key
