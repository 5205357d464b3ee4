"""One shard's copy to the remote tier, and the remote tier's retention, of the two-tier
storage (:mod:`ckrun.checkpoint.tiering`, steps 1 and 3 of an upload).

A shard is copied in :data:`CHUNK` pieces, its CRC32C computed over every byte read from
the local tier; a shard whose bytes no longer match its manifest is refused
(:class:`~ckrun.errors.CorruptCheckpoint`), and a shard the remote tier already holds
with the same size and CRC32C is not sent again.
"""

from __future__ import annotations

import logging

import crc32c
from ckrun.checkpoint import retention
from ckrun.checkpoint.manifest import Manifest, ShardInfo
from ckrun.errors import CorruptCheckpoint, StorageError
from ckrun.storage.base import Storage
from ckrun.storage.progress import Progress

__all__ = ["CHUNK", "copy_shard", "retain_remote"]

log = logging.getLogger(__name__)

CHUNK = 16 * 1024 * 1024  # bytes read and sent at a time


def copy_shard(local: Storage, remote: Storage, s: ShardInfo) -> int:
    """Upload shard ``s`` from ``local`` to ``remote`` unless ``remote`` has it (same
    size and CRC32C); returns the bytes sent.

    Raises:
        CorruptCheckpoint: the local shard no longer matches the manifest (size or
            CRC32C); what was sent is not committed (no manifest names it remotely).
        StorageError: either tier failed.
    """
    have = remote.head(s.key)
    crc_of = getattr(remote, "crc32c", None)
    if (
        have is not None
        and have.size_bytes == s.size_bytes
        and callable(crc_of)
        and f"crc32c:{crc_of(s.key):08x}" == s.checksum
    ):
        return 0
    crc, n = 0, 0
    bar = Progress(f"upload {s.key}", s.size_bytes)
    with local.open_read(s.key) as src, remote.open_write(s.key) as w, bar:
        while chunk := src.read(CHUNK):
            crc = crc32c.crc32c(chunk, crc)
            n += len(chunk)
            w.write(chunk)
            bar.update(len(chunk))
        if n != s.size_bytes or f"crc32c:{crc:08x}" != s.checksum:
            raise CorruptCheckpoint(
                f"local shard {s.key} changed since its commit ({n} bytes, "
                f"crc32c:{crc:08x}; manifest {s.size_bytes} bytes, {s.checksum}): not "
                "uploaded",
                key=s.key,
            )
    return n


def retain_remote(
    remote: Storage, m: Manifest, *, keep_last: int, milestone_every: int | None
) -> None:
    """Retention on the remote tier after ``m``'s remote commit: never ``m`` nor the
    checkpoint it resumed from; a storage failure is logged (the next upload retries)."""
    try:
        resumed = () if m.resumed_from is None else (m.resumed_from,)
        retention.retain_after(
            remote, m, keep_last=keep_last, milestone_every=milestone_every, protect=resumed
        )
    except StorageError as e:
        log.warning("remote retention after step %d failed (retried next time): %s", m.step, e)
