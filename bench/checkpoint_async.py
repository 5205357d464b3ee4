"""Side-by-side checkpoint benchmark (issue 7), run by ``bench/checkpoint.py --sizes``.

For each state size (a transformer-shaped state from :func:`checkpoint.build_state`:
fp32 weights + AdamW ``exp_avg``/``exp_avg_sq``), medians of ``repeats`` runs of:

    limits : page-cache write + fsync, O_DIRECT write + fsync (the disk), memcpy into
             preallocated reused buffers (the snapshot's lower bound) and into fresh
             memory (first touch), cold and warm sequential read of the ckrun shard
    saves  : torch.save + fsync, safetensors save_file + fsync, torch.distributed
             .checkpoint save and async_save (single process, gloo; pause and time to
             durable, with a fresh stager per call and with one reused stager), ckrun
             save, ckrun async_save (pause and time to durable)
    loads  : ckrun load, torch.load(weights_only), safetensors load_file, DCP load, each
             after dropping the page cache
    compute: a 384x384 fp32 matmul loop in the main thread, alone and while a background
             persist runs (ckrun async_save with its worker at SCHED_IDLE, the default,
             and at SCHED_OTHER with nice 10, 0 and 19, DCP
             async_save, a thread running torch.save + fsync); the snapshot pause itself
             is excluded (it is measured above); each window is bracketed by windows of
             the loop alone and its share is relative to their mean
    pairing: the machine is shared, so the figures that form a target ratio (memcpy,
             ckrun async_save, ckrun save, DCP async_save) are measured one after the
             other within each repeat, and ratios are medians of per-repeat ratios
    memory : RSS growth during the first ckrun async_save (the reusable host copy) and
             during a sync save

safetensors and DCP get a flat ``{name: tensor}`` dict of the same tensors (DCP needs one
to load in place); torch.save the model and optimizer state dicts; ckrun the objects.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import ckrun
import lazy_rows
import torch
from checkpoint import (
    RssPeak,
    build_state,
    cold_read,
    drop_cache,
    odirect_write,
    pagecache_write,
    state_bytes,
    torch_save,
)

MM = 384


def flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Model parameters and optimizer state as one ``{name: tensor}`` dict (references)."""
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for pid, st in state["optimizer"].state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
    return out


