"""Where the background persist of ``async_save`` takes compute from training (issue 19).

    python bench/persist_cpu.py [--sizes 0.25,1] [--repeats 3] [--compute-s 3] [--dir D]

For each state size (bench/checkpoint.py's transformer-shaped state) after one warm-up
``async_save`` (the host buffers allocated outside the figures):

    cpu    : one persist with the main thread blocked in ``handle.result()``: wall
             seconds, CPU seconds of the persist worker thread and of every other
             thread (the O_DIRECT I/O thread, which has exited by then: process total
             minus the worker and the main thread), user and system apart
             (``/proc/self/task/<tid>/stat`` fields 14-15 and ``os.times``); the
             CRC32C of the arena alone (one pass, ``crc32c.crc32c``) and an
             ``O_DIRECT`` write + fsync of the arena alone (no CRC), same accounting
    gil    : a probe thread sleeping 1 ms in a loop during the persist: the sum of its
             wake-up delays beyond 1 ms (with two cores and one runnable persist thread
             this is time it waited for the GIL), and the largest single delay
    compute: the 384x384 fp32 matmul loop of bench/checkpoint_async.py (2 torch
             threads) alone and while each of these runs in the background: the ckrun
             persist as configured, the ckrun persist with its worker at nice 10 instead
             of SCHED_IDLE, the CRC32C pass alone, the ``O_DIRECT`` write alone; each
             window bracketed by windows of the loop alone (share = during / their mean,
             median of ``--repeats``), and "lost" = matmul-seconds the loop lost per
             persist (1 - share) x persist seconds

Prints one markdown table per size.
"""

from __future__ import annotations

