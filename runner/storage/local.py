"""Local POSIX storage backend (DESIGN.md §3, "Storage").

Every object is a regular file under :attr:`LocalStorage.root`.  Writes go to a temp
file in the destination directory (``.ckrun-tmp-<pid>-<rand>-<name>``), are fsynced,
renamed over the final name with ``os.replace`` and the directory is fsynced, so a
reader sees nothing or the whole object and a returned ``put``/``commit`` is durable
(POSIX rename atomicity; ext4/xfs need the directory fsync for the new entry to survive
a power cut).  Temp files are invisible to :meth:`LocalStorage.list`; ones left by a
killed process are removed by :meth:`LocalStorage.sweep_temp`.

Unreferenced objects (:class:`~ckrun.storage.base.PublishesAfter`, issue 19): a
checkpoint shard is written straight under its attempt-unique key (``O_EXCL``, no temp
file, no rename) and is not fsynced at its commit; :meth:`LocalStorage.put_after`, which
writes the manifest naming it, fsyncs the shard, its directory, the parents of new
directories and the manifest's temp file all at once (independent durability points, one
journal commit), and only then links the manifest and fsyncs its directory.  A save thus
waits for two ordered flushes instead of four.  Retention's deletes flush nothing of
their own (:meth:`LocalStorage.delete_lazily`): on ext4 and xfs they ride on the next
save's flush.

Streaming writes (:meth:`LocalStorage.open_write`, checkpoint shards) go through
``O_DIRECT`` staging buffers (:mod:`ckrun.storage.direct`) or, where that is refused
(tmpfs) or slower, the page cache with write-back started early (``sync_file_range(2)``
per :data:`WRITE_BEHIND_BYTES`; dirty pages stay bounded): the writer is chosen per
location by a short measured probe, remembered (:mod:`ckrun.storage.probe`; figures in
bench/README.md).
"""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO

from ckrun.errors import map_os_error
from ckrun.storage import probe
from ckrun.storage.base import ObjectInfo, ObjectWriter
from ckrun.storage.direct import ArenaWriter, DirectWriter, stage_bytes
from ckrun.storage.local_delete import sweep_temp, unlink_all
from ckrun.storage.local_read import LocalRanges, read_error
from ckrun.storage.local_writer import (
    TEMP_PREFIX,
    WRITE_BEHIND_BYTES,
    DirectUnsupported,
    LocalWriter,
    object_path,
    read_versioned,
)

__all__ = ["WRITE_BEHIND_BYTES", "DirectUnsupported", "LocalStorage", "LocalWriter"]


