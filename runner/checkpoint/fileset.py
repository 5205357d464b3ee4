"""File-set commits: files a framework or script wrote, committed as one ckrun checkpoint.

The Hugging Face Trainer (``checkpoint-N/``), Lightning (``*.ckpt``) and scripts with
their own ``torch.save`` checkpoints write files ckrun did not produce.  This module turns
such a set of files into an ordinary ckrun checkpoint of the run root, so the supervisor,
retention, ``ckrun ls``/``verify`` and the completion marker treat it like any other:

* commit: every file is read into memory (``stat`` before and after must agree: a file
  still being written is refused with :class:`FileSetChanged`), packed into ONE shard of
  the ckrun codec (tree ``{"format": "ckrun.files", "files": [{"name", "size", "crc32c",
  "data"}]}``, the bytes as ``uint8`` arrays, CRC32C over the whole shard), the shard is
  written under an attempt-unique key, and the manifest is written last (the commit:
  DESIGN.md §3).  The manifest's ``metrics["ckrun_files"]`` lists the names and sizes, so
  a reader finds file sets without opening shards.
* restore: the newest manifest whose shard re-hashes (size and CRC32C, then each file's
  own CRC32C) is unpacked into a fresh temporary directory and renamed into place, so a
  reader sees the old files or the complete new set, never a half-written one.

Names are relative paths (``checkpoint-12/optimizer.pt``); ``..`` and absolute names are
refused.  No pickle is involved: file contents are opaque bytes to ckrun.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
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

log = logging.getLogger(__name__)

FORMAT = "ckrun.files"
METRIC = "ckrun_files"


class FileSetChanged(CheckpointError):
    """A file changed (size, mtime or inode) while it was being copied: not committed."""


@dataclass(frozen=True)
class FileSet:
    """A verified, committed file set read back from storage.

    Attributes:
        manifest: the commit.
        files: name -> contents (``uint8`` array), each already checked against its CRC32C.
    """

    manifest: Manifest
    files: dict[str, Any]


def _check_name(name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(name) or norm.startswith("..") or norm in (".", ""):
        raise CheckpointError(f"file-set name {name!r} must be a relative path inside its root")
    return norm.replace(os.sep, "/")


def _stat_sig(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


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
    entries = []
    sizes: dict[str, int] = {}
    for name in sorted(files):
        data = read_stable(files[name])
        n = _check_name(name)
        entries.append(
            {"name": n, "size": int(len(data)), "crc32c": crc32c.crc32c(data), "data": data}
        )
        sizes[n] = int(len(data))
    snap = fmt.snapshot({"format": FORMAT, "files": entries})
    area: layout.Area = "final" if kind == "final" else "checkpoints"
    key = layout.shard_key(step, 0, attempt, area)
    size, checksum = fmt.write_object(storage.open_write(key), snap)
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
        sc = scan(storage)
        broken = [p.step for k, _ in sc.problems if (p := layout.parse(k)) is not None]
        plan = retention.plan(
            storage,
            sc.manifests,
            keep_last=keep_last,
            milestone_every=None,
            protect={m.step} | ({protect} if protect is not None else set()),
            broken_steps=broken,
        )
        retention.apply(storage, plan)
    except StorageError as e:
        log.warning("retention after step %d failed (will retry): %s", m.step, e)


def is_file_set(m: Manifest) -> bool:
    """True for a manifest written by :func:`commit_files`."""
    return isinstance(m.metrics.get(METRIC), dict)


def read_files(storage: Storage, m: Manifest) -> FileSet:
    """Read and verify the file set of ``m`` (whole-shard CRC32C, then per file).

    Raises:
        CorruptCheckpoint: truncated, damaged, or not a file set.
    """
    from ckrun.checkpoint.shard_reader import read_shard

    s = m.shards[0]
    info = storage.head(s.key)
    if info is None or info.size_bytes != s.size_bytes:
        raise CorruptCheckpoint(f"{s.key}: missing or truncated", key=s.key, step=m.step)
    with storage.open_read(s.key) as f:
        tree = read_shard(f, size_bytes=s.size_bytes, checksum=s.checksum, key=s.key)
    if not isinstance(tree, dict) or tree.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{s.key}: not a ckrun file set", key=s.key, step=m.step)
    out: dict[str, Any] = {}
    for e in tree["files"]:
        data = np.asarray(e["data"], dtype=np.uint8)
        if len(data) != e["size"] or crc32c.crc32c(data.data) != e["crc32c"]:
            raise CorruptCheckpoint(f"{s.key}: file {e['name']} fails its checksum", key=s.key)
        out[_check_name(e["name"])] = data
    return FileSet(m, out)


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
    """Write ``data`` to ``path``: temp file, fsync, rename, fsync of the directory."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".ckrun-restore-{os.getpid()}-{os.path.basename(path)}")
    with open(tmp, "wb") as f:
        f.write(np.ascontiguousarray(data).data.cast("B"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(d)


def restore_dir(fs: FileSet, root: str, top: str) -> str:
    """Put the files of ``fs`` under ``top/`` (a name prefix such as ``checkpoint-12``)
    into ``root/top`` as one rename: a half-written directory there is replaced.

    Returns:
        The restored directory's path.
    """
    dest = os.path.join(root, top)
    tmp = os.path.join(root, f".ckrun-restore-{os.getpid()}-{top}")
    shutil.rmtree(tmp, ignore_errors=True)
    for name, data in fs.files.items():
        if name.startswith(top + "/"):
            p = os.path.join(tmp, name[len(top) + 1 :])
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(np.ascontiguousarray(data).data.cast("B"))
                f.flush()
                os.fsync(f.fileno())
    if os.path.exists(dest):
        stale = os.path.join(root, f".ckrun-stale-{os.getpid()}-{top}")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(dest, stale)
        os.replace(tmp, dest)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    _fsync_dir(root)
    return dest


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
