"""``O_DIRECT`` streaming writes for :class:`ckrun.storage.local.LocalStorage`.

:class:`DirectWriter` (any bytes, staged) is the default writer of ``open_write``;
:class:`ArenaWriter` writes from a caller's page-aligned buffer in place
(:meth:`ckrun.storage.local.LocalStorage.in_place_writer`, used by async saves).

DirectWriter: data is copied into page-aligned staging buffers of :data:`STAGE_BYTES`, one
more than the writes it keeps outstanding (two at depth 1); writer threads write full
buffers with ``O_DIRECT`` (DMA from the buffer, no page cache) while the caller fills the
next one, so the copy overlaps the disk.  Every request carries a whole staging buffer
of 16 MiB up to depth 8 (deeper, the buffers share :data:`MAX_STAGING`): on this
project's virtio disk, depth 4 with the 32 MiB of staging
split five ways (6.4 MiB requests) saved 0.28 GB in 1.22× the time of a raw
O_DIRECT write and 12.8 MiB requests in 1.03×, against 0.86× with 16 MiB requests (8
interleaved rounds, bench/README.md, nineteenth session).  The copy is a
``ctypes.memmove``, which releases the GIL: a slice assignment would hold it, and the
writer thread would then wait up to the 5 ms switch interval after every write
(measured: the save ran at 0.64-0.76x of the O_DIRECT limit with it).  The tail is
padded to the 4096-byte block and the file truncated to its real length before the
fsync.  The default of ``LocalStorage``; bench/README.md has the measurements.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from ckrun.errors import CheckpointError, ConfigError, StorageError, map_os_error
from ckrun.storage import priority
from ckrun.storage.base import ObjectInfo
from ckrun.storage.local_writer import LocalRoot, LocalWriter

STAGE_BYTES = 16 << 20
BLOCK = 4096
CHUNK = 32 << 20  # bytes per O_DIRECT request of an ArenaWriter
INFLIGHT = 2  # requests an ArenaWriter queues on its I/O thread


#: Staging memory of one writer at most (bytes): up to depth 8 every request carries
#: :data:`STAGE_BYTES`; a deeper writer (``CKRUN_WRITER=direct:N``) shares this much.
MAX_STAGING = 9 * STAGE_BYTES

_free: dict[int, list[mmap.mmap]] = {}  # staging buffers kept for the next writer, by size
_free_lock = threading.Lock()
KEEP_FREE = 9  # buffers of each size kept at most (a depth-8 writer's; see keep_free)


def _take(size: int, n: int) -> list[mmap.mmap]:
    """``n`` page-aligned staging buffers of ``size`` bytes, reused when a writer gave
    some back: a fresh mapping costs a page fault per 4 KiB on its first fill (about
    10 ms per save of the 32 MiB here, more under load; issue 19, small states)."""
    with _free_lock:
        pool = _free.setdefault(size, [])
        got = [pool.pop() for _ in range(min(n, len(pool)))]
    return got + [mmap.mmap(-1, size) for _ in range(n - len(got))]


def _give_back(bufs: list[mmap.mmap]) -> None:
    with _free_lock:
        for b in bufs:
            pool = _free.setdefault(len(b), [])
            if len(pool) < KEEP_FREE:
                pool.append(b)


def keep_free(depth: int | None) -> None:
    """Keep only the free staging buffers a writer of ``depth`` takes (None: none), the
    most recently used first: after the probe (:mod:`ckrun.storage.probe`) has written
    with every candidate, the process holds the chosen writer's staging, not the
    deepest candidate's (a ``writebehind`` choice holds none)."""
    n = 0 if depth is None else max(1, depth) + 1
    size = 0 if depth is None else stage_bytes(depth)
    with _free_lock:
        for k, pool in _free.items():
            keep = n if k == size else 0
            del pool[: max(0, len(pool) - keep)]  # pop() takes from the end: kept


