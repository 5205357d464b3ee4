"""Host buffers of async saves, laid out like the shard file, and a zero-copy writer.

:class:`HostBuffers` copies a snapshot's tensors (and numpy arrays) into one arena that
is allocated once and reused while the state's layout fits.  Each tensor sits at the
offset it has in the shard's data region (:func:`ckrun.checkpoint.st_format.table`:
packed by decreasing element size), so the arena *is* the data region of the file.  The arena is
anonymous memory on transparent huge pages (:func:`ckrun.storage.hugepages.hugepage_arena`:
4 MiB ``O_DIRECT`` requests instead of 1 MiB ones, 6-10x less system CPU and ~30x fewer
disk interrupts per GiB here), or pinned memory (``cudaHostAlloc``, page aligned) when a
tensor lives on a GPU.

:class:`~ckrun.storage.direct.ArenaWriter` is the shard writer of a local ``O_DIRECT``
storage for such a snapshot (:meth:`HostBuffers.writer_for`, through the storage's
:class:`~ckrun.storage.base.WritesInPlace` capability): the header block goes
through a small aligned buffer, and every tensor that
:func:`ckrun.checkpoint.shard.write_shard` hands it is recognised by address as already
being in place, so the disk DMAs straight from the arena in 32 MiB requests on an I/O
thread (overlapping the CRC32C of the next tensors) with no staging copy.  Bytes that are
not in place (padding, arrays staged elsewhere) are copied into the arena first, so the
file is byte-identical to the buffered writers' (tested).  Measured on 512 MiB: 0.06 s
of CPU instead of 0.16 s for the staging writer, and 25-35 % less wall time.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import st_format
from ckrun.storage.base import ObjectWriter, Storage, WritesInPlace
from ckrun.storage.direct import BLOCK, CHUNK, ArenaWriter
from ckrun.storage.hugepages import hugepage_arena

__all__ = ["CHUNK", "ArenaWriter", "HostBuffers"]

if TYPE_CHECKING:
    import numpy as np


_S = TypeVar("_S", bound=fmt.Snapshot)


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
        self.hugepages = False  # the kernel took MADV_HUGEPAGE for the arena

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
            self._mmap, offset, self.hugepages = hugepage_arena(size)
            self._arena = torch.frombuffer(self._mmap, dtype=torch.uint8, count=size, offset=offset)
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

    def destinations(self, snap: fmt.Snapshot) -> list[torch.Tensor | np.ndarray[Any, Any]]:
        """The arena's views that ``snap``'s tensors and arrays are copied into, in order
        (laid out, or reused when the layout fits; nothing is copied here).  The lazy
        snapshot (:mod:`ckrun.checkpoint.lazy_snapshot`) fills them tensor by tensor."""
        table, data_bytes = st_format.table(snap.tensors)
        pinned = torch.cuda.is_available() and any(
            isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in snap.tensors
        )
        sig = tuple((str(getattr(t, "dtype", "")), tuple(t.shape)) for t in snap.tensors)
        if sig != self._sig or (pinned and not self._pinned):
            self._layout(snap, table, data_bytes, pinned)
            self._sig = sig
        return list(self._views)

    def stage(self, snap: _S) -> _S:
        """Copy ``snap``'s tensors and arrays into the arena; a snapshot of the copies.

        Returns once every copy is complete (device copies synchronised).
        """
        devices = {
            t.device for t in snap.tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu"
        }
        self.destinations(snap)
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

    def writer_for(self, storage: Storage) -> Callable[[str], ObjectWriter] | None:
        """A shard-writer factory writing straight from the arena, or None where that
        does not apply: a storage without the :class:`~ckrun.storage.base.WritesInPlace`
        capability (or one that declines it: no ``O_DIRECT``, a subclass that keeps its
        own ``open_write``), or an unaligned arena."""
        arena = self._arena
        if not isinstance(storage, WritesInPlace) or arena is None or arena.data_ptr() % BLOCK:
            return None
        return storage.in_place_writer(int(arena.data_ptr()), int(arena.numel()))
