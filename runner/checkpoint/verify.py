"""Checking shards against their manifest without deserializing (no torch import).

:func:`head_check` checks existence and size only (cheap: the supervisor's preflight);
:func:`verify_shards` streams every shard through CRC32C (``ckrun verify``).  Results
are typed (:class:`ShardProblem` with a :class:`Problem` kind), so callers decide on
the kind, never on the wording of a message:

* ``missing``, ``size``, ``checksum``: conclusive, the shard is bad (fall back, and a
  commit may replace a manifest naming it);
* ``unreadable`` (a local read error such as EIO or EACCES) and ``transient`` (the
  storage could not be reached or kept failing after its retries): the shard could not
  be checked; it may be good, so nothing is deleted on this evidence.

``head_problems``/``rehash``/``verify_manifest`` keep their string forms for callers
that only print.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import crc32c
from ckrun.checkpoint.manifest import Manifest, ShardInfo
from ckrun.errors import CorruptCheckpoint, CorruptObject, ObjectNotFound, StorageError
from ckrun.storage.base import ObjectInfo, Storage

CHUNK = 16 << 20


class Problem(str, enum.Enum):
    """What is wrong with a shard (see the module docstring)."""

    MISSING = "missing"
    SIZE = "size"
    CHECKSUM = "checksum"
    UNREADABLE = "unreadable"
    TRANSIENT = "transient"


CONCLUSIVE = frozenset({Problem.MISSING, Problem.SIZE, Problem.CHECKSUM})


@dataclass(frozen=True)
class ShardProblem:
    """One problem of one shard.

    Attributes:
        key: the shard's key.
        kind: the :class:`Problem`.
        message: one readable line naming the key.
    """

    key: str
    kind: Problem
    message: str

    @property
    def conclusive(self) -> bool:
        """True when the shard is known bad (missing, size, checksum)."""
        return self.kind in CONCLUSIVE

    def __str__(self) -> str:
        return self.message


def head_check(storage: Storage, m: Manifest) -> list[ShardProblem]:
    """The shards of ``m`` that are missing or have the wrong size (by ``head``)."""
    out = []
    for s in m.shards:
        try:
            info = storage.head(s.key)
        except StorageError as e:
            out.append(ShardProblem(s.key, Problem.TRANSIENT, f"{s.key}: cannot stat ({e})"))
            continue
        if info is None:
            out.append(ShardProblem(s.key, Problem.MISSING, f"{s.key}: missing (step {m.step})"))
        elif info.size_bytes != s.size_bytes:
            out.append(
                ShardProblem(
                    s.key,
                    Problem.SIZE,
                    f"{s.key}: size {info.size_bytes} bytes, manifest says {s.size_bytes}"
                    f" (truncated or overwritten)",
                )
            )
    return out


def head_problems(storage: Storage, m: Manifest) -> list[str]:
    """:func:`head_check` as one line per problem."""
    return [p.message for p in head_check(storage, m)]


def rehash_shard(storage: Storage, shard: ShardInfo) -> ShardProblem | None:
    """Re-read ``shard`` and compare size and CRC32C; None when good."""
    crc, n = 0, 0
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    key = shard.key
    try:
        with storage.open_read(key) as f:
            while got := f.readinto(mv):  # type: ignore[attr-defined]
                crc = crc32c.crc32c(mv[:got], crc)
                n += got
    except ObjectNotFound as e:
        return ShardProblem(key, Problem.MISSING, f"{key}: missing ({e})")
    except CorruptObject as e:  # the store's own checksum or length did not match
        return ShardProblem(key, Problem.CHECKSUM, f"{key}: {e}")
    except StorageError as e:
        return ShardProblem(key, Problem.TRANSIENT, f"{key}: cannot read ({e})")
    except OSError as e:
        return ShardProblem(key, Problem.UNREADABLE, f"{key}: read error ({e})")
    if n != shard.size_bytes:
        return ShardProblem(
            key, Problem.SIZE, f"{key}: size {n} bytes, manifest says {shard.size_bytes}"
        )
    got_sum = f"crc32c:{crc:08x}"
    if got_sum != shard.checksum:
        return ShardProblem(
            key,
            Problem.CHECKSUM,
            f"{key}: checksum mismatch (manifest {shard.checksum}, file {got_sum})",
        )
    return None


def rehash(storage: Storage, shard: ShardInfo) -> str | None:
    """:func:`rehash_shard` as a line (None when good)."""
    p = rehash_shard(storage, shard)
    return None if p is None else p.message


def verify_shards(storage: Storage, m: Manifest) -> list[ShardProblem]:
    """Every problem of ``m``'s shards after a full re-hash (empty list: good)."""
    out = head_check(storage, m)
    if out:
        return out
    return [p for s in m.shards if (p := rehash_shard(storage, s)) is not None]


def verify_manifest(storage: Storage, m: Manifest) -> list[str]:
    """:func:`verify_shards` as one line per problem."""
    return [p.message for p in verify_shards(storage, m)]


def shard_present(storage: Storage, s: ShardInfo, step: int) -> ObjectInfo:
    """The shard's object, with the size its manifest records.

    Raises:
        CorruptCheckpoint: the shard is missing or has another size (truncated).
    """
    info = storage.head(s.key)
    if info is None or info.size_bytes != s.size_bytes:
        got = "missing" if info is None else f"{info.size_bytes} bytes"
        raise CorruptCheckpoint(
            f"{s.key}: {got}, manifest says {s.size_bytes} bytes (truncated)",
            key=s.key,
            step=step,
        )
    return info
