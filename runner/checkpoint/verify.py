"""Checking shards against their manifest without deserializing (no torch import).

:func:`head_problems` checks existence and size only (cheap: the supervisor's
preflight); :func:`rehash` streams the whole shard through CRC32C (``ckrun verify``).
"""

from __future__ import annotations

import crc32c
from ckrun.checkpoint.manifest import Manifest, ShardInfo
from ckrun.errors import StorageError
from ckrun.storage.base import Storage

CHUNK = 16 << 20


def head_problems(storage: Storage, m: Manifest) -> list[str]:
    """One line per shard of ``m`` that is missing or has the wrong size."""
    out = []
    for s in m.shards:
        try:
            info = storage.head(s.key)
        except StorageError as e:
            out.append(f"{s.key}: cannot stat ({e})")
            continue
        if info is None:
            out.append(f"{s.key}: missing (step {m.step})")
        elif info.size_bytes != s.size_bytes:
            out.append(
                f"{s.key}: size {info.size_bytes} bytes, manifest says {s.size_bytes}"
                f" (truncated or overwritten)"
            )
    return out


def rehash(storage: Storage, shard: ShardInfo) -> str | None:
    """Re-read ``shard`` and compare size and CRC32C; None when good, else the problem."""
    crc, n = 0, 0
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    try:
        with storage.open_read(shard.key) as f:
            while got := f.readinto(mv):  # type: ignore[attr-defined]
                crc = crc32c.crc32c(mv[:got], crc)
                n += got
    except StorageError as e:
        return f"{shard.key}: cannot read ({e})"
    except OSError as e:
        return f"{shard.key}: read error ({e})"
    if n != shard.size_bytes:
        return f"{shard.key}: size {n} bytes, manifest says {shard.size_bytes}"
    got_sum = f"crc32c:{crc:08x}"
    if got_sum != shard.checksum:
        return f"{shard.key}: checksum mismatch (manifest {shard.checksum}, file {got_sum})"
    return None


def verify_manifest(storage: Storage, m: Manifest) -> list[str]:
    """Every problem of ``m``'s shards after a full re-hash (empty list: good)."""
    out = head_problems(storage, m)
    if out:
        return out
    return [p for s in m.shards if (p := rehash(storage, s)) is not None]
