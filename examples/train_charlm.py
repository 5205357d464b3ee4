"""A character-level causal transformer trained on real text, under ckrun.

The main job of the README: a small GPT-style language model trained on the Python
documentation text that ships with every CPython (``pydoc_data.topics``, about 465 KB),
or on any UTF-8 text file given with ``--data``.  It uses only ckrun's public API:

* ``ckrun.Checkpointer.from_env`` (the run's storage, attempt and compat gate come from the
  supervisor; outside the supervisor ``--storage`` is used);
* ``ckpt.load(state)`` to resume the whole run state (model, AdamW, LR schedule, every
  RNG, the sampler's position mid-epoch);
* ``ckpt.async_save`` for the periodic checkpoints: training resumes once the state is
  copied to host memory, the write happens in the background;
* ``ckrun.preemption_requested()`` at every step boundary, then an emergency ``save`` (it
  first waits for a background save in flight) and
  exit 75 (``ckrun.ExitCode.PREEMPTED``), which the supervisor turns into a requeue;
* ``ckpt.finalize`` for the final artifact and the completion marker.

Run it::

    ckrun submit examples/train_charlm.py -- --steps 600
    ckrun preempt <run>          # from a second terminal: the run saves, restarts, resumes

With ``--nproc-per-node N`` ckrun runs it under torchrun: each rank trains a
DistributedDataParallel replica on its ``1/N`` of every epoch (gloo on CPU) and only rank
0 prints.  A checkpoint of N processes resumes on another count (``--allow-change
launch_hash``: the world size is part of the launch identity).

With ``--fsdp`` the model is sharded with FSDP2 (``fully_shard`` per block, then the
root): parameters and AdamW state are DTensors and each rank saves only its shards
(``Checkpointer.save`` unchanged).  The checkpoint loads on any process count: N ranks
of FSDP2, or one process (which needs no sharding and trains the plain model)::

    ckrun submit --run lm --nproc-per-node 2 examples/train_charlm.py -- --fsdp --steps 600
    ckrun preempt lm              # saves, restarts on 2, resumes
    ckrun submit --run lm --nproc-per-node 4 --allow-change launch_hash \
        examples/train_charlm.py -- --fsdp --steps 600

On 2 CPU cores the default model (0.8 M parameters) trains at roughly 20k tokens/s and
600 steps take about two minutes; the loss falls from ~4.5 (uniform over the vocabulary)
to ~1.8.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from typing import Any

import ckrun
import torch
from torch import nn
from torch.nn import functional as F


def load_text(path: str | None) -> tuple[str, str]:
    """Return ``(text, dataset_version)``; the version is a hash of the bytes."""
    if path:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        name = os.path.basename(path)
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        name = "pydoc-{}.{}".format(*sys.version_info[:2])
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    return text, f"{name}-{digest}"


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """Decoder-only transformer over characters: (B, T) int64 → (B, T, vocab) logits."""

    def __init__(self, vocab: int, block: int, d: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1), persistent=False
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


class Chunks(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``block + 1`` characters: (input, next-char target)."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block
        self.n = (len(data) - 1) // block

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block
        w = self.data[s : s + self.block + 1]
        return w[:-1], w[1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="UTF-8 text file (default: CPython's pydoc topics)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block", type=int, default=64, help="context length in characters")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (more than 1 process)")
    p.add_argument(
        "--step-seconds", type=float, default=0.0, help="pace: sleep per step (drills, tests)"
    )
    p.add_argument(
        "--storage",
        default="ckrun-runs/charlm-standalone",
        help="checkpoint storage when not run under the ckrun supervisor",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    text, dataset_version = load_text(args.data)
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n_val = len(data) // 20
    train, val = Chunks(data[:-n_val], args.block), Chunks(data[-n_val:], args.block)

    model = CharLM(len(vocab), args.block, args.d_model, args.layers, args.heads, args.dropout)
    sharded = args.fsdp and world > 1
    if sharded:  # FSDP2: each block, then the root; parameters become DTensors
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    # DDP averages the gradients; the state saved is the unwrapped model's
    net = nn.parallel.DistributedDataParallel(model) if world > 1 and not sharded else model

    def lr_factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    sampler = ckrun.ResumableSampler(
        len(train), shuffle=True, seed=args.seed, num_replicas=world, rank=rank
    )

    skip = ("steps", "log_every", "storage", "fsdp")  # FSDP2 or not: the same experiment
    hparams = {k: v for k, v in vars(args).items() if k not in skip}
    ckpt = ckrun.Checkpointer.from_env(
        default_storage=args.storage,  # only outside the supervisor (CKRUN_STORAGE wins)
        compat={
            "config": hparams,
            "model_version": "charlm-v1",
            "dataset_version": dataset_version,
            "precision": "fp32",
        },
        keep_last=args.keep_last,
    )
    state: dict[str, Any] = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "sampler": sampler,
    }
    manifest = ckpt.load(state)
    start = manifest.step + 1 if manifest else 0
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"charlm: {n_params / 1e6:.2f} M parameters, vocab {len(vocab)}, "
        f"{len(text) / 1e3:.0f} kB of {dataset_version}, {world} process(es), "
        + (f"resumed at step {start}" if manifest else "starting from scratch")
    )

    batches = iter_batches(train, sampler, args.batch)
    t0, tokens, loss_sum, n_loss = time.perf_counter(), 0, 0.0, 0
    model.train()
    for step in range(start, args.steps):
        x, y = next(batches)
        logits = net(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if args.step_seconds:
            time.sleep(args.step_seconds)
        tokens += x.numel()
        loss_sum += loss.item()
        n_loss += 1
        if (step + 1) % args.log_every == 0:
            dt = time.perf_counter() - t0
            log(
                f"step {step + 1:5d}/{args.steps}  loss {loss_sum / n_loss:.3f}  "
                f"lr {sched.get_last_lr()[0]:.2e}  {tokens * world / dt:,.0f} tok/s"
            )
            t0, tokens, loss_sum, n_loss = time.perf_counter(), 0, 0.0, 0
        last = step == args.steps - 1
        if ckrun.preemption_requested(sync=True):  # every rank stops at the same step
            m = ckpt.save(step, state)
            n = ckrun.control.read_notice()  # what stops us: a preemption, Ctrl-C, a drill
            why = f"{n.kind} notice ({n.source})" if n else "notice"
            log(f"{why}: checkpoint step {m.step} committed, exiting 75")
            return int(ckrun.ExitCode.PREEMPTED)
        if (step + 1) % args.ckpt_every == 0 and not last:
            ckpt.async_save(step, state)  # blocks for the snapshot only; persists behind

    # an FSDP2 forward is a collective: every rank evaluates and samples then
    val_loss = evaluate(model, val, args.batch) if rank == 0 or sharded else math.nan
    ckpt.finalize(args.steps - 1, state)
    log(f"done: {args.steps} steps, validation loss {val_loss:.3f}")
    if rank == 0 or sharded:
        log("sample: " + repr(generate(model, vocab, stoi, "def ", 120, args.block)))
    return 0


def iter_batches(ds: Chunks, sampler: Any, batch: int) -> Any:
    """Endless (B, T) batches in the sampler's order; the sampler tracks the position."""
    while True:
        idx: list[int] = []
        for i in sampler:
            idx.append(i)
            if len(idx) == batch:
                xs, ys = zip(*(ds[j] for j in idx), strict=False)
                yield torch.stack(xs), torch.stack(ys)
                idx = []


@torch.no_grad()
def evaluate(model: CharLM, ds: Chunks, batch: int) -> float:
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(ds), batch):
        xs, ys = zip(*(ds[j] for j in range(s, min(len(ds), s + batch))), strict=False)
        logits = model(torch.stack(xs))
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.stack(ys).reshape(-1), reduction="sum"
        ).item()
        n += sum(y.numel() for y in ys)
    model.train()
    return total / max(1, n)


@torch.no_grad()
def generate(
    model: CharLM, vocab: list[str], stoi: dict[str, int], prompt: str, n: int, block: int
) -> str:
    model.eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([[stoi.get(c, 0) for c in prompt]])
    for _ in range(n):
        logits = model(idx[:, -block:])[:, -1] / 0.8
        nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=g)
        idx = torch.cat([idx, nxt], 1)
    return "".join(vocab[i] for i in idx[0].tolist())


if __name__ == "__main__":
    try:
        code = main()
    finally:
        if torch.distributed.is_initialized():  # gloo's threads must not outlive the
            torch.distributed.destroy_process_group()  # interpreter (an abort at exit)
    sys.exit(code)
