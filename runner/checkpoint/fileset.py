"""File-set commits: files a framework or script wrote, committed as one ckrun checkpoint.

The Hugging Face Trainer (``checkpoint-N/``), Lightning (``*.ckpt``) and scripts with
their own ``torch.save`` checkpoints write files ckrun did not produce.  This module turns
such a set of files into an ordinary ckrun checkpoint of the run root, so the supervisor,
retention, ``ckrun ls``/``verify`` and the completion marker treat it like any other:

* commit: the files are streamed, :data:`CHUNK` bytes at a time through one reused
  buffer (host memory stays bounded whatever their size), into ONE shard of the ckrun
  codec: tree ``{"format": "ckrun.files", "files": [{"name", "size", "data"}],
  "crc32c": <uint32 array>}``, each file's bytes as a ``uint8`` array whose size the
  header takes from ``stat``, and the per-file CRC32Cs (computed while streaming) as the
  LAST array of the data region, so one pass suffices.  A file whose inode, size or
  mtime differs after its copy from the ``stat`` taken before is refused with
  :class:`FileSetChanged` (still being written).  The shard (CRC32C over the whole file)
  is written under an attempt-unique key, and the manifest is written last (the commit:
  DESIGN.md §3).  The manifest's ``metrics["ckrun_files"]`` lists the names and sizes, so
  a reader finds file sets without opening shards.
* restore: the newest manifest whose shard re-hashes (size and CRC32C) is opened by its
  header only; each file is streamed out of the shard by ranged reads into a temporary
  file, its own CRC32C checked, then renamed into place (:meth:`FileSet.extract`,
  :func:`restore_dir`), so a reader sees the old files or the complete new set, never a
  half-written one, and never holds a whole file in memory.

Commits written before streaming (each entry with its own ``"crc32c"``) read the same.
Names are relative paths (``checkpoint-12/optimizer.pt``); ``..`` and absolute names are
refused.  No pickle is involved: file contents are opaque bytes to ckrun.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
from ckrun.checkpoint import layout, retention
from ckrun.checkpoint.commit import commit_manifest
from ckrun.checkpoint.discovery import scan
from ckrun.checkpoint.manifest import Manifest, ManifestKind, ShardInfo, utc_now
from ckrun.checkpoint.marker import CompletionMarker
from ckrun.checkpoint.verify import verify_manifest
from ckrun.errors import CheckpointError, CorruptCheckpoint, StorageError
from ckrun.storage.base import Storage
from ckrun.storage.fsutil import fsync_dir, write_pieces, write_pieces_atomic

log = logging.getLogger(__name__)

FORMAT = "ckrun.files"
CHUNK = 8 << 20  # bytes per piece when a file is streamed in or out of a file set
METRIC = "ckrun_files"


class FileSetChanged(CheckpointError):
    """A file changed (size, mtime or inode) while it was being copied: not committed."""


@dataclass(frozen=True)
class FileEntry:
    """Where one file's bytes lie in a file-set shard.

    Attributes:
        name: the file's relative name.
        size: its size in bytes.
        crc32c: the CRC32C of its bytes.
        offset: the byte offset of its first byte in the shard.
    """

    name: str
    size: int
    crc32c: int
    offset: int


@dataclass(frozen=True)
class FileSet:
    """A committed file set, opened by its shard's header (contents stay in storage).

    Attributes:
        manifest: the commit.
        files: name -> :class:`FileEntry`.
        storage: the run root holding the shard.
    """

    manifest: Manifest
    files: dict[str, FileEntry]
    storage: Storage

    def chunks(self, name: str) -> Iterator[memoryview]:
        """The bytes of ``name`` in pieces of at most :data:`CHUNK` (one reused buffer:
        consume each piece before the next); the file's CRC32C is checked after its last
        byte.

        Raises:
            KeyError: no such file in the set.
            CorruptCheckpoint: the bytes fail the file's CRC32C.
            StorageError: the storage failed or the shard is shorter than its header says.
        """
        e, key = self.files[name], self.manifest.shards[0].key
        buf = memoryview(bytearray(min(CHUNK, max(e.size, 1))))
        crc, done = 0, 0
        while done < e.size:
            part = buf[: min(len(buf), e.size - done)]
            self.storage.read_into(key, e.offset + done, part)
            crc = crc32c.crc32c(part, crc)
            done += len(part)
            yield part
        if crc != e.crc32c:
            raise CorruptCheckpoint(f"{key}: file {name} fails its checksum", key=key)

    def read(self, name: str) -> Any:
        """The whole of ``name`` as a ``uint8`` array, checked (for small files: this one
        is held in memory).  Raises as :meth:`chunks`."""
        out = np.empty(self.files[name].size, dtype=np.uint8)
        pos = 0
        for part in self.chunks(name):
            out[pos : pos + len(part)] = np.frombuffer(part, dtype=np.uint8)
            pos += len(part)
        return out

    def extract(self, name: str, path: str) -> None:
        """Write ``name`` to ``path`` atomically (temp file, fsync, rename, directory
        fsync), streamed; a file failing its CRC32C never replaces ``path``.
        Raises as :meth:`chunks`, or OSError from the local file system."""
        write_pieces_atomic(path, self.chunks(name))


def read_stable(path: str) -> Any:
    """The bytes of ``path`` as a ``uint8`` array, refusing a file that changes meanwhile.

    Raises:
        FileSetChanged: size, mtime or inode differ before and after the read.
        OSError: the file cannot be read.
    """
    before = _stat_sig(path)
    data = np.fromfile(path, dtype=np.uint8)
    after = _stat_sig(path)
    if before != after or len(data) != before[1]:
        raise FileSetChanged(f"{path} changed while it was copied (still being written?)")
    return data


def _stream(path: str, before: tuple[int, int, int], crcs: list[int]) -> Iterator[memoryview]:
    """``path``'s ``before[1]`` bytes in :data:`CHUNK` pieces of one reused buffer; its
    CRC32C is appended to ``crcs`` after the last piece.

    Raises:
        FileSetChanged: the file is shorter than its ``stat`` said, or its ``stat``
            differs from ``before`` after the copy (still being written?).
    """
    size = before[1]
    buf = memoryview(bytearray(min(CHUNK, max(size, 1))))
    crc, done = 0, 0
    with open(path, "rb", buffering=0) as f:
        while done < size:
            got = f.readinto(buf[: min(len(buf), size - done)])
            if not got:
                raise FileSetChanged(f"{path} shrank while it was copied (still being written?)")
            crc = crc32c.crc32c(buf[:got], crc)
            done += got
            yield buf[:got]
    if _stat_sig(path) != before:
        raise FileSetChanged(f"{path} changed while it was copied (still being written?)")
    crcs.append(crc)


def _crc_table(crcs: list[int], n: int) -> Iterator[memoryview]:
    """The per-file CRC32Cs as ``<u4`` (pulled after every file was streamed)."""
    if len(crcs) != n:
        raise CheckpointError(f"file-set CRC table has {len(crcs)} of {n} entries")
    yield memoryview(np.asarray(crcs, dtype="<u4").tobytes())


def _check_name(name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm.startswith("..") or norm in (".", ""):
        raise CheckpointError(f"file-set name {name!r} must be a relative path inside its root")
    return norm.replace(os.sep, "/")


def _stat_sig(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def commit_files(
    storage: Storage,
    step: int,
    files: Mapping[str, str],
    *,
    run: str,
    attempt: int,
    kind: str = "recovery",
    compat: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    keep_last: int = 3,
    resumed_from: int | None = None,
) -> Manifest:
    """Commit the local ``files`` (name -> path) as checkpoint ``step`` of ``storage``.

    ``kind="final"`` writes the final artifact and then ``COMPLETE.json``.  Other kinds
    run retention (``keep_last`` newest recovery checkpoints) after the commit.

    Raises:
        FileSetChanged: a file was being written during the copy (nothing committed).
        CheckpointError: a bad name or step; StepAlreadyCommitted for another writer's
            commit of this step.
        StorageError: the storage failed; the previous checkpoint is intact.
    """
    from ckrun.checkpoint import shard as fmt

    started, created = time.monotonic(), utc_now()
    if step < 0:
        raise CheckpointError(f"step must be >= 0, got {step}")
    entries: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    pieces: list[Iterator[memoryview]] = []
    sizes: dict[str, int] = {}
    crcs: list[int] = []
    off = 0
    for i, name in enumerate(sorted(files)):
        n = _check_name(name)
        sig = _stat_sig(files[name])
        off = fmt.align_up(off, fmt.TENSOR_ALIGN)
        table.append({"np": "|u1", "shape": [sig[1]], "offset": off, "nbytes": sig[1]})
        off += sig[1]
        entries.append({"name": n, "size": sig[1], "data": {fmt.TAG: "ndarray", "i": i}})
        pieces.append(_stream(files[name], sig, crcs))
        sizes[n] = sig[1]
    off = fmt.align_up(off, fmt.TENSOR_ALIGN)
    table.append({"np": "<u4", "shape": [len(entries)], "offset": off, "nbytes": 4 * len(entries)})
    pieces.append(_crc_table(crcs, len(entries)))
    tree = {"format": FORMAT, "files": entries, "crc32c": {fmt.TAG: "ndarray", "i": len(entries)}}
    area: layout.Area = "final" if kind == "final" else "checkpoints"
    key = layout.shard_key(step, 0, attempt, area)
    w = storage.open_write(key)
    try:
        size, checksum = fmt.write_stream(w, tree, table, off + 4 * len(entries), pieces)
        w.commit()
    except BaseException:
        w.abort()
        raise
    info = storage.head(key)
    if info is None or info.size_bytes != size:
        raise StorageError(f"{key}: reads back as {info}, expected {size} bytes")
    m = Manifest(
        run=run,
        step=step,
        kind=ManifestKind(kind),
        attempt=attempt,
        world_size=1,
        shards=(ShardInfo(key, 0, size, checksum),),
        compat=dict(compat or {}),
        metrics={**dict(metrics or {}), METRIC: sizes},
        resumed_from=resumed_from,
        created_utc=created,
        committed_utc=utc_now(),
        save_duration_s=round(time.monotonic() - started, 6),
        versions={},
        key=layout.manifest_key(step, area),
    )
    m = commit_manifest(storage, m)
    if kind == "final":
        storage.put(layout.COMPLETE, CompletionMarker.for_manifest(m).dumps())
    else:
        retain(storage, m, keep_last=keep_last, protect=resumed_from)
    log.info("committed file set step %d (%s, %d files, %d bytes)", step, kind, len(sizes), size)
    return m


def retain(storage: Storage, m: Manifest, *, keep_last: int, protect: int | None) -> None:
    """Retention after committing ``m`` (failures are logged: the commit stands)."""
    try:
        protected = () if protect is None else (protect,)
        retention.retain_after(
            storage, m, keep_last=keep_last, milestone_every=None, protect=protected
        )
    except StorageError as e:
        log.warning("retention after step %d failed (will retry): %s", m.step, e)


def is_file_set(m: Manifest) -> bool:
    """True for a manifest written by :func:`commit_files`."""
    return isinstance(m.metrics.get(METRIC), dict)


def read_files(storage: Storage, m: Manifest) -> FileSet:
    """Open the file set of ``m`` by its shard's header (the files' bytes are read and
    checked per file by :meth:`FileSet.chunks`; :func:`newest` also re-hashes the shard).

    Raises:
        CorruptCheckpoint: truncated, a damaged header, or not a file set.
    """
    from ckrun.checkpoint.shard import TAG
    from ckrun.checkpoint.shard_reader import read_header

    s = m.shards[0]
    info = storage.head(s.key)
    if info is None or info.size_bytes != s.size_bytes:
        raise CorruptCheckpoint(f"{s.key}: missing or truncated", key=s.key, step=m.step)
    with storage.open_read(s.key) as f:
        meta, data_offset = read_header(f, size_bytes=s.size_bytes, key=s.key)
    tree, table = meta["tree"], meta["tensors"]

    def array(ref: Any) -> dict[str, Any]:
        i = ref.get(TAG) == "ndarray" and ref.get("i") if isinstance(ref, dict) else None
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(table):
            raise CorruptCheckpoint(f"{s.key}: malformed file-set entry", key=s.key)
        return dict(table[i])

    if not isinstance(tree, dict) or tree.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{s.key}: not a ckrun file set", key=s.key, step=m.step)
    crcs: list[int] | None = None
    if "crc32c" in tree:  # streamed commits: the per-file CRC32Cs are the last array
        t = array(tree["crc32c"])
        raw = memoryview(bytearray(t["nbytes"]))
        storage.read_into(s.key, data_offset + t["offset"], raw)
        crcs = [int(c) for c in np.frombuffer(raw, dtype="<u4")]
    out: dict[str, FileEntry] = {}
    for i, e in enumerate(tree["files"]):
        t = array(e["data"])
        crc = e.get("crc32c") if crcs is None else (crcs[i] if i < len(crcs) else None)
        if t["nbytes"] != e["size"] or not isinstance(crc, int):
            raise CorruptCheckpoint(f"{s.key}: malformed entry for {e['name']!r}", key=s.key)
        name = _check_name(e["name"])
        out[name] = FileEntry(name, e["size"], crc, data_offset + t["offset"])
    return FileSet(m, out, storage)


def newest(
    storage: Storage, *, prefix: str | None = None, final: bool | None = None
) -> FileSet | None:
    """The newest file set that verifies, optionally only those with a name under
    ``prefix`` and of the final (True) or non-final (False) kind; damaged ones are
    logged and skipped for the next older one."""
    for m in scan(storage).manifests:
        if not is_file_set(m) or (final is not None and (m.kind == "final") != final):
            continue
        names = m.metrics[METRIC]
        if prefix is not None and not any(str(n).startswith(prefix) for n in names):
            continue
        problems = verify_manifest(storage, m)
        if problems:
            log.warning("file set step %d is unusable: %s", m.step, "; ".join(problems))
            continue
        try:
            return read_files(storage, m)
        except CorruptCheckpoint as e:
            log.warning("file set step %d is unusable: %s", m.step, e)
    return None


def write_atomic(path: str, data: Any) -> None:
    """Write ``data`` (bytes or a ``uint8`` array) to ``path``: temp file, fsync, rename,
    fsync of the directory."""
    write_pieces_atomic(path, [np.ascontiguousarray(data).data.cast("B")])


def restore_dir(fs: FileSet, root: str, top: str) -> str:
    """Put the files of ``fs`` under ``top/`` (a name prefix such as ``checkpoint-12``)
    into ``root/top`` as one rename: a half-written directory there is replaced.  Each
    file is streamed and checked (:meth:`FileSet.chunks`) before the rename.

    Returns:
        The restored directory's path.

    Raises:
        CorruptCheckpoint: a file fails its CRC32C (``root/top`` is left as it was).
    """
    dest = os.path.join(root, top)
    tmp = os.path.join(root, f".ckrun-restore-{os.getpid()}-{top}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name in fs.files:
            if name.startswith(top + "/"):
                p = os.path.join(tmp, name[len(top) + 1 :])
                os.makedirs(os.path.dirname(p), exist_ok=True)
                write_pieces(p, fs.chunks(name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(dest):
        stale = os.path.join(root, f".ckrun-stale-{os.getpid()}-{top}")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(dest, stale)
        os.replace(tmp, dest)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    fsync_dir(root)
    return dest
