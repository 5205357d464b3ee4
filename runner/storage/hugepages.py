"""Page-aligned host memory backed by transparent huge pages, for ``O_DIRECT`` sources.

An ``O_DIRECT`` write pins its source pages and hands the device one scatter-gather
segment per physically contiguous run.  From 4 KiB pages the virtio disk here
(``max_segments`` 254, ``max_sectors_kb`` 4096) gets requests of at most ~1 MiB; from
2 MiB huge pages, requests of 4 MiB.  Measured on this 2-vCPU VM (kernel 6.18, 1 GiB
written in 32 MiB ``pwrite`` requests, bench/README.md "compute kept during the
persist"; populated memory, ``RUSAGE_THREAD``): 4 KiB pages 45-58 ms of system CPU per
GiB and ≈ 1220 completion interrupts, huge pages 4-8 ms and ≈ 40 interrupts, and the
writes took 0.35-0.47 s instead of 0.56-0.65 s.  Interrupt time is charged to whatever
thread a CPU was running (the training loop), so this is compute the persist no longer
takes from training.

The region is advised with ``madvise(MADV_HUGEPAGE)`` (transparent huge pages in their
``madvise`` mode, the common default) before it is faulted in, then populated with
``MADV_POPULATE_WRITE`` (Linux 5.14; the pages are touched instead on older kernels):
``MAP_POPULATE`` would fault it in as 4 KiB pages before the advice could apply.  Where
THP is off (``never``) or the kernel has no huge page free, the advice is a no-op and
the memory is ordinary page-aligned anonymous memory: the same bytes, only slower.
"""

from __future__ import annotations

import ctypes
import mmap
import os

__all__ = ["HUGE_PAGE", "hugepage_arena"]

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_MADV_POPULATE_WRITE = 23  # include/uapi/asm-generic/mman-common.h, Linux 5.14


def hugepage_arena(size: int) -> tuple[mmap.mmap, int, bool]:
    """Anonymous memory for ``size`` bytes starting on a huge-page boundary, faulted in.

    Returns:
        ``(mapping, offset, advised)``: the region is ``mapping[offset:offset + size]``
        (``offset`` aligns it to :data:`HUGE_PAGE`, so it is page aligned whatever the
        kernel does); ``advised`` is True when the kernel accepted ``MADV_HUGEPAGE``.
    """
    size = max(size, mmap.PAGESIZE)
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(m)
    offset = -ctypes.addressof(anchor) % HUGE_PAGE
    del anchor  # an exported buffer would keep the mapping from being closed
    length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    advised = False
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice, offset, length)
            advised = True
        except OSError:  # THP compiled out (EINVAL): ordinary pages
            pass
    try:
        m.madvise(_MADV_POPULATE_WRITE, offset, length)
    except OSError:  # before Linux 5.14: fault every page in by writing to it
        view = memoryview(m)
        zero = bytes(1)
        for p in range(offset, offset + length, mmap.PAGESIZE):
            view[p : p + 1] = zero
        view.release()
    return m, offset, advised


def advised_in_smaps(address: int) -> bool | None:
    """Whether the mapping holding ``address`` carries the ``hg`` (``MADV_HUGEPAGE``)
    flag in ``/proc/self/smaps`` (None where there is no smaps: not Linux)."""
    try:
        with open(f"/proc/{os.getpid()}/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False
