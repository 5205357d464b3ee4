"""Where the background persist of ``async_save`` takes compute from training (issue 19).

    python bench/persist_cpu.py [--sizes 0.25,1] [--repeats 5] [--compute-s 2] [--dir D]

Per state size (bench/checkpoint.py's transformer-shaped state), two Checkpointers in one
process, each warmed up by one ``async_save`` (host buffers allocated outside the
figures): "this branch" (arena on transparent huge pages, each shard byte hashed once,
persist threads at ``SCHED_IDLE``) and "as on main" (the same code switched back: a
``MAP_POPULATE`` arena of 4 KiB pages, ``st_format.REHASH_BELOW`` so large that every
entry is hashed twice, ``CKRUN_PERSIST_SCHED=other`` at nice 10).  The conditions are
interleaved inside each repeat, so a shared machine's load drifts over both alike.

    cpu    : per persist (the main thread polling ``done()``): the worker thread's CPU
             seconds (``time.thread_time``) split into CRC32C calls of >= 32 KiB (which
             release the GIL) and the rest (Python and system calls with the GIL held),
             the I/O thread's system seconds (``/proc/self/task/<tid>/stat`` read just
             before the writer's commit), and the disk's completion interrupts
             (``/proc/interrupts`` lines of virtio request queues, all CPUs)
    compute: the 384x384 fp32 matmul loop of bench/checkpoint_async.py (2 torch threads)
             alone and during each persist; each window bracketed by windows of the loop
             alone (share = during / their mean, median of ``--repeats``); "lost" =
             (1 - share) x persist seconds, the loop's seconds the persist cost

Prints one markdown table per size.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ckrun
import crc32c
from checkpoint import build_state, state_bytes
from checkpoint_async import Matmul
from ckrun.checkpoint import host_buffers, st_format
from ckrun.storage import direct

TICK = os.sysconf("SC_CLK_TCK")


def thread_sys(tid: int) -> float:
    """System CPU seconds of thread ``tid`` of this process (stat(5) field 15)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[12]) / TICK


def disk_irqs() -> int:
    """Completion interrupts of virtio/nvme request queues so far, all CPUs."""
    n = 0
    with open("/proc/interrupts") as f:
        for line in f:
            if "-req" in line or "nvme" in line:
                n += sum(int(x) for x in line.split()[1:] if x.isdigit())
    return n


