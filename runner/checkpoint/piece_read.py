"""Verified reads of a checkpoint's saved pieces into their destinations (issue 19,
"load at read speed"; the pieces and their destinations are
:mod:`ckrun.checkpoint.inplace_load`'s).

A storage that reads in order (:class:`ckrun.storage.base.ReadsInOrder`: local disks)
reads each shard front to back through one handle, the kernel's readahead keeping the
disk busy; a piece of :data:`OVERLAP_BYTES` or more is checked (CRC32C, which releases
the GIL) on a second thread while the next piece is read, so on a disk that reads slower
than CRC32C hashes (4 GB/s against 16 GB/s on the benchmark VM) the check costs the load
no time; checked in series it added about a fifth (bench/README.md, fifteenth session).
Otherwise (S3) :data:`READ_DEPTH` ranged reads are in flight, each checked as it lands.
Either way every piece has been checked, or the read has stopped at the first mismatch,
when :func:`read_pieces` returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import crc32c
import torch
from ckrun.checkpoint.manifest import Manifest
from ckrun.errors import CorruptCheckpoint, ObjectNotFound
from ckrun.storage.base import RangeReader, ReadsInOrder, Storage

__all__ = ["OVERLAP_BYTES", "READ_DEPTH", "Piece", "read_pieces"]

READ_DEPTH = 4  # ranged reads in flight where the storage is not ReadsInOrder (S3)
OVERLAP_BYTES = 1 << 20  # a piece this big (bytes) is checked beside the next read


@dataclass
class Piece:
    """One saved piece and where its bytes go.

    Attributes:
        key, begin: the shard holding it and its first byte there.
        buf: the destination bytes (the live tensor's own rows, or ``piece``'s).
        crc: the manifest's ``crc32c:xxxxxxxx`` of those bytes.
        what, name: the entry and the global tensor (for messages and the record).
        dest, inplace: the tensor it belongs to, and whether that is a live tensor.
        copy_to, piece: a box of other dimensions is read into ``piece``, checked, then
            copied into ``copy_to`` (a view of ``dest``).
    """

    key: str
    begin: int
    buf: memoryview
    crc: str
    what: str
    name: str
    dest: torch.Tensor
    inplace: bool
    copy_to: torch.Tensor | None = None
    piece: torch.Tensor | None = None


def read_pieces(
    storage: Storage, m: Manifest, pieces: list[Piece], mark: Callable[[Piece], None]
) -> None:
    """Read and check ``pieces`` (sorted by key and offset) of ``m``; ``mark`` is called
    with each piece before its first byte lands.

    Raises:
        CorruptCheckpoint: a missing or truncated shard, or a CRC32C mismatch (the
            message names the key and the entry).
        StorageError: the storage failed otherwise.
    """

    def run(p: Piece) -> None:
        mark(p)
        _fill(storage, m, p)
        _verify(m, p)

    rest = pieces
    if isinstance(storage, ReadsInOrder):  # a local disk: each shard front to back
        rest = []
        for key in sorted({p.key for p in pieces}):
            mine = [p for p in pieces if p.key == key]
            try:
                reader = storage.open_ranges(key)
            except ObjectNotFound as e:
                raise CorruptCheckpoint(f"{key}: missing ({e})", key=key, step=m.step) from e
            if reader is None:  # declined for this key (a remote tier): ranged reads
                rest += mine
                continue
            with reader:
                _read_in_order(storage, m, mine, reader, mark)
    if len(rest) <= 1:
        for p in rest:
            run(p)
        return
    with ThreadPoolExecutor(READ_DEPTH) as pool:
        futs: list[Future[None]] = [pool.submit(run, p) for p in rest]
        wait(futs, return_when=FIRST_EXCEPTION)
        for f in futs:
            f.cancel()  # not started yet: never started (running ones finish)
        for f in futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]


def _read_in_order(
    storage: Storage,
    m: Manifest,
    pieces: list[Piece],
    reader: RangeReader,
    mark: Callable[[Piece], None],
) -> None:
    """One shard's ``pieces`` read front to back through ``reader``, each big one
    checked on a second thread beside the next read (module docstring); a mismatch
    stops the reading at the next piece, and every check has ended on return."""
    checker: ThreadPoolExecutor | None = None
    checks: deque[Future[None]] = deque()
    try:
        for p in pieces:
            while checks and checks[0].done():
                checks.popleft().result()
            mark(p)
            _fill(storage, m, p, reader)
            if len(p.buf) < OVERLAP_BYTES:  # a hand-off would cost more than the CRC
                _verify(m, p)
                continue
            if checker is None:
                checker = ThreadPoolExecutor(1, thread_name_prefix="ckrun-verify")
            checks.append(checker.submit(_verify, m, p))
        while checks:
            checks.popleft().result()
    finally:
        if checker is not None:
            checker.shutdown(wait=True, cancel_futures=True)


def _fill(storage: Storage, m: Manifest, p: Piece, reader: RangeReader | None = None) -> None:
    """The bytes of ``p`` into ``p.buf``: one ranged read, through ``reader`` if given."""
    if len(p.buf):
        try:
            if reader is not None:
                reader.read_into(p.begin, p.buf)
            else:
                storage.read_into(p.key, p.begin, p.buf)
        except ObjectNotFound as e:
            raise CorruptCheckpoint(f"{p.key}: missing ({e})", key=p.key, step=m.step) from e


def _verify(m: Manifest, p: Piece) -> None:
    """The CRC32C of the bytes :func:`_fill` read against the manifest's; then a box's
    piece is copied into place."""
    got = f"crc32c:{crc32c.crc32c(p.buf):08x}" if len(p.buf) else "crc32c:00000000"
    if got != p.crc:
        raise CorruptCheckpoint(
            f"{p.key}: checksum mismatch in {p.what} (CRC32C mismatch: manifest {p.crc}, "
            f"read {got})",
            key=p.key,
            step=m.step,
        )
    if p.copy_to is not None and p.piece is not None:
        with torch.no_grad():
            p.copy_to.copy_(p.piece)
