"""A script that keeps its own ``torch.save`` checkpoint and knows nothing of ckrun
(nanoGPT-style: ``init_from=resume`` loads ``out/ckpt.pt``), for the own-checkpoint tests.

Every step's batch comes from a generator seeded by the step number, so a resume from
the script's own checkpoint (model, optimizer, iter_num) is exact.  Prints one line per
start: ``START iter=N`` (N = the step it resumes at).

``--die-mid-save N``: on attempt 0, the Nth save writes half of its bytes to the
checkpoint file and the process SIGKILLs itself (a kill mid-write).
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--out", default="out")
p.add_argument("--save-every", type=int, default=5)
p.add_argument("--step-seconds", type=float, default=0.0)
p.add_argument("--die-mid-save", type=int, default=0)
p.add_argument("rest", nargs="*")
a = p.parse_args()
init_from = "resume" if "init_from=resume" in a.rest else "scratch"
path = os.path.join(a.out, "ckpt.pt")

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
iter_num = 0
if init_from == "resume":
    ck = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    iter_num = ck["iter_num"] + 1
print(f"START iter={iter_num} init_from={init_from}", flush=True)
saves = 0
while iter_num < a.steps:
    g = torch.Generator().manual_seed(iter_num)
    x = torch.randn(16, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if a.step_seconds:
        time.sleep(a.step_seconds)
    if iter_num % a.save_every == 0 or iter_num == a.steps - 1:
        saves += 1
        ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": iter_num}
        os.makedirs(a.out, exist_ok=True)
        if a.die_mid_save and saves == a.die_mid_save and os.environ.get("CKRUN_ATTEMPT") == "0":
            buf = io.BytesIO()
            torch.save(ck, buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        torch.save(ck, path)
    iter_num += 1
print("DONE", flush=True)