class Probe:
    """Worker CPU split and I/O-thread system time of the persists it watches."""

    def __init__(self) -> None:
        self.crc = self.worker = self.io_sys = 0.0
        self._real_crc = crc32c.crc32c
        self._io_start: dict[int, float] = {}
        probe = self

        class Counting:
            @staticmethod
            def crc32c(buf: Any, value: int = 0) -> int:
                t = time.thread_time()
                r: int = probe._real_crc(buf, value)
                if memoryview(buf).nbytes >= 32 << 10:
                    probe.crc += time.thread_time() - t
                return r

        st_format.crc32c = Counting  # type: ignore[assignment]
        persist = ckrun.checkpoint.pipeline.persist

        def timed(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return persist(*a, **k)
            finally:
                probe.worker += time.thread_time() - t

        ckrun.checkpoint.pipeline.persist = timed
        pwrite, commit = direct.ArenaWriter._pwrite, direct.ArenaWriter.commit

        def io(w: direct.ArenaWriter, mv: memoryview, off: int) -> None:
            self._io_start.setdefault(
                threading.get_native_id(), thread_sys(threading.get_native_id())
            )
            pwrite(w, mv, off)

        def io_commit(w: direct.ArenaWriter, **k: Any) -> Any:
            for f in list(w._futs):
                f.result()
            for tid, s0 in self._io_start.items():
                try:
                    probe.io_sys += thread_sys(tid) - s0
                except FileNotFoundError:  # an earlier writer's thread, gone
                    pass
            self._io_start.clear()
            return commit(w, **k)

        direct.ArenaWriter._pwrite = io  # type: ignore[method-assign]
        direct.ArenaWriter.commit = io_commit  # type: ignore[method-assign]

    def take(self) -> tuple[float, float, float]:
        out = (self.worker, self.crc, self.io_sys)
        self.crc = self.worker = self.io_sys = 0.0
        return out


def small_page_arena(size: int) -> tuple[mmap.mmap, int, bool]:
    """The arena as on main: ``MAP_POPULATE``, 4 KiB pages, no advice."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, size, flags=flags), 0, False


def run(size_gib: float, root: str, reps: int, min_s: float) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    state = build_state(size_gib)
    r: dict[str, Any] = {"size_gib": size_gib, "state_bytes": state_bytes(state)}
    step = iter(range(1, 1 << 30))
    rehash = st_format.REHASH_BELOW
    new = ckrun.Checkpointer(storage=f"{root}/new", rng=False, lock=False, keep_last=1)
    new.async_save(next(step), state).result()
    os.environ["CKRUN_PERSIST_SCHED"] = "other"
    old = ckrun.Checkpointer(storage=f"{root}/old", rng=False, lock=False, keep_last=1)
    host_buffers.hugepage_arena = small_page_arena  # type: ignore[assignment]
    st_format.REHASH_BELOW = 1 << 62  # type: ignore[misc]
    old.async_save(next(step), state).result()
    del os.environ["CKRUN_PERSIST_SCHED"]
    assert old._async is not None and new._async is not None
    assert not old._async.buffers.hugepages and new._async.policy == "idle"

    def start(ck: ckrun.Checkpointer, twice: bool, idle: bool) -> Callable[[], Callable[[], bool]]:
        def go() -> Callable[[], bool]:
            st_format.REHASH_BELOW = (1 << 62) if twice else rehash  # type: ignore[misc]
            assert ck._async is not None
            ck._async.idle = idle
            return ck.async_save(next(step), state).done

        return go

    starts = {
        "this branch (huge pages, CRC once, SCHED_IDLE)": start(new, False, True),
        "this branch at SCHED_OTHER nice 10": start(new, False, False),
        "as on main (4 KiB pages, CRC twice, nice 10)": start(old, True, False),
    }
    probe = Probe()
    cpu: dict[str, list[tuple[float, ...]]] = {k: [] for k in starts}
    for _ in range(reps):
        for k, go in starts.items():
            i0, t = disk_irqs(), time.perf_counter()
            done = go()
            while not done():
                time.sleep(0.005)
            wall = time.perf_counter() - t
            cpu[k].append((wall, *probe.take(), disk_irqs() - i0))
    r["cpu"] = {k: [statistics.median(x[i] for x in v) for i in range(5)] for k, v in cpu.items()}
    mm = Matmul()
    alone = [mm.rate(min_s)]
    shares: dict[str, list[float]] = {k: [] for k in starts}
    secs: dict[str, list[float]] = {k: [] for k in starts}
    for _ in range(reps):
        for k, go in starts.items():
            during, s = mm.rate_during(go, min_s)
            alone.append(mm.rate(min_s))
            shares[k].append(during / ((alone[-1] + alone[-2]) / 2))
            secs[k].append(s)
    r["alone"] = statistics.median(alone)
    r["compute"] = {k: (statistics.median(shares[k]), statistics.median(secs[k])) for k in starts}
    r["load"] = os.getloadavg()[0]
    st_format.REHASH_BELOW = rehash  # type: ignore[misc]
    new.close()
    old.close()
    shutil.rmtree(root, ignore_errors=True)
    return r


def table(r: dict[str, Any]) -> str:
    gib = r["state_bytes"] / 2**30
    out = [
        f"#### {r['size_gib']:g} GiB ({r['state_bytes'] / 1e9:.2f} GB), load average "
        f"{r['load']:.1f}; CPU figures in ms per GiB",
        "",
        "| persist alone | wall s | worker CPU | of it CRC32C | rest (GIL held) | "
        "I/O thread sys | disk interrupts |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, (wall, worker, crc, io, irq) in r["cpu"].items():
        out.append(
            f"| {k} | {wall:.2f} | {1e3 * worker / gib:.0f} | {1e3 * crc / gib:.0f} | "
            f"{1e3 * (worker - crc) / gib:.0f} | {1e3 * io / gib:.0f} | {irq / gib:.0f} |"
        )
    out += [
        "",
        f"| compute loop during (alone {r['alone']:.0f} matmul/s) | share | persist s | "
        "loop s lost |",
        "|---|---:|---:|---:|",
    ]
    for k, (share, s) in r["compute"].items():
        out.append(f"| {k} | {100 * share:.0f} % | {s:.2f} | {(1 - share) * s:.3f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.25,1", help="comma-separated GiB [0.25,1]")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compute-s", type=float, default=2.0)
    ap.add_argument("--dir", default="/tmp/ckrun-persist-cpu")
    a = ap.parse_args()
    for size in (float(x) for x in a.sizes.split(",")):
        print(table(run(size, a.dir, a.repeats, a.compute_s)), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