class LocalStorage:
    """:class:`~ckrun.storage.base.Storage` on a local (or network) POSIX directory.

    Args:
        path: the root directory; created (with parents) if missing.
        write_behind: start write-back every :data:`WRITE_BEHIND_BYTES` during streaming
            writes (``sync_file_range``); False leaves it all to the final fsync.
        direct: streaming writes may use ``O_DIRECT`` (:mod:`ckrun.storage.direct`).

    Raises:
        StorageError: the root cannot be created (``StoragePermissionError``: denied).
    """

    def __init__(self, path: str, *, write_behind: bool = True, direct: bool = True):
        self.url = path
        self.write_behind = write_behind
        self.direct = direct
        self._choice: probe.WriterChoice | None = None
        self._unprobed: probe.WriterChoice | None = None  # the deferred answer, kept
        self.root = os.path.abspath(path)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise map_os_error(e, path=self.root) from e

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    def _path(self, key: str) -> str:
        return object_path(self.root, key)

    def writer_choice(self, *, may_probe: bool = True) -> probe.WriterChoice:
        """The streaming writer of this location (:mod:`ckrun.storage.probe`: the
        ``CKRUN_WRITER`` override, a remembered probe, or a new probe).  With
        ``direct=False``, or where ``O_DIRECT`` is refused, always write-behind.

        Args:
            may_probe: False where the answer does not pay for a probe (a small
                object): an unprobed location then gets ``direct:1`` (source ``deferred``),
                kept for such calls; the next call that may probe asks again.

        Raises:
            ConfigError: CKRUN_WRITER is malformed.
        """
        if self.direct and self._choice is None:
            if not may_probe and self._unprobed is not None:
                return self._unprobed
            try:
                c = probe.choose(self.root, may_probe=may_probe)
            except DirectUnsupported:
                self.direct = False
            else:
                if c.source == "deferred":
                    if not may_probe:
                        self._unprobed = c
                    return c
                self._choice = c
        if not self.direct:
            return probe.WriterChoice("writebehind", 1, "config")
        assert self._choice is not None
        return self._choice

    def open_write(self, key: str) -> LocalWriter:
        """Start a streaming, atomic write to ``key`` (see :class:`LocalWriter`) with the
        writer :meth:`writer_choice` names."""
        c = self.writer_choice()
        if c.mode == "direct":
            try:
                return DirectWriter(self, key, depth=c.depth)
            except DirectUnsupported:
                self.direct = False
        return LocalWriter(self, key, write_behind=self.write_behind)

    def in_place_writer(self, base: int, length: int) -> Callable[[str], ObjectWriter] | None:
        """``O_DIRECT`` shard writers straight from ``length`` bytes of page-aligned memory
        at ``base`` (:class:`~ckrun.storage.base.WritesInPlace`); None when ``direct`` is
        off, or for a subclass (it keeps its own ``open_write``).  Where the filesystem
        refuses ``O_DIRECT`` the factory turns ``direct`` off and opens buffered writers."""
        if type(self) is not LocalStorage or not self.direct:
            return None

        def open_shard(key: str) -> ObjectWriter:
            if self.direct:
                try:
                    return ArenaWriter(self, key, base, length)
                except DirectUnsupported:
                    self.direct = False
            return self.open_write(key)

        return open_shard

    def open_unreferenced(self, key: str, size_hint: int | None = None) -> LocalWriter | None:
        """A writer of an unreferenced object straight under ``key`` (see the module
        docstring and :class:`~ckrun.storage.base.PublishesAfter`), with the writer
        :meth:`writer_choice` names; None for a subclass (it keeps its own writes).

        Args:
            size_hint: the object's expected size in bytes, if known.  An object that
                fits in one ``O_DIRECT`` staging buffer (:func:`~.direct.stage_bytes`)
                would be written through the page cache at the commit anyway, so it gets
                the buffered writer at once: no staging copy, no I/O thread pool (issue
                19, small states), and no probe is run for it.  Only a choice of
                writer: any size may be written.

        Raises:
            ObjectExists: ``key`` exists (keys of unreferenced objects are fresh).
        """
        if type(self) is not LocalStorage:
            return None
        # an object every probed candidate writes buffered never waits for the probe
        small = size_hint is not None and size_hint <= stage_bytes(probe.DEEP)
        c = self.writer_choice(may_probe=not small)
        if c.mode == "direct" and (size_hint is None or size_hint > stage_bytes(c.depth)):
            try:
                return DirectWriter(self, key, depth=c.depth, in_place=True)
            except DirectUnsupported:
                self.direct = False
        return LocalWriter(self, key, write_behind=self.write_behind, in_place=True)

    def put_after(
        self,
        key: str,
        data: bytes | memoryview,
        after: Sequence[ObjectWriter],
        *,
        if_absent: bool = False,
    ) -> ObjectInfo:
        """:meth:`put` that makes the committed unreferenced writers ``after`` durable
        first: their fsyncs and this object's data fsync run concurrently, then the
        rename (``link(2)`` with ``if_absent``) and the directory fsync.

        Raises:
            TypeError: a writer in ``after`` is not a committed unreferenced writer
                (from :meth:`open_unreferenced`).  Otherwise as :meth:`put`.
        """
        paths: list[str] = []
        for a in after:
            if not isinstance(a, LocalWriter) or not a.unsynced:
                raise TypeError(
                    f"put_after({key!r}): {a!r} is not a committed writer from "
                    "open_unreferenced of a local storage"
                )
            paths += [p for p in a.unsynced if p not in paths]
        w = LocalWriter(self, key, write_behind=False, versioned=True)
        try:
            w.write(data)
            return w.commit(if_absent=if_absent, after=paths)
        finally:
            w.abort()  # closes a still-open temp file and removes it; no-op after commit

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
            if_absent: create only; ``ObjectExists`` when the key exists (``link(2)``
                fails with EEXIST instead of replacing).
            if_match: replace only that version (compare-and-swap, see
                :meth:`LocalWriter.commit_if_match`); ``PreconditionFailed`` otherwise.
        """
        w = LocalWriter(self, key, write_behind=False, versioned=True)
        try:
            w.write(data)
            if if_match is not None:
                if if_absent:
                    raise ValueError("put: if_absent and if_match are exclusive")
                return w.commit_if_match(if_match)
            return w.commit(if_absent=if_absent)
        finally:
            w.abort()  # closes a still-open temp file and removes it; no-op after commit

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object and its version token (inode, mtime, content hash) of one open.

        Raises:
            ObjectNotFound: ``key`` does not exist.
        """
        try:
            return read_versioned(self._path(key))
        except OSError as e:
            raise read_error(e, key, self.url) from e

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
            raise read_error(e, key, self.url) from e

    def get_file(self, key: str, path: str) -> None:
        """Copy ``key`` to the local ``path``, replaced atomically."""
        dest = LocalStorage(os.path.dirname(os.path.abspath(path)))
        dest.put_file(os.path.basename(path), self._path(key))

    def open_read(self, key: str) -> IO[bytes]:
        """An unbuffered binary file (supports ``readinto`` and ``fileno``)."""
        try:
            return open(self._path(key), "rb", buffering=0)
        except OSError as e:
            raise read_error(e, key, self.url) from e

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset`` of ``key`` with ``preadv`` (see ``Storage``; no
        readahead advice: a lone range is often not followed by the next one)."""
        with LocalRanges(self._path(key), key, self.url, sequential=False) as r:
            r.read_into(offset, buf)

    def open_ranges(self, key: str) -> LocalRanges:
        """One descriptor for ranged reads of ``key`` in file order, readahead told the
        access is sequential (:class:`~ckrun.storage.base.ReadsInOrder`).

        Raises:
            ObjectNotFound: ``key`` does not exist.
        """
        return LocalRanges(self._path(key), key, self.url)

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
            raise read_error(e, key, self.url) from e
        if not _is_regular(st.st_mode):
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every regular file whose key starts with ``prefix``, sorted by key.

        Temp files of in-flight or killed writes and symlinks are not objects; an
        object deleted while the listing runs (retention beside a save) is left out.
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
            raise read_error(e, rel or ".", self.url) from e
        for ent in entries:
            key = f"{rel}/{ent.name}" if rel else ent.name
            if ent.name.startswith(TEMP_PREFIX) or ent.is_symlink():
                continue
            if ent.is_dir(follow_symlinks=False):
                if key.startswith(prefix) or prefix.startswith(key + "/"):
                    self._walk(ent.path, key, prefix, out)
            elif ent.is_file(follow_symlinks=False) and key.startswith(prefix):
                try:
                    st = ent.stat(follow_symlinks=False)
                except FileNotFoundError:  # deleted since the directory was read
                    continue  # (retention runs beside saves): no longer an object
                out.append(ObjectInfo(key, st.st_size, st.st_mtime))

    def delete(self, keys: Iterable[str]) -> None:
        """Unlink ``keys`` (missing ones ignored), remove directories left empty (never
        the root) and fsync the first one left standing: durable on return.

        Raises:
            StorageError: a key could not be unlinked.
        """
        unlink_all(self.root, map(self._path, keys), sync=True)

    def delete_lazily(self, keys: Iterable[str]) -> None:
        """:meth:`delete` without its fsync (:class:`~ckrun.storage.base.DeletesLazily`;
        durable with the next journal commit: :mod:`ckrun.storage.local_delete`).  A
        subclass that overrides :meth:`delete` gets its override called instead: it
        keeps seeing every delete.

        Raises:
            StorageError: a key could not be unlinked.
        """
        if type(self).delete is not LocalStorage.delete:
            self.delete(keys)
            return
        unlink_all(self.root, map(self._path, keys), sync=False)

    def sweep_temp(self, prefix: str = "", min_age_s: float = 900.0) -> builtins.list[str]:
        """Remove temp files of killed writers under ``prefix`` (not a Storage method).

        Args:
            prefix: key prefix (directory) to sweep.
            min_age_s: only files not modified for this many seconds (in-flight writes
                of live processes keep touching theirs); files of this process are kept.

        Returns:
            The paths removed, relative to the root.
        """
        top = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        return sweep_temp(self.root, top, min_age_s)


def _is_regular(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)