def stage_bytes(depth: int) -> int:
    """Bytes of one staging buffer, and of one ``O_DIRECT`` request, of a
    :class:`DirectWriter` with ``depth`` writes outstanding: :data:`STAGE_BYTES` up to
    depth 8 (module docstring: smaller requests ran slower), then ``depth + 1`` buffers
    sharing :data:`MAX_STAGING` (whole blocks).  An object that fits in one is written
    through the page cache at its commit (:meth:`DirectWriter._write_small`), so a
    caller that knows the size in advance can open a buffered writer instead and skip
    the staging copy (:meth:`ckrun.storage.local.LocalStorage.open_unreferenced`)."""
    share = MAX_STAGING // (max(1, depth) + 1) // BLOCK * BLOCK
    return max(BLOCK, min(STAGE_BYTES, share))


def _address(mv: memoryview) -> int | None:
    """Address of a writable contiguous buffer (tensor memory), None for read-only ones."""
    if mv.readonly or not mv.c_contiguous or not len(mv):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


class DirectWriter(LocalWriter):
    """A :class:`LocalWriter` that writes through ``O_DIRECT`` (see module docstring).

    Args:
        depth: ``O_DIRECT`` writes kept outstanding (each from its own staging buffer
            of :data:`STAGE_BYTES`, at an explicit offset with ``pwrite``), chosen per
            storage location by :mod:`ckrun.storage.probe`; 1 is the classic double
            buffer (one write in flight while the caller fills the other buffer).
            Staging memory is ``(depth + 1) * STAGE_BYTES``: 32 MiB at depth 1, 80 MiB
            at depth 4, at most :data:`MAX_STAGING` (144 MiB) at any depth, reused by
            the next writer.
        in_place: an unreferenced object under its final key (:class:`LocalWriter`).

    Raises:
        ckrun.storage.local.DirectUnsupported: the filesystem refuses ``O_DIRECT``.
    """

    def __init__(self, storage: LocalRoot, key: str, *, depth: int = 1, in_place: bool = False):
        super().__init__(
            storage, key, write_behind=False, extra_flags=os.O_DIRECT, in_place=in_place
        )
        self.depth = max(1, depth)
        nbuf = self.depth + 1
        size = stage_bytes(self.depth)
        self._stage = size
        self._bufs = _take(size, nbuf)
        self._addrs = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in self._bufs]
        self._pending: list[Future[int] | None] = [None] * nbuf
        self._cur = 0
        self._fill = 0
        self._off = 0  # file offset of the current buffer's first byte
        self._pool = priority.inheriting_pool(
            self.depth, "ckrun-odirect"
        )  # raised with the persist

    def _wait(self, i: int) -> None:
        f = self._pending[i]
        self._pending[i] = None
        if f is not None:
            try:
                f.result()
            except OSError as e:
                raise map_os_error(e, path=self._final, nbytes=self.bytes_written) from e

    def _write_all(self, i: int, n: int, off: int) -> int:
        assert self._fd is not None
        mv = memoryview(self._bufs[i])[:n]
        done = 0
        while done < n:  # one thread writes in order; several write at their offsets
            if self.depth == 1:
                done += os.write(self._fd, mv[done:])
            else:
                done += os.pwrite(self._fd, mv[done:], off + done)
        return done

    def _submit(self, n: int) -> None:
        i = self._cur
        self._pending[i] = self._pool.submit(self._write_all, i, n, self._off)
        self._off += n
        self._cur = (i + 1) % len(self._bufs)
        self._wait(self._cur)  # the next buffer must be on disk before it is refilled
        self._fill = 0

    def _write_small(self, n: int) -> None:
        """Write the first ``n`` staged bytes through the page cache (``O_DIRECT``
        cleared with ``fcntl(F_SETFL)``): for an object smaller than one staging buffer
        a thread hand-off, block padding and ``ftruncate`` cost more than the write;
        the commit's fsync makes it durable all the same (issue 19, small states)."""
        import fcntl

        assert self._fd is not None
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        mv = memoryview(self._bufs[self._cur])[:n]
        done = 0
        while done < n:
            done += os.write(self._fd, mv[done:])

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Copy ``data`` into the staging buffers, writing each full one (bytes)."""
        if self._fd is None:
            raise StorageError(f"write to {self.key} after commit/abort")
        mv = memoryview(data).cast("B")
        total = len(mv)
        src = _address(mv)
        off = 0
        while off < total:
            k = min(self._stage - self._fill, total - off)
            if src is not None:  # ctypes.memmove releases the GIL: the writer threads run
                ctypes.memmove(self._addrs[self._cur] + self._fill, src + off, k)
            else:
                self._bufs[self._cur][self._fill : self._fill + k] = mv[off : off + k]
            self._fill += k
            off += k
            if self._fill == self._stage:
                self._submit(self._stage)
        self.bytes_written += total
        return total

    def commit(self, *, if_absent: bool = False, after: Sequence[str] = ()) -> ObjectInfo:
        """Write the padded tail, wait, truncate to the real size, then as LocalWriter."""
        if self._fd is None:
            raise StorageError(f"commit of {self.key} after commit/abort")
        try:
            n = self._fill
            small = self._off == 0  # still all in the first buffer (or empty)
            if small:
                self._write_small(n)  # one buffered write, no I/O thread, no truncate
            elif n:
                padded = -(-n // BLOCK) * BLOCK
                self._bufs[self._cur][n:padded] = bytes(padded - n)
                self._submit(padded)
            for i in range(len(self._bufs)):
                self._wait(i)
            if not small:
                os.ftruncate(self._fd, self.bytes_written)
        except OSError as e:
            self.abort()
            raise map_os_error(e, path=self._final, nbytes=self.bytes_written) from e
        except StorageError:
            self.abort()
            raise
        info = super().commit(if_absent=if_absent, after=after)
        self._close_pool()
        return ObjectInfo(info.key, info.size_bytes, time.time())

    def abort(self) -> None:
        """Wait for in-flight writes (ignoring their errors), then remove the temp file."""
        for f in self._pending:
            if f is not None:
                f.exception()
        self._pending = [None] * len(self._bufs)
        self._close_pool()
        super().abort()

    def _close_pool(self) -> None:
        self._pool.shutdown(wait=True)  # no write in flight: the buffers are free again
        bufs, self._bufs = self._bufs, []
        _give_back(bufs)


def _max_rate() -> float:
    """``CKRUN_PERSIST_MAX_MBPS`` in bytes/s (0: no cap), the optional persist rate cap.

    Raises:
        ConfigError: not a number >= 0.
    """
    raw = os.environ.get("CKRUN_PERSIST_MAX_MBPS", "").strip()
    try:
        v = float(raw) if raw else 0.0
    except ValueError:
        v = -1.0
    if not v >= 0:
        raise ConfigError(f"CKRUN_PERSIST_MAX_MBPS={raw!r}: expected MB/s >= 0 (0: no cap)")
    return v * 1e6


class ArenaWriter(LocalWriter):
    """``O_DIRECT`` shard writes straight from a :class:`HostBuffers` arena.

    The first ``write`` is the header block (a multiple of 4096 bytes, as
    :func:`ckrun.checkpoint.shard.write_shard` emits it); every later byte at data
    offset ``r`` must be the arena's byte ``r`` (copied there when it is not already).
    The arena is ``length`` bytes of page-aligned memory at address ``base``, kept alive
    by the caller until the commit (:class:`ckrun.checkpoint.host_buffers.HostBuffers`).

    Raises:
        DirectUnsupported: the filesystem refuses ``O_DIRECT``.
    """

    def __init__(self, storage: LocalRoot, key: str, base: int, length: int):
        super().__init__(storage, key, write_behind=False, extra_flags=os.O_DIRECT)
        self._base, self._len = base, length
        self._data_off: int | None = None
        self._head: mmap.mmap | None = None
        self._sent = 0  # data bytes handed to the I/O thread
        self._pool = priority.inheriting_pool(1, "ckrun-arena-io")  # raised with the persist
        self._futs: deque[Future[None]] = deque()
        self._rate = _max_rate()
        self._t0 = time.monotonic()

    def _pwrite(self, mv: memoryview, off: int) -> None:
        assert self._fd is not None
        done = 0
        while done < len(mv):
            done += os.pwrite(self._fd, mv[done:], off + done)

    def _submit(self, mv: memoryview, off: int) -> None:
        self._futs.append(self._pool.submit(self._pwrite, mv, off))
        while len(self._futs) > INFLIGHT:
            self._futs.popleft().result()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Accept ``data`` (see class docstring); returns its length in bytes."""
        if self._fd is None:
            raise StorageError(f"write to {self.key} after commit/abort")
        mv = memoryview(data).cast("B")
        n = len(mv)
        try:
            if self._data_off is None:
                self._header(mv)
                return n
            rel = self.bytes_written - self._data_off
            if rel + n > self._len:
                raise CheckpointError(
                    f"{self.key}: shard data exceeds the host buffers "
                    f"({rel + n} > {self._len} bytes)"
                )
            src = _address(mv)
            if n and src != self._base + rel:  # not in place: copy it into the arena
                ctypes.memmove(self._base + rel, src if src is not None else mv.tobytes(), n)
            self.bytes_written += n
            self._flush(final=False)
        except OSError as e:
            raise map_os_error(e, path=self._final, nbytes=n) from e
        return n

    def _header(self, mv: memoryview) -> None:
        if len(mv) % BLOCK:
            raise CheckpointError(
                f"{self.key}: the shard header block is {len(mv)} bytes, "
                "not a multiple of 4096 (format changed?)"
            )
        self._data_off = len(mv)
        self._head = mmap.mmap(-1, max(len(mv), BLOCK))
        self._head.write(mv)
        self._submit(memoryview(self._head)[: len(mv)], 0)
        self.bytes_written = len(mv)

    def _flush(self, final: bool) -> None:
        assert self._data_off is not None
        ready = self.bytes_written - self._data_off
        while ready - self._sent >= CHUNK or (final and ready > self._sent):
            k = min(CHUNK, ready - self._sent)
            span = min(
                -(-k // BLOCK) * BLOCK, self._len - self._sent
            )  # the tail: padded to a block
            mv = memoryview((ctypes.c_char * span).from_address(self._base + self._sent))
            self._submit(mv.cast("B"), self._data_off + self._sent)
            self._sent += k
            if self._rate:  # optional cap: sleep until the bytes sent fit the rate
                time.sleep(max(0.0, self._sent / self._rate - (time.monotonic() - self._t0)))

    def commit(self, *, if_absent: bool = False, after: Sequence[str] = ()) -> ObjectInfo:
        """Write the tail, wait for the I/O thread, truncate, then as LocalWriter."""
        if self._fd is None:
            raise StorageError(f"commit of {self.key} after commit/abort")
        try:
            if self._data_off is not None:
                self._flush(final=True)
            while self._futs:
                self._futs.popleft().result()
            os.ftruncate(self._fd, self.bytes_written)
        except OSError as e:
            self.abort()
            raise map_os_error(e, path=self._final, nbytes=self.bytes_written) from e
        except BaseException:
            self.abort()
            raise
        info = super().commit(if_absent=if_absent, after=after)
        self._pool.shutdown(wait=True)
        return info

    def abort(self) -> None:
        """Wait for queued writes (ignoring their errors), remove the temp file."""
        for f in self._futs:
            f.exception()
        self._futs.clear()
        self._pool.shutdown(wait=True)
        super().abort()
