"""Deterministic training child for the spot end-to-end test (tests/cloud/test_spot_e2e.py).

Under ``ckrun run`` it uses ``Checkpointer.from_env`` (CKRUN_STORAGE: the S3 run root);
alone it checkpoints to ``SPOT_REF_STORAGE`` (the uninterrupted reference run).  Batches
are derived from the step number, so an interrupted and an uninterrupted run see the same
data.  Progress goes to ``SPOT_PROGRESS`` (last step), final parameters to ``SPOT_OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ckrun
import torch

STEPS = int(os.environ.get("SPOT_STEPS", "300"))
SAVE_EVERY = 25
STEP_SLEEP_S = float(os.environ.get("SPOT_STEP_SLEEP_S", "0.04"))


def _write(path: str | None, body: object) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(body, f)
        os.replace(path + ".tmp", path)


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = {"model": model, "optimizer": opt}
    if os.environ.get("CKRUN_STORAGE"):
        ck = ckrun.Checkpointer.from_env(compat={"model_version": 1})
    else:
        ck = ckrun.Checkpointer(os.environ["SPOT_REF_STORAGE"], {"model_version": 1})
    m = ck.load(state)
    for step in range((m.step if m else 0) + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 16, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        _write(os.environ.get("SPOT_PROGRESS"), {"step": step, "pid": os.getpid()})
        if ckrun.preemption_requested():
            ck.save(step, state)
            return int(ckrun.ExitCode.PREEMPTED)
        if step % SAVE_EVERY == 0:
            ck.save(step, state)
        time.sleep(STEP_SLEEP_S)
    ck.finalize(STEPS, state)
    _write(os.environ.get("SPOT_OUT"), [p.detach().flatten().tolist() for p in model.parameters()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
