"""Lazy-snapshot rows of the side-by-side table (issue 19, ``bench/checkpoint_async.py``).

pause    : ``ckrun async_save(..., lazy=True)`` returns after the RNG, the tree and the
           eager tensors (LayerNorm has no buffers here: none) are captured; measured in
           the same repeat as the memcpy of the whole state into the async save's reused
           buffers (:func:`pause_pair`, called by ``checkpoint_async.saves``).  Target:
           lazy pause ≤ 0.2 × that memcpy.
step     : one real training step of the benchmark's own state (forward of a batch
           through the model, backward, AdamW ``step``), timed alone and right after an
           ``async_save``: lazy (the copier copies parameters and AdamW moments during
           forward/backward; whatever is left is copied by the step pre-hook inside the
           step, so it counts) and eager (the pause is not in the step; the persist runs
           meanwhile).  Each overlapped step is bracketed by steps alone and compared to
           their mean; medians of at least :data:`ROUNDS` rounds.  Target: lazy step
           ≤ 1.1 × alone.  Also recorded: the share of the bytes the step's pre-hook
           had to copy itself (the copier had not reached them).
floor    : what no lazy copy can beat on this machine: the step alone keeps
           ``cores busy`` of the CPUs busy (process CPU time / wall time); the copy of
           the lazily copied tensors takes ``CPU seconds`` (measured by repeating it,
           the better of torch's ``copy_`` and one thread's ``memmove``); the part of
           that CPU the step's idle core-seconds cannot absorb lands inside the step,
           spread at best over every core:
           floor = 1 + max(0, copy CPU - idle core-s) / (cores × step alone).
           Also shown: the same copy's best wall time and 1 + copy wall / step alone,
           the step when the copy cannot share the cores with the step's OpenMP team
           and is paid at its own full speed (no overlap).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from typing import Any

import ckrun
import torch

BATCH = 48  # rows of the step's input batch (d_model wide)
ROUNDS = 15  # step rows: at least this many rounds (one step varies by ±15 % here)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pause_pair(ck: ckrun.Checkpointer, state: dict[str, Any], step: int) -> tuple[float, float]:
    """(pause, time to durable) of one lazy ``async_save`` with no step in between."""
    t = time.perf_counter()
    h = ck.async_save(step, state, lazy=True)
    pause = time.perf_counter() - t
    h.result()
    return pause, time.perf_counter() - t


def forward(model: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The benchmark state's layers as pre-norm transformer blocks (``build_state``:
    LayerNorm, qkv, proj, LayerNorm, mlp up, mlp down per block), the batch's rows as
    the sequence: every parameter gets a gradient."""
    layers = list(model)
    for i in range(0, len(layers), 6):
        ln1, qkv, proj, ln2, up, down = layers[i : i + 6]
        q, k, v = qkv(ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.T / q.shape[-1] ** 0.5, dim=-1)
        x = x + proj(att @ v)
        x = x + down(torch.nn.functional.gelu(up(ln2(x))))
    return x


def _train_step(state: dict[str, Any], x: torch.Tensor, cpu: list[float] | None = None) -> float:
    """Seconds of one forward/backward/AdamW step of the benchmark state; appends the
    process's CPU seconds (every thread) of the step to ``cpu`` when given."""
    model, opt = state["model"], state["optimizer"]
    c, t = time.process_time(), time.perf_counter()
    opt.zero_grad(set_to_none=True)
    forward(model, x).pow(2).mean().backward()
    opt.step()
    wall = time.perf_counter() - t
    if cpu is not None:
        cpu.append(time.process_time() - c)
    return wall


def _copy_cpu(lz: Any) -> tuple[float, float]:
    """(CPU seconds of every thread, wall seconds) of copying the lazily copied tensors
    once more into their host buffers (after the persist: the buffers are free until the
    next save), the better of torch's ``copy_`` (its OpenMP team) and one thread's
    ``memmove`` (the copier's way) for each figure."""
    c, t = time.process_time(), time.perf_counter()
    with torch.no_grad():
        for e in lz.entries:
            e.dst.copy_(e.src)
    cpu, wall = time.process_time() - c, time.perf_counter() - t
    c, t = time.thread_time(), time.perf_counter()  # this thread only: no team spinning
    for e in lz.entries:
        if e.src.is_contiguous() and e.dst.is_contiguous() and e.src.nbytes == e.dst.nbytes:
            ctypes.memmove(e.dst.data_ptr(), e.src.data_ptr(), e.dst.nbytes)
        else:  # not one dense range: the copier copies these with copy_ as well
            with torch.no_grad():
                e.dst.copy_(e.src)
    return min(cpu, time.thread_time() - c), min(wall, time.perf_counter() - t)


