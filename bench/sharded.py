"""Sharded-state save and load vs world size, next to torch.distributed.checkpoint (issue 14).

For each layout (``ddp``: every rank holds the whole model and AdamW state; ``fsdp``:
FSDP2 ``fully_shard`` per layer and the root, model and optimizer state are DTensors)
and each world size W (default 1, 2, 4), W real rank processes (gloo, CPU) build the
same model (``--layers`` Linear(d, d) layers, ``--size-mib`` MiB of fp32 weights, AdamW
state after one step: 3x that in bytes) and, in the same processes:

1. ``Checkpointer.save`` (ckrun), then ``dcp.save`` of ``{"model", "optimizer"}`` state
   dicts (DCP deduplicates replicated tensors too);
2. same-layout loads: ``Checkpointer.load`` and ``dcp.load`` of what step 1 wrote;
3. resharded loads of the checkpoints the previous world size wrote (W=2 loads W=1's,
   W=4 loads W=2's; a last launch of W=1 loads W=4's).

Bytes written: the sum of the files one save created; the state size is the sum of the
global tensors' bytes (the manifest's tensor layout).  Times: rank 0's wall seconds from
a barrier before the call to a barrier after it; the files are evicted from the page
cache (``posix_fadvise(DONTNEED)`` on our own files only: the machine is shared) before
each load; median of ``--repeats``.  Report ratios within the run, not absolute figures.

Usage: python bench/sharded.py [--size-mib 64] [--layers 8] [--worlds 1,2,4] [--repeats 3]
           [--dir /tmp/ckrun-bench-sharded] [--json OUT]
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


def _evict(root: str) -> None:
    for d, _, files in os.walk(root):
        for n in files:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _du(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, fs in os.walk(root) for n in fs)


def _build(layout: str, world: int, size_mib: int, layers: int) -> tuple[Any, Any]:
    import torch

    d = int((size_mib * (1 << 20) / 4 / layers) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(d, d, bias=False) for _ in range(layers)))
    if layout == "fsdp" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, d)).sum().backward()
    opt.step()
    return model, opt


def rank_main(a: argparse.Namespace) -> None:
    """One rank of one launch (module docstring); rank 0 writes the timings to a.out."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckrun import Checkpointer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = _build(a.layout, world, a.size_mib, a.layers)
    state = {"model": model, "optimizer": opt}
    res: dict[str, Any] = {}

    def timed(name: str, fn: Any, evict: str = "") -> Any:
        """Median of ``--repeats`` runs of ``fn(i)`` (i: the repeat) in seconds."""
        times, out = [], None
        for i in range(a.repeats):
            if evict and rank == 0:
                _evict(evict)
            dist.barrier()
            t0 = time.perf_counter()
            out = fn(i)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        res[name] = statistics.median(times)
        return out

    def dcp_sd() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    here, prev = os.path.join(a.root, "ckrun"), os.path.join(a.prev, "ckrun") if a.prev else ""
    if not a.load_only:
        ck = Checkpointer(here, lock=False, rng=False)
        m = timed("ckrun_save_s", lambda i: ck.save(i + 1, state))
        dcp_dir = os.path.join(a.root, "dcp")
        timed("dcp_save_s", lambda i: dcp.save(dcp_sd(), checkpoint_id=f"{dcp_dir}-{i}"))
        if rank == 0:
            os.rename(f"{dcp_dir}-{a.repeats - 1}", dcp_dir)
        dist.barrier()
        if rank == 0:
            lay = m.tensor_layout or {}
            res["state_bytes"] = sum(
                _nbytes(s["shape"], s["dtype"]) for s in lay.get("tensors", {}).values()
            )
            res["ckrun_bytes"] = m.total_size_bytes
            res["dcp_bytes"] = _du(dcp_dir)
        timed("ckrun_load_s", lambda i: Checkpointer(here, lock=False, rng=False).load(state), here)
        sd = dcp_sd()
        timed("dcp_load_s", lambda i: dcp.load(sd, checkpoint_id=dcp_dir), dcp_dir)
    if prev:
        ckp = Checkpointer(prev, lock=False, rng=False)
        timed("ckrun_reshard_load_s", lambda i: ckp.load(state), prev)
        sd = dcp_sd()
        prev_dcp = os.path.join(a.prev, "dcp")
        timed("dcp_reshard_load_s", lambda i: dcp.load(sd, checkpoint_id=prev_dcp), prev_dcp)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _nbytes(shape: list[int], dtype: str) -> int:
    import math

    import torch

    return math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _launch(world: int, args: list[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.pop("CKRUN_STORAGE", None)
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", *args], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layouts", default="ddp,fsdp")
    p.add_argument("--dir", default="/tmp/ckrun-bench-sharded")
    p.add_argument("--json", default="")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="fsdp", help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--prev", default="", help=argparse.SUPPRESS)
    p.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank:
        return rank_main(a)
    shutil.rmtree(a.dir, ignore_errors=True)
    worlds = [int(w) for w in a.worlds.split(",")]
    rows: list[dict[str, Any]] = []
    for layout in a.layouts.split(","):
        prev = ""
        for w in worlds:
            root = os.path.join(a.dir, f"{layout}-w{w}")
            out = os.path.join(a.dir, f"{layout}-w{w}.json")
            common = ["--layout", layout, "--size-mib", str(a.size_mib)]
            common += ["--layers", str(a.layers), "--root", root, "--out", out]
            common += ["--repeats", str(a.repeats)]
            _launch(w, [*common, "--prev", prev])
            with open(out) as f:
                rows.append({"layout": layout, "world": w, "from": _world_of(prev), **json.load(f)})
            prev = root
        if len(worlds) > 1:  # the smallest world loads the largest one's checkpoint
            w, out = worlds[0], os.path.join(a.dir, f"{layout}-back.json")
            root = os.path.join(a.dir, f"{layout}-back")
            common = ["--layout", layout, "--size-mib", str(a.size_mib), "--layers", str(a.layers)]
            common += ["--repeats", str(a.repeats)]
            _launch(w, [*common, "--root", root, "--out", out, "--prev", prev, "--load-only"])
            with open(out) as f:
                back = json.load(f)
            row = next(r for r in rows if r["layout"] == layout and r["world"] == w)
            row.update({k: v for k, v in back.items()}, **{"from": _world_of(prev)})
    _report(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _world_of(root: str) -> int | None:
    return int(root.rsplit("-w", 1)[1]) if root else None


def _report(rows: list[dict[str, Any]]) -> None:
    print(
        "layout  W  from | bytes/state ckrun  dcp | save s ckrun  dcp  ckrun/dcp | "
        "load s same  resharded  resh/same | dcp load same  resharded"
    )
    for r in rows:
        sb = r["state_bytes"]
        resh = r.get("ckrun_reshard_load_s")
        print(
            f"{r['layout']:6} {r['world']:2} {r.get('from') or '-':>5} | "
            f"{r['ckrun_bytes'] / sb:14.4f} {r['dcp_bytes'] / sb:5.3f} | "
            f"{r['ckrun_save_s']:11.3f} {r['dcp_save_s']:5.3f} "
            f"{r['ckrun_save_s'] / r['dcp_save_s']:9.2f} | "
            f"{r['ckrun_load_s']:11.3f} {resh if resh is not None else float('nan'):10.3f} "
            f"{(resh or float('nan')) / r['ckrun_load_s']:9.2f} | "
            f"{r['dcp_load_s']:13.3f} {r.get('dcp_reshard_load_s', float('nan')):10.3f}"
        )


if __name__ == "__main__":
    main()