import argparse
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

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(tid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of thread ``tid`` of this process."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK  # fields 14, 15 of stat(5)


def proc_cpu() -> tuple[float, float]:
    t = os.times()
    return t.user, t.system


class GilProbe:
    """A thread sleeping ``period`` s in a loop; sums its wake-up delays beyond it."""

    def __init__(self, period: float = 1e-3) -> None:
        self.period, self.late, self.worst, self._stop = period, 0.0, 0.0, False
        self.cpu = (0.0, 0.0)  # its own (user, system) CPU seconds, to subtract
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tid = threading.get_native_id()
        c0 = thread_cpu(tid)
        while not self._stop:
            t = time.perf_counter()
            time.sleep(self.period)
            d = time.perf_counter() - t - self.period
            self.late += max(0.0, d)
            self.worst = max(self.worst, d)
        c1 = thread_cpu(tid)
        self.cpu = (c1[0] - c0[0], c1[1] - c0[1])

    def __enter__(self) -> GilProbe:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()


def accounted(run: Callable[[], Any], worker_tid: int | None) -> dict[str, float]:
    """Wall and CPU seconds of ``run()`` (called in the main thread, which only waits)."""
    main = threading.get_native_id()
    m0, p0 = thread_cpu(main), proc_cpu()
    w0 = thread_cpu(worker_tid) if worker_tid else (0.0, 0.0)
    t = time.perf_counter()
    run()
    wall = time.perf_counter() - t
    m1, p1 = thread_cpu(main), proc_cpu()
    w1 = thread_cpu(worker_tid) if worker_tid else (0.0, 0.0)
    wu, ws = w1[0] - w0[0], w1[1] - w0[1]
    ou = p1[0] - p0[0] - (m1[0] - m0[0]) - wu
    os_ = p1[1] - p0[1] - (m1[1] - m0[1]) - ws
    return {"wall": wall, "worker user": wu, "worker sys": ws, "other user": ou, "other sys": os_}


def arena_of(ck: ckrun.Checkpointer) -> memoryview:
    saver = ck._async
    assert saver is not None and saver.buffers._mmap is not None
    return memoryview(saver.buffers._mmap)


def odirect_arena(path: str, arena: memoryview, chunk: int = 32 << 20) -> None:
    """The arena written with O_DIRECT in ``chunk`` requests, then fsync (no CRC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, len(arena), chunk):
            os.pwrite(fd, arena[off : off + chunk], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def background(fn: Callable[[], Any]) -> Callable[[], bool]:
    t = threading.Thread(target=fn)
    t.start()
    return lambda: not t.is_alive()


def run(size_gib: float, root: str, reps: int, min_s: float) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    state = build_state(size_gib)
    r: dict[str, Any] = {"size_gib": size_gib, "state_bytes": state_bytes(state)}
    ck = ckrun.Checkpointer(storage=f"{root}/ck", rng=False, lock=False, keep_last=1)
    step = iter(range(1, 1 << 30))
    ck.async_save(next(step), state).result()
    saver = ck._async
    assert saver is not None
    pool = saver._pool
    tid = pool.submit(threading.get_native_id).result()
    arena = arena_of(ck)

    def persist() -> None:
        ck.async_save(next(step), state).result()

    cpu: dict[str, list[dict[str, float]]] = {}
    for _ in range(reps):
        with GilProbe() as probe:
            a = accounted(persist, tid)
        a["probe late"], a["probe worst"] = probe.late, probe.worst
        a["other user"] -= probe.cpu[0]
        a["other sys"] -= probe.cpu[1]
        cpu.setdefault("ckrun persist", []).append(a)
        with GilProbe() as probe:  # control: the probe's delays with nothing running
            c = accounted(lambda w=a["wall"]: time.sleep(w), None)
        c["probe late"], c["probe worst"] = probe.late, probe.worst
        c["other user"] -= probe.cpu[0]
        c["other sys"] -= probe.cpu[1]
        cpu.setdefault("idle (control for the GIL probe)", []).append(c)
        cpu.setdefault("CRC32C of the arena", []).append(
            accounted(lambda: _join(lambda: crc32c.crc32c(arena)), None)
        )
        cpu.setdefault("O_DIRECT write of the arena + fsync", []).append(
            accounted(lambda: _join(lambda: odirect_arena(f"{root}/od", arena)), None)
        )
    r["cpu"] = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in cpu.items()}

    starts: dict[str, Callable[[], Callable[[], bool]]] = {
        "ckrun persist": lambda: ck.async_save(next(step), state).done,
        "CRC32C pass alone": lambda: background(lambda: crc32c.crc32c(arena)),
        "O_DIRECT write alone": lambda: background(lambda: odirect_arena(f"{root}/od", arena)),
    }
    mm = Matmul()
    alone = [mm.rate(min_s)]
    shares: dict[str, list[float]] = {k: [] for k in starts}
    secs: dict[str, list[float]] = {k: [] for k in starts}
    for _ in range(reps):
        for k, start in starts.items():
            during, s = mm.rate_during(start, min_s)
            alone.append(mm.rate(min_s))
            shares[k].append(during / ((alone[-1] + alone[-2]) / 2))
            secs[k].append(s)
    r["alone"] = statistics.median(alone)
    r["compute"] = {k: (statistics.median(shares[k]), statistics.median(secs[k])) for k in starts}
    ck.close()
    shutil.rmtree(root, ignore_errors=True)
    return r


def _join(fn: Callable[[], Any]) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def table(r: dict[str, Any]) -> str:
    gib = r["state_bytes"] / 2**30
    out = [
        f"#### {r['size_gib']:g} GiB ({r['state_bytes'] / 1e9:.2f} GB), load average "
        f"{os.getloadavg()[0]:.1f}",
        "",
        "| persist alone (CPU s per GiB) | wall s | worker user | worker sys | "
        "other user | other sys | GIL probe late ms (worst) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k, a in r["cpu"].items():
        gil = (
            f"{1e3 * a['probe late']:.1f} ({1e3 * a['probe worst']:.1f})"
            if "probe late" in a
            else "—"
        )
        out.append(
            f"| {k} | {a['wall']:.3f} | "
            + " | ".join(
                f"{a[f] / gib:.3f}"
                for f in ("worker user", "worker sys", "other user", "other sys")
            )
            + f" | {gil} |"
        )
    out += [
        "",
        f"| compute loop during (alone {r['alone']:.0f} matmul/s) | share | background s | "
        "loop time lost s |",
        "|---|---:|---:|---:|",
    ]
    for k, (share, s) in r["compute"].items():
        out.append(f"| {k} | {100 * share:.0f} % | {s:.2f} | {(1 - share) * s:.3f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.25,1", help="comma-separated GiB [0.25,1]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compute-s", type=float, default=3.0)
    ap.add_argument("--dir", default="/tmp/ckrun-persist-cpu")
    a = ap.parse_args()
    for size in (float(x) for x in a.sizes.split(",")):
        print(table(run(size, a.dir, a.repeats, a.compute_s)), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
