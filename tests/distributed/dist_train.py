"""A small DDP training program for the distributed tests (gloo, CPU, deterministic).

Runs alone (one process), under ``torchrun`` or with ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` set by the test.  Model: Linear(8, 4) + SGD with
momentum; data: 96 fixed samples through a ResumableSampler (4 per rank per step); the
inputs get noise from the global torch RNG so a wrong RNG restore changes the result.

Options:
    --steps N           train to step N, then finalize (COMPLETE.json)
    --save-every K      periodic save every K steps (0: never)
    --dump PATH         rank 0 writes the final parameters (JSON) there
    --load-only PATH    load the newest checkpoint, write every rank's parameters and
                        sampler state to PATH.<rank>.json, exit (no training)
    --progress PATH     rank 0 writes the current step there each step
    --step-s S          sleep S seconds per step (paces the run for notice tests)
    --fault SPEC        fault injection for save tests, ``MODE:RANK:STEP``: ``kill``
                        (SIGKILL itself after writing part of its shard) or ``hang``
                        (block inside the shard write) in that rank's first save of a
                        step >= STEP
    --pid-dir DIR       every rank writes its pid to DIR/<rank>
    --hold-at N         in attempt 0, after step N, wait (at most 3000 checks of 0.02 s,
                        the same count on every rank) for a notice: a test that sends it
                        after step N catches the run mid-training on any machine
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from ckrun import Checkpointer, ResumableSampler, preemption_requested
from ckrun.checkpoint import layout
from ckrun.storage.local import LocalStorage

N_SAMPLES, BATCH = 96, 4


class FaultyWriter:
    """Wraps a real writer: after 4 KiB of its shard, SIGKILL this process or block."""

    def __init__(self, inner: Any, mode: str):
        self.inner, self.mode, self.n = inner, mode, 0

    def write(self, data: Any) -> int:
        if self.n >= 4096:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # hang: only the supervisor's deadline ends this
                time.sleep(1)
        self.n += len(data)
        return int(self.inner.write(data))

    def commit(self) -> Any:
        return self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class FaultyStorage(LocalStorage):
    """A real LocalStorage whose shard write of one step fails as ``--fault`` says."""

    def __init__(self, root: str, mode: str, step: int):
        super().__init__(root)
        self.mode, self.step = mode, step

    def open_write(self, key: str) -> Any:
        w = super().open_write(key)
        parsed = layout.parse(key)
        if parsed is not None and not parsed.is_manifest and parsed.step >= self.step:
            return FaultyWriter(w, self.mode)
        return w


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, 8, generator=g)
    return x, x @ torch.randn(8, 4, generator=g)


def build(rank: int, world: int) -> tuple[torch.nn.Module, torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 4)
    model = net
    if world == 2:
        model = torch.nn.parallel.DistributedDataParallel(net)
    # With more than 2 ranks, DDP's reduction order is not stable across a restart: it
    # rebuilds its gradient buckets after the first iteration of each process, so the
    # first step after a resume sums the ranks' gradients in another order than the
    # uninterrupted run did (1-ulp differences).  Bit-exact resume then needs a fixed
    # reduction order: all_reduce_grads() below, parameter by parameter.
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sampler = ResumableSampler(N_SAMPLES, seed=7, num_replicas=world, rank=rank)
    return net, model, opt, sampler


def all_reduce_grads(net: torch.nn.Module, world: int) -> None:
    """Average gradients over the ranks in a fixed order (what DDP does, minus buckets)."""
    import torch.distributed as dist

    for p in net.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def storage_for(args: argparse.Namespace, rank: int) -> Any:
    root = os.environ["CKRUN_STORAGE"]
    if args.fault:
        mode, frank, fstep = args.fault.split(":")
        if int(frank) == rank:  # from_env prefers CKRUN_STORAGE over a Storage object
            os.environ.pop("CKRUN_STORAGE")
            return FaultyStorage(root, mode, int(fstep))
    return root


def dump(path: str, net: torch.nn.Module, extra: dict[str, Any] | None = None) -> None:
    body = {k: v.tolist() for k, v in net.state_dict().items()}
    body.update(extra or {})
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--dump", default="")
    p.add_argument("--load-only", default="")
    p.add_argument("--progress", default="")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--fault", default="")
    p.add_argument("--pid-dir", default="")
    p.add_argument("--hold-at", type=int, default=-1)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, str(rank)), "w") as f:
            f.write(str(os.getpid()))
    torch.use_deterministic_algorithms(True)
    net, model, opt, sampler = build(rank, world)
    state = {"model": net, "optimizer": opt, "sampler": sampler, "extra": {"step": 0}}
    ckpt = Checkpointer.from_env(storage=storage_for(args, rank))
    ckpt.load(state)
    step = int(state["extra"]["step"])
    if args.load_only:
        dump(
            f"{args.load_only}.{rank}.json",
            net,
            {"sampler": sampler.state_dict(), "step": step, "world": world},
        )
        return 0
    x, y = data()
    it = iter(sampler)
    while step < args.steps:
        if preemption_requested(sync=True):
            ckpt.save(step, state)
            return 75
        idx = []
        while len(idx) < BATCH:
            try:
                idx.append(next(it))
            except StopIteration:
                it = iter(sampler)
        xb = x[idx] + 0.01 * torch.randn(BATCH, 8)
        loss = torch.nn.functional.mse_loss(model(xb), y[idx])
        opt.zero_grad()
        loss.backward()
        if world > 2:
            all_reduce_grads(net, world)
        opt.step()
        step += 1
        state["extra"]["step"] = step
        if args.progress and rank == 0:
            with open(args.progress, "w") as f:
                f.write(str(step))
        if args.save_every and step % args.save_every == 0:
            ckpt.save(step, state)
        if args.step_s:
            time.sleep(args.step_s)
        if step == args.hold_at and os.environ.get("CKRUN_ATTEMPT", "0") == "0":
            for _ in range(3000):  # every rank agrees each time: the loops end together
                if preemption_requested(sync=True):
                    break
                time.sleep(0.02)
    ckpt.finalize(step, state)
    if args.dump and rank == 0:
        dump(args.dump, net)
    return 0


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():  # before interpreter exit: gloo's threads must not outlive it
        dist.destroy_process_group()
    sys.exit(code)
