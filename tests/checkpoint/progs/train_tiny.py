"""A tiny but complete training loop for the exact-resume test (run as a child process).

Usage: python train_tiny.py RUN_DIR TOTAL_STEPS STOP_AT OUT
    Trains optimizer steps 1..TOTAL_STEPS, resuming from RUN_DIR when it holds a
    checkpoint.  After step STOP_AT (> 0) it saves and exits 75, like a preempted job.
    After the last step it finalizes and writes every parameter, optimizer, scheduler
    and scaler tensor to OUT (torch.save of tensors only).

Exercises: dropout (global torch RNG), python/numpy RNG draws, a shuffled dataset read
through ckrun.ResumableSampler across epoch boundaries, AdamW, a LambdaLR-free scheduler
(OneCycleLR), a CPU GradScaler with bf16 autocast, gradient accumulation (2 micro-batches
per optimizer step) and a periodic save every 4 steps (with ``CKRUN_TEST_ASYNC=1`` the
periodic and the stop saves are ``async_save``: the process exits with one in flight).
"""

from __future__ import annotations

import os
import random
import sys

import ckrun
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

ACCUM = 2


def main() -> int:
    run_dir, total, stop_at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    g = torch.Generator().manual_seed(123)
    data = TensorDataset(torch.randn(44, 6, generator=g), torch.randn(44, 1, generator=g))
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=total + 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    sampler = ckrun.ResumableSampler(data, seed=11)
    # DataLoader draws a base seed for every new iterator from its generator (default: the
    # global torch RNG); a dedicated generator keeps the global stream identical when the
    # resumed process creates an iterator mid-epoch.
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    extra = {"noise": 0.0}
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "sampler": sampler,
        "extra": extra,
    }
    ck = ckrun.Checkpointer(
        storage=run_dir,
        compat={
            "config": {"lr": 3e-3},
            "model_version": "tiny",
            "dataset_version": "synthetic",
            "precision": "bf16",
        },
        keep_last=2,
    )
    # CKRUN_TEST_ASYNC=1: background saves (issue 7)
    save = ck.async_save if os.environ.get("CKRUN_TEST_ASYNC") == "1" else ck.save
    m = ck.load(state)
    start = m.step + 1 if m else 1
    it = iter(loader)

    def batch() -> list[torch.Tensor]:
        nonlocal it
        try:
            return next(it)  # type: ignore[no-any-return]
        except StopIteration:
            it = iter(loader)
            return next(it)  # type: ignore[no-any-return]

    for step in range(start, total + 1):
        for _ in range(ACCUM):
            x, y = batch()
            x = x + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / ACCUM
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        extra["noise"] += float(torch.rand(()))
        if step == stop_at:
            save(step, state)  # async: exits with the save in flight, drained at exit
            return 75
        if step % 4 == 0:
            save(step, state)
    ck.finalize(total, state)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        tensors.update({f"opt.{pid}.{k}": v for k, v in st.items()})
    tensors["scaler.scale"] = torch.tensor(scaler.get_scale())
    tensors["sched.last_lr"] = torch.tensor(sched.get_last_lr())
    tensors["extra.noise"] = torch.tensor(extra["noise"], dtype=torch.float64)
    tensors["sampler"] = torch.tensor([sampler.epoch, sampler.position])
    torch.save(tensors, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
