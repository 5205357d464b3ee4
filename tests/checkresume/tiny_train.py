"""A tiny deterministic training loop for check-resume tests.

``--bug`` breaks resume on purpose:
  no-sampler      the sampler is left out of the checkpointed state (data order)
  no-scheduler    the LR scheduler is left out of the checkpointed state
  extra-draw      a random draw between load() and the first step (RNG stream)
"""

from __future__ import annotations

import argparse
import sys

import ckrun
import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--bug", default="")
a = p.parse_args()

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
X = torch.randn(64, 8)
Y = X @ torch.randn(8, 1)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
sampler = ckrun.ResumableSampler(len(X), shuffle=True, seed=3)
state = {"model": model, "optimizer": opt}
if a.bug != "no-sampler":
    state["sampler"] = sampler
if a.bug != "no-scheduler":
    state["scheduler"] = sched
ckpt = ckrun.Checkpointer.from_env(compat={"model_version": "tiny"}, keep_last=2)
m = ckpt.load(state)
if m is not None and a.bug == "extra-draw":
    torch.rand(1)
it = iter(sampler)


def batch() -> list[int]:
    global it
    out: list[int] = []
    while len(out) < 8:
        try:
            out.append(next(it))
        except StopIteration:
            it = iter(sampler)
    return out


for step in range(m.step + 1 if m else 0, a.steps):
    idx = batch()
    loss = ((model(X[idx]) - Y[idx]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if ckrun.preemption_requested():
        ckpt.save(step, state)
        sys.exit(75)
ckpt.finalize(a.steps - 1, state)
