"""A tiny training loop under the supervisor, for the end-to-end tests.

It resumes with :meth:`ckrun.Checkpointer.from_env`, "trains" a small tensor
deterministically, checks :func:`ckrun.preemption_requested` at every step boundary,
saves and exits 75 on a notice, and finalizes at the last step.

Arguments: ``--steps N`` (total), ``--step-s S`` (seconds per step), ``--save-every K``,
``--ignore-notice`` (never checks the flag and ignores SIGTERM: tests the KILL), ``--workers W``
(a torch DataLoader with W worker processes feeds the steps), ``--crash-at STEP``
(exit 1 at that step in attempt 0 only), ``--hold-at STEP`` (in attempt 0, after step
STEP, wait up to 60 s for a notice: a test that preempts after ``step STEP`` then catches
the run mid-training on a machine of any speed).  Prints one ``step N`` line per step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import ckrun
import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--save-every", type=int, default=1000)
    ap.add_argument("--ignore-notice", action="store_true")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--hold-at", type=int, default=-1)
    a = ap.parse_args()

    ckpt = ckrun.Checkpointer.from_env(compat={"config": {"steps": a.steps}}, rng=False)
    if a.ignore_notice:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    state: dict[str, Any] = {"w": torch.zeros(4, dtype=torch.float64), "step": 0}
    m = ckpt.load(state)
    start = int(state["step"]) if m is not None else 0
    print(f"resumed {m.step if m else None} attempt {os.environ.get('CKRUN_ATTEMPT')}", flush=True)
    loader = None
    if a.workers:
        ds = torch.utils.data.TensorDataset(torch.arange(100000, dtype=torch.float64))
        loader = iter(torch.utils.data.DataLoader(ds, batch_size=1, num_workers=a.workers))
    for step in range(start, a.steps):
        if not a.ignore_notice and ckrun.preemption_requested():
            ckpt.save(step, state)
            print(f"saved {step} on notice", flush=True)
            return 75
        if step == a.crash_at and os.environ.get("CKRUN_ATTEMPT") == "0":
            print(f"crash at {step}", flush=True)
            return 1
        if loader is not None:
            next(loader)  # the workers must survive signals to the process group
        state["w"] = state["w"] * 0.5 + float(step)
        state["step"] = step + 1
        print(f"step {step + 1}", flush=True)
        time.sleep(a.step_s)
        if step + 1 == a.hold_at and os.environ.get("CKRUN_ATTEMPT") == "0":
            end = time.monotonic() + 60
            while not ckrun.preemption_requested() and time.monotonic() < end:
                time.sleep(0.01)
        if (step + 1) % a.save_every == 0:
            ckpt.save(step + 1, state)
    ckpt.finalize(a.steps, state)
    print("done", float(state["w"].sum()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
