"""Host buffers of async saves, laid out like the shard file, and a zero-copy writer.

:class:`HostBuffers` copies a snapshot's tensors (and numpy arrays) into one arena that
is allocated once and reused while the state's layout fits.  Each tensor sits at the
offset it has in the shard's data region (:func:`ckrun.checkpoint.st_format.table`:
packed by decreasing element size), so the arena *is* the data region of the file.  The arena is
page-aligned anonymous memory (``mmap``), or pinned memory (``cudaHostAlloc``, also page
aligned) when a tensor lives on a GPU.

:class:`ArenaWriter` is the shard writer of a local ``O_DIRECT`` storage for such a
snapshot: the header block goes through a small aligned buffer, and every tensor that
:func:`ckrun.checkpoint.shard.write_shard` hands it is recognised by address as already
being in place, so the disk DMAs straight from the arena in 32 MiB requests on an I/O
thread (overlapping the CRC32C of the next tensors) with no staging copy.  Bytes that are
not in place (padding, arrays staged elsewhere) are copied into the arena first, so the
file is byte-identical to the buffered writers' (tested).  Measured on 512 MiB: 0.06 s
of CPU instead of 0.16 s for the staging writer, and 25-35 % less wall time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import st_format
from ckrun.errors import CheckpointError, ConfigError, StorageError, map_os_error
from ckrun.storage.base import ObjectInfo, ObjectWriter
from ckrun.storage.local import DirectUnsupported, LocalStorage, LocalWriter

if TYPE_CHECKING:
    import numpy as np

BLOCK = 4096
_S = TypeVar("_S", bound=fmt.Snapshot)
CHUNK = 32 << 20  # bytes per O_DIRECT request
INFLIGHT = 2  # requests queued on the I/O thread


def _round(n: int, a: int = BLOCK) -> int:
    return -(-n // a) * a


class HostBuffers:
    """Reusable host copies of snapshots in the shard's data layout (module docstring)."""

    def __init__(self) -> None:
        self._arena: torch.Tensor | None = None
        self._mmap: mmap.mmap | None = None
        self._pinned = False
        self._sig: tuple[Any, ...] | None = None
        self._views: list[torch.Tensor | np.ndarray[Any, Any]] = []
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the arena."""
        return 0 if self._arena is None else int(self._arena.numel())

    def data_ptr(self) -> int:
        """Address of the arena (0 when none): equal across saves means reused."""
        return 0 if self._arena is None else int(self._arena.data_ptr())

    def _allocate(self, size: int, pinned: bool) -> None:
        self._arena = self._mmap = None  # free the old one first: one copy at a time
        if pinned:  # untested here (no GPU): page-locked memory for DMA from the device
            self._arena = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            # MAP_POPULATE faults the pages in the kernel in one go: 0.33 s/GiB here
            # instead of 0.6 s/GiB of page faults during the first copy
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(-1, size, flags=flags)
            self._arena = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._pinned = pinned
        self.allocations += 1

    def _layout(
        self, snap: fmt.Snapshot, table: list[dict[str, Any]], data_bytes: int, pinned: bool
    ) -> None:
        size = max(_round(data_bytes), BLOCK)
        if self._arena is None or self.nbytes < size or (pinned and not self._pinned):
            self._allocate(size, pinned)
        else:
            self._arena.zero_()  # the padding between tensors must be zeros again
        arena = self._arena
        assert arena is not None
        self._views = []
        for t, e in zip(snap.tensors, table, strict=True):
            raw = arena[e["offset"] : e["offset"] + e["nbytes"]]
            if isinstance(t, torch.Tensor):
                self._views.append(raw.view(t.dtype).view(t.shape))
            else:
                self._views.append(raw.numpy().view(t.dtype).reshape(t.shape))

    def stage(self, snap: _S) -> _S:
        """Copy ``snap``'s tensors and arrays into the arena; a snapshot of the copies.

        Returns once every copy is complete (device copies synchronised).
        """
        table, data_bytes = st_format.table(snap.tensors)
        devices = {
            t.device for t in snap.tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu"
        }
        pinned = any(d.type == "cuda" for d in devices) and torch.cuda.is_available()
        sig = tuple((str(getattr(t, "dtype", "")), tuple(t.shape)) for t in snap.tensors)
        if sig != self._sig or (pinned and not self._pinned):
            self._layout(snap, table, data_bytes, pinned)
            self._sig = sig
        with torch.no_grad():
            for t, dst in zip(snap.tensors, self._views, strict=True):
                if isinstance(dst, torch.Tensor) and isinstance(t, torch.Tensor):
                    dst.copy_(t, non_blocking=self._pinned and t.device.type == "cuda")
                elif not isinstance(dst, torch.Tensor):
                    dst[...] = t
        for d in devices:  # non-blocking device-to-host copies must land before we return
            if d.type == "cuda":
                torch.cuda.current_stream(d).synchronize()
        return dataclasses.replace(snap, tensors=list(self._views))

    def writer_for(self, storage: Any) -> Callable[[str], ObjectWriter] | None:
        """A shard-writer factory writing straight from the arena, or None where that
        does not apply: not a plain local ``O_DIRECT`` storage (a subclass that overrides
        ``open_write`` keeps its own writer), or an unaligned arena."""
        arena = self._arena
        if (
            type(storage) is not LocalStorage
            or not storage.direct
            or arena is None
            or arena.data_ptr() % BLOCK
        ):
            return None
        base, length = int(arena.data_ptr()), int(arena.numel())

        def open_shard(key: str) -> ObjectWriter:
            try:
                return ArenaWriter(storage, key, base, length)
            except DirectUnsupported:
                storage.direct = False
                return storage.open_write(key)

        return open_shard


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


def _address(mv: memoryview) -> int | None:
    if mv.readonly or not mv.c_contiguous or not len(mv):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


class ArenaWriter(LocalWriter):
    """``O_DIRECT`` shard writes straight from a :class:`HostBuffers` arena.

    The first ``write`` is the header block (a multiple of 4096 bytes, as
    :func:`ckrun.checkpoint.shard.write_shard` emits it); every later byte at data
    offset ``r`` must be the arena's byte ``r`` (copied there when it is not already).

    Raises:
        DirectUnsupported: the filesystem refuses ``O_DIRECT``.
    """

    def __init__(self, storage: LocalStorage, key: str, base: int, length: int):
        super().__init__(storage, key, write_behind=False, extra_flags=os.O_DIRECT)
        self._base, self._len = base, length
        self._data_off: int | None = None
        self._head: mmap.mmap | None = None
        self._sent = 0  # data bytes handed to the I/O thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckrun-arena-io")
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
            span = min(_round(k), self._len - self._sent)  # the tail: padded to a block
            mv = memoryview((ctypes.c_char * span).from_address(self._base + self._sent))
            self._submit(mv.cast("B"), self._data_off + self._sent)
            self._sent += k
            if self._rate:  # optional cap: sleep until the bytes sent fit the rate
                time.sleep(max(0.0, self._sent / self._rate - (time.monotonic() - self._t0)))

    def commit(self) -> ObjectInfo:
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
        info = super().commit()
        self._pool.shutdown(wait=True)
        return info

    def abort(self) -> None:
        """Wait for queued writes (ignoring their errors), remove the temp file."""
        for f in self._futs:
            f.exception()
        self._futs.clear()
        self._pool.shutdown(wait=True)
        super().abort()