def steps(state: dict[str, Any], root: str, reps: int, r: dict[str, Any]) -> None:
    """Step time alone and right after a lazy / an eager ``async_save`` (module doc)."""
    d_model = next(state["model"].parameters()).shape[-1]
    torch.manual_seed(1)
    x = torch.randn(BATCH, d_model)
    ck = ckrun.Checkpointer(storage=f"{root}/lz", rng=False, lock=False, keep_last=1)
    n = iter(range(1, 1 << 30))
    ck.async_save(next(n), state).result()  # buffers allocated outside the windows
    for _ in range(2):
        _train_step(state, x)  # warm-up (autograd, allocator)
    s: dict[str, list[float]] = {}
    for _ in range(max(ROUNDS, reps)):
        for mode in ("lazy", "eager"):
            cpu: list[float] = []
            before = _train_step(state, x, cpu)
            t = time.perf_counter()
            h = ck.async_save(next(n), state, lazy=mode == "lazy")
            pause = time.perf_counter() - t
            during = _train_step(state, x)
            lz = ck._async._lazy if ck._async is not None else None
            h.result()
            if lz is not None:  # the share of the bytes the step's pre-hook copied itself
                hook = sum(e.dst.nbytes for e in lz.entries if e.by_hook)
                s.setdefault("lazy: share copied in the step", []).append(
                    hook / max(1, sum(e.dst.nbytes for e in lz.entries))
                )
                copy_cpu, copy_wall = _copy_cpu(lz)
                s.setdefault("lazy copy CPU", []).append(copy_cpu)
                s.setdefault("lazy copy wall", []).append(copy_wall)
            after = _train_step(state, x, cpu)
            alone = (before + after) / 2
            s.setdefault("idle core-seconds in a step alone", []).append(
                CORES * alone - sum(cpu) / 2
            )
            s.setdefault("train step alone", []).append(alone)
            s.setdefault(f"train step after {mode} async_save", []).append(during)
            s.setdefault(f"{mode} pause (step rows)", []).append(pause)
            s.setdefault(f"{mode} step share", []).append(during / alone)
    ck.close()
    r.update({k: statistics.median(v) for k, v in s.items()})
    r["step samples"] = s
    # the best a lazy copy can do: its CPU fills the idle core-seconds of the step, the
    # rest is spread over every core inside the step
    idle, copy = r["idle core-seconds in a step alone"], r["lazy copy CPU"]
    r["lazy step floor"] = 1 + max(0.0, copy - max(0.0, idle)) / (CORES * r["train step alone"])
    # with no idle core the copy is paid inside the step at the copy's own best speed
    # when it cannot share the cores with the step's OpenMP team (a copier at the
    # training's priority made the step 1.31x, bench/README.md): the no-overlap bound
    r["lazy step, copy not overlapped"] = 1 + r["lazy copy wall"] / r["train step alone"]


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The lazy rows: seconds per size, then the two target ratios."""
    from checkpoint_async import _mark, _paired

    sizes = [f"{r['size_gib']:g} GiB" for r in rows]
    out = [
        "",
        "| lazy snapshot (issue 19) | " + " | ".join(sizes) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for k in (
        "memcpy into reused buffers",
        "ckrun async_save: pause",
        "ckrun async_save (lazy): pause",
        "ckrun async_save (lazy): time to durable",
        "train step alone",
        "train step after lazy async_save",
        "train step after eager async_save",
    ):
        out.append(f"| {k} | " + " | ".join(f"{r[k]:.4f} s" for r in rows) + " |")
    ratios = (
        (
            "lazy pause / memcpy into reused buffers (≤ 0.2)",
            lambda r: _paired(r, "ckrun async_save (lazy): pause", "memcpy into reused buffers"),
            0.2,
        ),
        (
            "eager pause / memcpy into reused buffers",
            lambda r: _paired(r, "ckrun async_save: pause", "memcpy into reused buffers"),
            None,
        ),
        (
            "step after lazy async_save / step alone (≤ 1.1)",
            lambda r: statistics.median(r["step samples"]["lazy step share"]),
            1.1,
        ),
        (
            "step after eager async_save / step alone",
            lambda r: statistics.median(r["step samples"]["eager step share"]),
            None,
        ),
    )
    out.append(
        "| cores busy in a step alone (of "
        + str(CORES)
        + ") | "
        + " | ".join(
            f"{CORES - r['idle core-seconds in a step alone'] / r['train step alone']:.2f}"
            for r in rows
        )
        + " |"
    )
    out.append(
        "| CPU seconds of the lazy copy (every thread) | "
        + " | ".join(f"{r['lazy copy CPU']:.4f} s" for r in rows)
        + " |"
    )
    out.append(
        "| floor of step after lazy / alone: the copy's CPU beyond the step's idle cores "
        "| " + " | ".join(f"{r['lazy step floor']:.2f}" for r in rows) + " |"
    )
    out.append(
        "| wall seconds of the lazy copy alone (best of copy_ and memmove) | "
        + " | ".join(f"{r['lazy copy wall']:.4f} s" for r in rows)
        + " |"
    )
    out.append(
        "| step alone + that copy, not overlapped / step alone | "
        + " | ".join(f"{r['lazy step, copy not overlapped']:.2f}" for r in rows)
        + " |"
    )
    out.append(
        "| lazy: share of the bytes copied inside the step (pre-hook) | "
        + " | ".join(
            f"{100 * statistics.median(r['step samples']['lazy: share copied in the step']):.0f} %"
            for r in rows
        )
        + " |"
    )
    for name, fn, limit in ratios:
        cells = [
            f"{fn(r):.2f}" + ("" if limit is None else f" {_mark(fn(r) <= limit)}") for r in rows
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out
