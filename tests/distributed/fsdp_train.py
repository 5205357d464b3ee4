"""A small transformer trained with FSDP2, DDP or one process (gloo, CPU, deterministic).

For the sharded-state tests (issue 14).  Runs alone, under ``torchrun``/``ckrun submit``
or with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set by the test.
Model: Embedding(32, 16) + TransformerEncoderLayer(16, 2 heads, 32) + Linear(16, 32),
AdamW; ``--layout fsdp`` shards it with ``fully_shard`` (the block, then the root: model
and optimizer state are DTensors), ``ddp`` keeps it replicated and averages gradients
parameter by parameter in a fixed order, ``single`` needs one process.  Data: 96 fixed
token sequences through a ResumableSampler (4 per rank per step); 10 % of the input
tokens are masked with the global torch RNG, so a wrong RNG restore changes the result.

Options:
    --layout L          fsdp (default), ddp or single
    --steps N           train to step N, then finalize
    --save-every K      periodic save every K steps (0: never)
    --dump PATH         write the gathered model and optimizer state to PATH (rank 0)
    --load-only PATH    load the newest checkpoint, write the gathered state each rank
                        sees to PATH.<rank>.pt, exit
    --progress PATH     rank 0 writes the current step there each step
    --step-s S          sleep S seconds per step
    --fault SPEC        as dist_train.py (``kill:RANK:STEP``)
    --pid-dir DIR       every rank writes its pid to DIR/<rank>
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from ckrun import Checkpointer, ResumableSampler, preemption_requested
from dist_train import storage_for

N_SAMPLES, BATCH, VOCAB, SEQ = 96, 4, 32, 8


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(x)))


def build(layout: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny()
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "single" and world != 1:
        raise SystemExit("--layout single needs one process")
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def gathered(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Full tensors of the model and optimizer state (a collective under FSDP2)."""

    def full(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    out: dict[str, Any] = {f"model.{k}": full(v) for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{pid}.{k}"] = full(v)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="fsdp", choices=["fsdp", "ddp", "single"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--dump", default="")
    p.add_argument("--load-only", default="")
    p.add_argument("--progress", default="")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--fault", default="")
    p.add_argument("--pid-dir", default="")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or args.layout == "fsdp":
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, str(rank)), "w") as f:
            f.write(str(os.getpid()))
    torch.use_deterministic_algorithms(True)
    model, opt = build(args.layout, world)
    sampler = ResumableSampler(N_SAMPLES, seed=7, num_replicas=world, rank=rank)
    state = {"model": model, "optimizer": opt, "sampler": sampler, "extra": {"step": 0}}
    ckpt = Checkpointer.from_env(storage=storage_for(args, rank))
    try:
        return run(args, ckpt, state, model, opt, sampler, world, rank)
    finally:
        ckpt.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run(
    args: argparse.Namespace,
    ckpt: Checkpointer,
    state: dict[str, Any],
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sampler: ResumableSampler,
    world: int,
    rank: int,
) -> int:
    ckpt.load(state)
    step = int(state["extra"]["step"])
    if args.load_only:
        body = gathered(model, opt)
        body.update(step=step, world=world, sampler=sampler.state_dict())
        body["opt_types"] = sorted(
            {type(v).__name__ for st in opt.state.values() for k, v in st.items() if k != "step"}
        )
        torch.save(body, f"{args.load_only}.{rank}.pt")
        return 0
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (N_SAMPLES, SEQ + 1), generator=g)
    it = iter(sampler)
    while step < args.steps:
        if preemption_requested(sync=True):
            ckpt.save(step, state)
            return 75
        idx: list[int] = []
        while len(idx) < BATCH:
            try:
                idx.append(next(it))
            except StopIteration:
                it = iter(sampler)
        x, y = tokens[idx, :-1], tokens[idx, 1:]
        x = torch.where(torch.rand(x.shape) < 0.1, torch.zeros_like(x), x)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if args.layout == "ddp" and world > 1:
            for prm in model.parameters():  # fixed reduction order (see dist_train.py)
                if prm.grad is not None:
                    dist.all_reduce(prm.grad)
                    prm.grad /= world
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
    ckpt.finalize(step, state)
    body = gathered(model, opt)
    if args.dump and rank == 0:
        torch.save(body, args.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