def med(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs (``before`` runs untimed first)."""
    ts = []
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Matmul:
    """The concurrent compute loop: fp32 matmuls in the calling thread."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(MM, MM, generator=g), torch.randn(MM, MM, generator=g)
        self.c = torch.empty(MM, MM)

    def rate(self, window_s: float) -> float:
        """Matmuls per second over ``window_s``."""
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window_s:
            torch.mm(self.a, self.b, out=self.c)
            n += 1
        return n / (time.perf_counter() - t0)

    def rate_during(
        self, start: Callable[[], Callable[[], bool]], min_s: float
    ) -> tuple[float, float]:
        """(matmuls per second, mean persist seconds) while persists started by ``start``
        run (``start`` returns a done() predicate after its pause, which is not counted)."""
        n, busy, k = 0, 0.0, 0
        while busy < min_s:
            done = start()
            t0 = time.perf_counter()
            while not done():
                torch.mm(self.a, self.b, out=self.c)
                n += 1
            busy += time.perf_counter() - t0
            k += 1
        return n / busy, busy / k


def limits(state: dict[str, Any], root: str, reps: int, r: dict[str, Any]) -> None:
    """Disk and memory limits (see module docstring)."""
    n = r["state_bytes"]
    tensors = list(flat(state).values())
    odirect_write(f"{root}/warmup", 256 << 20)
    _rm(f"{root}/warmup")
    r["O_DIRECT write + fsync"] = med(
        lambda: odirect_write(f"{root}/od", n), reps, lambda: _rm(f"{root}/od")
    )
    _rm(f"{root}/od")
    r["page-cache write + fsync"] = med(
        lambda: pagecache_write(f"{root}/pc", tensors), reps, lambda: _rm(f"{root}/pc")
    )
    _rm(f"{root}/pc")

    def copy_into(out: list[torch.Tensor]) -> None:
        for s, d in zip(tensors, out, strict=True):
            d.copy_(s)

    r["memcpy into fresh memory (first touch)"] = med(
        lambda: copy_into([torch.empty_like(t) for t in tensors]), reps
    )


def _async_pair(start: Callable[[], Any], wait: Callable[[Any], Any]) -> tuple[float, float]:
    """(pause, time to durable) in seconds of one background save."""
    t = time.perf_counter()
    h = start()
    pause = time.perf_counter() - t
    wait(h)
    return pause, time.perf_counter() - t


def reference_saves(state: dict[str, Any], root: str, reps: int, r: dict[str, Any]) -> None:
    """torch.save + fsync, safetensors save_file + fsync, DCP save."""
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    fl = flat(state)
    r["torch.save + fsync"] = med(
        lambda: torch_save(f"{root}/t.pt", state), reps, lambda: _rm(f"{root}/t.pt")
    )

    def sf() -> None:
        st.save_file(fl, f"{root}/s.safetensors")
        _fsync(f"{root}/s.safetensors")

    r["safetensors save_file + fsync"] = med(sf, reps, lambda: _rm(f"{root}/s.safetensors"))
    r["DCP save"] = med(
        lambda: dcp.save(fl, checkpoint_id=f"{root}/dcp"), reps, lambda: _rm(f"{root}/dcp")
    )


def saves(state: dict[str, Any], root: str, reps: int, r: dict[str, Any]) -> None:
    """First saves (RSS), then, interleaved in each repeat (the machine is shared: paired
    figures are measured side by side), memcpy into the async save's reused buffers,
    ckrun async_save, DCP async_save with a reused and with a fresh stager, ckrun save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    reference_saves(state, root, reps, r)
    fl = flat(state)
    ck = ckrun.Checkpointer(storage=f"{root}/ck", rng=False, lock=False, keep_last=1)
    step = iter(range(1, 1 << 30))
    with RssPeak() as rss:
        ck.save(next(step), state)
    r["ckrun save: extra RSS bytes"] = rss.peak - rss.base

    def ck_async() -> tuple[float, float]:
        return _async_pair(lambda: ck.async_save(next(step), state), lambda h: h.result())

    with RssPeak() as rss:  # first async save: allocates the reusable host copy
        r["ckrun async_save: first pause (fresh buffers)"] = ck_async()[0]
    r["ckrun async_save: extra RSS bytes"] = rss.peak - rss.base
    stager = DefaultStager(StagingOptions(False, False, False, False))

    def dcp_async(stg: Any) -> tuple[float, float]:
        _rm(f"{root}/dcpa")
        return _async_pair(
            lambda: dcp.async_save(fl, checkpoint_id=f"{root}/dcpa", async_stager=stg),
            lambda f: f.result(),
        )

    dcp_async(stager)  # the reused stager allocates its copy on the first call
    assert ck._async is not None  # memcpy lower bound: into the async save's own buffers
    pairs = [
        (a, b)
        for a, b in zip(ck.snapshot(state).tensors, ck._async.buffers._views, strict=True)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    ]
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        t = time.perf_counter()
        for src, dst in pairs:
            dst.copy_(src)
        samples.setdefault("memcpy into reused buffers", []).append(time.perf_counter() - t)
        for name, pair in (
            ("ckrun async_save", ck_async),
            ("ckrun async_save (lazy)", lambda: lazy_rows.pause_pair(ck, state, next(step))),
            ("DCP async_save (reused stager)", lambda: dcp_async(stager)),
            ("DCP async_save", lambda: dcp_async(None)),
            ("ckrun save", lambda: (0.0, med(lambda: ck.save(next(step), state), 1))),
        ):
            p, d = pair()
            samples.setdefault(f"{name}: pause", []).append(p)
            samples.setdefault(f"{name}: time to durable", []).append(d)
    stager.close()
    samples["ckrun save"] = samples.pop("ckrun save: time to durable")
    del samples["ckrun save: pause"], pairs
    r.update({k: statistics.median(v) for k, v in samples.items()})
    r["samples"] = samples
    m = ck.latest()
    assert m is not None
    r["ckrun_file"] = os.path.join(root, "ck", m.shards[0].key)
    ck.close()


def loads(state: dict[str, Any], root: str, reps: int, r: dict[str, Any]) -> None:
    """Cold loads (page cache dropped before each) and cold/warm reads of the shard."""
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    shard = r["ckrun_file"]
    files = [shard, f"{root}/t.pt", f"{root}/s.safetensors"]

    def drop() -> None:
        r["cache_drop"] = drop_cache(
            files + [os.path.join(d, f) for d, _, fs in os.walk(f"{root}/dcp") for f in fs]
        )

    r["load: cold read of the ckrun shard"] = med(lambda: cold_read(shard), reps, drop)
    cold_read(shard)
    r["load: warm read of the ckrun shard"] = med(lambda: cold_read(shard), reps)

    def tload() -> None:
        sd = torch.load(f"{root}/t.pt", weights_only=True)
        state["model"].load_state_dict(sd["model"])
        state["optimizer"].load_state_dict(sd["optimizer"])

    ck = ckrun.Checkpointer(storage=f"{root}/ck", rng=False, lock=False)
    r["load: ckrun load → model+opt"] = med(lambda: ck.load(state), reps, drop)
    r["load: torch.load(weights_only) → model+opt"] = med(tload, reps, drop)

    def sload() -> None:
        # safetensors >= 0.5 maps the file: touch every page so the bytes are read
        for t in st.load_file(f"{root}/s.safetensors").values():
            t.view(-1).view(torch.uint8)[::4096].sum()

    r["load: safetensors load_file → dict, every page touched"] = med(sload, reps, drop)
    fl = flat(state)
    r["load: DCP load → in place"] = med(
        lambda: dcp.load(fl, checkpoint_id=f"{root}/dcp"), reps, drop
    )


def _starts(
    state: dict[str, Any], root: str, ck: ckrun.Checkpointer, stager: Any
) -> dict[str, Callable[[], Callable[[], bool]]]:
    """Per condition: start one background persist, return its done() predicate."""
    import torch.distributed.checkpoint as dcp

    assert ck._async is not None
    pool, step, n, fl = (
        ck._async._pool,
        iter(range(1000, 1 << 30)),
        iter(range(1 << 30)),
        flat(state),
    )

    def at_nice(nice: int, idle: bool = False) -> Callable[[], Callable[[], bool]]:
        def start() -> Callable[[], bool]:  # the worker lowers itself to these per persist
            assert ck._async is not None
            ck._async.nice, ck._async.idle = nice, idle
            pool.submit(  # set it exactly (root may lower a nice again)
                lambda: os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            ).result()
            return ck.async_save(next(step), state).done

        return start

    def dcp_start() -> Callable[[], bool]:
        d = f"{root}/dcpc{next(n) % 2}"
        _rm(d)
        return dcp.async_save(fl, checkpoint_id=d, async_stager=stager).done

    def naive_start() -> Callable[[], bool]:
        t = threading.Thread(target=torch_save, args=(f"{root}/naive.pt", state))
        t.start()
        return lambda: not t.is_alive()

    return {
        "compute during ckrun async persist": at_nice(10, idle=True),
        "compute during ckrun async persist (SCHED_OTHER at nice 10)": at_nice(10),
        "compute during ckrun async persist (worker at nice 0)": at_nice(0),
        "compute during ckrun async persist (worker at nice 19)": at_nice(19),
        "compute during DCP async_save persist": dcp_start,
        "compute during a torch.save + fsync thread": naive_start,
    }


def compute(state: dict[str, Any], root: str, r: dict[str, Any], min_s: float, reps: int) -> None:
    """Matmul throughput during background persists, each window bracketed by windows of
    the loop alone (its share: during / mean of the two neighbours; median of ``reps``)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    mm = Matmul()
    ck = ckrun.Checkpointer(storage=f"{root}/cc", rng=False, lock=False, keep_last=1)
    ck.async_save(999, state).result()  # buffers allocated outside the windows
    stager = DefaultStager(StagingOptions(False, False, False, False))
    starts = _starts(state, root, ck, stager)
    alone = [mm.rate(min_s)]
    shares: dict[str, list[float]] = {k: [] for k in starts}
    persist: dict[str, list[float]] = {k: [] for k in starts}
    for _ in range(reps):
        for k, start in starts.items():
            during, secs = mm.rate_during(start, min_s)
            alone.append(mm.rate(min_s))
            shares[k].append(during / ((alone[-1] + alone[-2]) / 2))
            persist[k].append(secs)
    ck.close()
    stager.close()
    r["compute alone"] = statistics.median(alone)
    for k, v in shares.items():
        r[k] = statistics.median(v) * r["compute alone"]
        r[k + ": share"] = statistics.median(v)
        r[k + ": persist s"] = statistics.median(persist[k])


def run(size_gib: float, root: str, reps: int, min_s: float) -> dict[str, Any]:
    """Every row for one size; ``root`` is emptied first and removed at the end."""
    import torch.distributed as dist

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    state = build_state(size_gib)
    r: dict[str, Any] = {
        "size_gib": size_gib,
        "state_bytes": state_bytes(state),
        "repeats": reps,
        "torch": torch.__version__,
    }
    limits(state, root, reps, r)
    saves(state, root, reps, r)
    loads(state, root, reps, r)
    compute(state, root, r, min_s, reps)
    lazy_rows.steps(state, root, reps, r)  # issue 19: the lazy snapshot's step rows
    shutil.rmtree(root, ignore_errors=True)
    return r


RATE_ROWS = (
    "O_DIRECT write + fsync",
    "page-cache write + fsync",
    "memcpy into reused buffers",
    "memcpy into fresh memory (first touch)",
    "torch.save + fsync",
    "safetensors save_file + fsync",
    "DCP save",
    "DCP async_save: pause",
    "DCP async_save: time to durable",
    "DCP async_save (reused stager): pause",
    "DCP async_save (reused stager): time to durable",
    "ckrun save",
    "ckrun async_save: first pause (fresh buffers)",
    "ckrun async_save: pause",
    "ckrun async_save: time to durable",
    "load: cold read of the ckrun shard",
    "load: warm read of the ckrun shard",
    "load: ckrun load → model+opt",
    "load: torch.load(weights_only) → model+opt",
    "load: safetensors load_file → dict, every page touched",
    "load: DCP load → in place",
)
COMPUTE_ROWS = (
    "compute during ckrun async persist",
    "compute during ckrun async persist (SCHED_OTHER at nice 10)",
    "compute during ckrun async persist (worker at nice 0)",
    "compute during ckrun async persist (worker at nice 19)",
    "compute during DCP async_save persist",
    "compute during a torch.save + fsync thread",
)


def _paired(r: dict[str, Any], a: str, b: str) -> float:
    """Median over the repeats of ``a / b`` measured side by side."""
    s = r["samples"]
    return statistics.median(x / y for x, y in zip(s[a], s[b], strict=True))


def _mark(ok: bool) -> str:
    return "✔" if ok else "✘"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown tables: seconds (GB/s of the state) per size, compute ratios, targets."""
    sizes = [f"{r['size_gib']:g} GiB" for r in rows]
    out = [
        f"torch {rows[0]['torch']}; medians of {rows[0]['repeats']} runs; GB/s = state "
        f"bytes / s; page cache dropped with {rows[0].get('cache_drop')}",
        "",
        "| operation | " + " | ".join(sizes) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for k in RATE_ROWS:
        cells = [f"{r[k]:.3f} s ({r['state_bytes'] / r[k] / 1e9:.2f})" for r in rows]
        out.append(f"| {k} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| compute loop: matmul/s (share of alone; persist s meanwhile) | "
        + " | ".join(sizes)
        + " |",
        "|---|" + "---:|" * len(rows),
    ]
    out.append("| alone | " + " | ".join(f"{r['compute alone']:.0f}" for r in rows) + " |")
    for k in COMPUTE_ROWS:
        out.append(
            f"| {k.removeprefix('compute ')} | "
            + " | ".join(
                f"{r[k]:.0f} ({100 * r[k + ': share']:.0f} %; {r[k + ': persist s']:.2f} s)"
                for r in rows
            )
            + " |"
        )
    out += ["", "| ratio (target) | " + " | ".join(sizes) + " |", "|---|" + "---:|" * len(rows)]
    for name, fn, ok in _RATIOS:
        out.append(
            f"| {name} | " + " | ".join(f"{fn(r):.2f} {_mark(ok(fn(r)))}" for r in rows) + " |"
        )
    for name, key in (
        ("extra RSS, first async_save (% of state)", "ckrun async_save: extra RSS bytes"),
        ("extra RSS, sync save (% of state)", "ckrun save: extra RSS bytes"),
    ):
        out.append(
            f"| {name} | "
            + " | ".join(
                f"{r[key] / 2**20:.0f} MiB = {100 * r[key] / r['state_bytes']:.0f} %" for r in rows
            )
            + " |"
        )
    out += lazy_rows.table(rows)
    return "\n".join(out)


_RATIOS: list[tuple[str, Callable[[dict[str, Any]], float], Callable[[float], bool]]] = [
    (
        "async pause / memcpy into reused buffers (≤ 1.2)",
        lambda r: _paired(r, "ckrun async_save: pause", "memcpy into reused buffers"),
        lambda v: v <= 1.2,
    ),
    (
        "async pause / DCP async_save pause, reused stager (< 1)",
        lambda r: _paired(r, "ckrun async_save: pause", "DCP async_save (reused stager): pause"),
        lambda v: v < 1.0,
    ),
    (
        "async pause / DCP async_save pause, fresh stager (< 1)",
        lambda r: _paired(r, "ckrun async_save: pause", "DCP async_save: pause"),
        lambda v: v < 1.0,
    ),
    (
        "async time to durable / ckrun save (≤ 1.2)",
        lambda r: _paired(r, "ckrun async_save: time to durable", "ckrun save"),
        lambda v: v <= 1.2,
    ),
    (
        "compute kept during ckrun async persist (≥ 0.9, issue 19)",
        lambda r: r["compute during ckrun async persist: share"],
        lambda v: v >= 0.9,
    ),
    (
        "ckrun save / O_DIRECT limit, speed (≥ 0.75)",
        lambda r: r["O_DIRECT write + fsync"] / r["ckrun save"],
        lambda v: v >= 0.75,
    ),
    (
        "ckrun save / torch.save, speed",
        lambda r: r["torch.save + fsync"] / r["ckrun save"],
        lambda v: v >= 1.0,
    ),
    (
        "ckrun load / cold read, speed (≥ 1.0, issue 2)",
        lambda r: r["load: cold read of the ckrun shard"] / r["load: ckrun load → model+opt"],
        lambda v: v >= 1.0,
    ),
]
