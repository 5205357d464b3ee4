"""The CRC32C of a shard's big entries, computed on a second thread while the entries
are written (issue 19: the save at the disk's full speed).

A writer that writes behind (page cache, then ``sync_file_range``) spends most of a
big save waiting for the disk, and CRC32C releases the GIL: hashing each big entry
beside its own write takes the hash off the save's time.  Hashed after the shard's
commit instead, the 0.30 GB shard's CRC32C added about a quarter to a write-behind save
on these machines (bench/README.md, fifteenth session).  Entries under
:data:`BESIDE_BYTES` are hashed by the caller as before: a hand-off costs more than
their hash.  The thread starts with the first big entry of a save and ends when its
hashes have been collected.  Started by an async save's persist thread it inherits
``SCHED_IDLE`` and registers, so a caller waiting for that save raises it with the rest
(:mod:`ckrun.storage.priority`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import crc32c
from ckrun.storage import priority

__all__ = ["BESIDE_BYTES", "Beside"]

BESIDE_BYTES = 4 << 20  # an entry this big (bytes) is hashed beside the writes


class Beside:
    """The hashes of one save's big entries, each started before its entry is written;
    the arrays must stay unchanged until :meth:`close` (a synchronous save's state, an
    async save's host copies)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, buf: memoryview, owner: object) -> Future[int] | None:
        """The CRC32C of ``buf`` (an int future) when it is big enough to be worth a
        hand-off, else None (the caller hashes it).  ``owner`` is the array ``buf`` views,
        kept alive until the hash is done: a tensor's byte view does not keep it alive,
        and a save that fails before its hash is collected drops its arrays."""
        if len(buf) < BESIDE_BYTES:
            return None
        if self._pool is None:
            self._pool = priority.inheriting_pool(1, "ckrun-hash")
        return self._pool.submit(_crc32c, buf, owner)

    def close(self) -> None:
        """End the thread once its hashes are done (a pending one is dropped);
        idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _crc32c(buf: memoryview, owner: object) -> int:
    """CRC32C of ``buf``; ``owner`` rides along so that the arguments keep it alive."""
    return int(crc32c.crc32c(buf))
