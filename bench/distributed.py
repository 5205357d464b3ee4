"""Collective save and load time against world size (issue 8).

For each world size W (default 1, 2, 4) W real rank processes (gloo, CPU, one machine)
each hold the same replicated state (a model of ``--size-mib`` MiB of fp32 weights plus
SGD momentum, i.e. 2x that in bytes) and run ``Checkpointer.save`` collectively, then
``load`` on the same W, then rank 0 of a single process loads the W-rank checkpoint (the
resharded path).  W = 1 without ``torch.distributed`` is the single-process save.

Times are wall seconds measured on rank 0 from a barrier before the call to its return
(``save`` returns after the manifest commit and the broadcast); the page cache is dropped
before each load when possible (root: ``/proc/sys/vm/drop_caches``; else posix_fadvise).
Median of ``--repeats``.

Usage: python bench/distributed.py [--size-mib 128] [--worlds 1,2,4] [--repeats 3]
           [--dir /tmp/ckrun-bench-dist] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any


def _drop_cache(root: str) -> str:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for d, _, files in os.walk(root):
            for n in files:
                fd = os.open(os.path.join(d, n), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        return "fadvise"


def rank_main(root: str, size_mib: int, mode: str, out: str) -> None:
    """One rank: ``save`` (W ranks) or ``load`` (any W); rank 0 writes the timing."""
    import torch
    import torch.distributed as dist
    from ckrun import Checkpointer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    n = size_mib * (1 << 20) // 4
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(n))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones_like(w)
    opt.step()  # creates the momentum buffer: state = 2 x size
    state = {"model": {"w": w}, "optimizer": opt, "extra": {"step": 1}}
    ck = Checkpointer(root, lock=False, run="bench")
    if world > 1:
        ck.group.all_ok(True)  # creates the checkpoint group outside the timing
        dist.barrier()
    t0 = time.perf_counter()
    if mode == "save":
        m = ck.save(1, state)
        total = m.total_size_bytes
    else:
        m2 = ck.load(state)
        assert m2 is not None
        total = m2.total_size_bytes
    dt = time.perf_counter() - t0
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"seconds": dt, "bytes": total}, f)
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, root: str, size_mib: int, mode: str, out: str) -> dict[str, Any]:
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if world > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        else:
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                env.pop(k, None)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank-main", mode, root, str(size_mib), out], env=env
            )
        )
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"a rank failed (world {world}, {mode})")
    with open(out) as f:
        body: dict[str, Any] = json.load(f)
    return body


def bench(worlds: list[int], size_mib: int, repeats: int, base: str) -> list[dict[str, Any]]:
    """Rows: world, save_s, load_s (same W), load_on_1_s (resharded for W > 1), bytes."""
    rows = []
    for world in worlds:
        saves, loads, loads1, nbytes, how = [], [], [], 0, ""
        for i in range(repeats):
            root = os.path.join(base, f"w{world}-{i}")
            shutil.rmtree(root, ignore_errors=True)
            out = os.path.join(base, "t.json")
            r = _launch(world, root, size_mib, "save", out)
            saves.append(r["seconds"])
            nbytes = r["bytes"]
            how = _drop_cache(root)
            loads.append(_launch(world, root, size_mib, "load", out)["seconds"])
            if world > 1:
                _drop_cache(root)
                loads1.append(_launch(1, root, size_mib, "load", out)["seconds"])
            shutil.rmtree(root, ignore_errors=True)
        rows.append(
            {
                "world": world,
                "bytes": nbytes,
                "cache": how,
                "save_s": statistics.median(saves),
                "load_s": statistics.median(loads),
                "load_on_1_s": statistics.median(loads1) if loads1 else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[3], int(sys.argv[4]), sys.argv[2], sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=128)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/ckrun-bench-dist")
    p.add_argument("--json", default="")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    rows = bench([int(w) for w in a.worlds.split(",")], a.size_mib, a.repeats, a.dir)
    print(
        f"{'world':>5} {'shard MiB':>9} {'total MiB':>9} {'save s':>7} {'GB/s':>5} "
        f"{'load s':>7} {'load on 1 s':>11}"
    )
    for r in rows:
        total = r["bytes"] / (1 << 20)
        on1 = f"{r['load_on_1_s']:.3f}" if r["load_on_1_s"] is not None else "-"
        print(
            f"{r['world']:>5} {total / r['world']:>9.0f} {total:>9.0f} {r['save_s']:>7.3f} "
            f"{r['bytes'] / r['save_s'] / 1e9:>5.2f} {r['load_s']:>7.3f} {on1:>11}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
