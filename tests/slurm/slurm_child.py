"""A tiny deterministic trainer for the Slurm end-to-end tests (runs under ``ckrun run``).

Linear regression with SGD + momentum on float64 tensors; the batch of step ``k`` comes
from a generator seeded with ``k``, so an interrupted and resumed run computes exactly
the same parameters as an uninterrupted one (:func:`uninterrupted`).  It resumes with
``ckrun.Checkpointer.from_env``, checks ``ckrun.preemption_requested()`` at each step
boundary (then saves and exits 75), and finalizes at the last step.

Arguments: ``--steps N``, ``--step-s S`` (sleep per step), ``--out FILE`` (final parameters
as float.hex JSON), ``--starts FILE`` (one line per start of this process, fsynced).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

DIM = 8


def initial_state() -> dict[str, Any]:
    """Step 0: fixed weights, zero momentum."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(DIM, generator=g, dtype=torch.float64),
        "m": torch.zeros(DIM, dtype=torch.float64),
        "step": 0,
    }


def train_step(state: dict[str, Any], step: int, lr: float = 0.05, beta: float = 0.9) -> None:
    """One SGD-with-momentum step on batch ``step`` (16 x DIM), in place."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, DIM, generator=g, dtype=torch.float64)
    y = x @ torch.arange(1.0, DIM + 1, dtype=torch.float64) + 0.01 * torch.randn(
        16, generator=g, dtype=torch.float64
    )
    grad = 2.0 * x.T @ (x @ state["w"] - y) / x.shape[0]
    state["m"] = beta * state["m"] + grad
    state["w"] = state["w"] - lr * state["m"]
    state["step"] = step + 1


def uninterrupted(steps: int) -> list[str]:
    """Final parameters of a run that was never interrupted, as float.hex strings."""
    state = initial_state()
    for step in range(steps):
        train_step(state, step)
    return [float(v).hex() for v in state["w"]]


def _append_line(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> int:
    import ckrun

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--step-s", type=float, default=0.25)
    ap.add_argument("--out", required=True)
    ap.add_argument("--starts", required=True)
    a = ap.parse_args()
    attempt = os.environ.get("CKRUN_ATTEMPT", "?")
    _append_line(a.starts, f"attempt {attempt} pid {os.getpid()}")
    ckpt = ckrun.Checkpointer.from_env(compat={"config": {"steps": a.steps}}, rng=False)
    state = initial_state()
    m = ckpt.load(state)
    print(f"child attempt {attempt} resumed from {m.step if m else None}", flush=True)
    for step in range(int(state["step"]), a.steps):
        if ckrun.preemption_requested():
            ckpt.save(step, state)
            print(f"child saved step {step} on notice", flush=True)
            return 75
        train_step(state, step)
        if (step + 1) % 10 == 0:
            print(f"step {step + 1}", flush=True)
        time.sleep(a.step_s)
    ckpt.finalize(a.steps, state)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump([float(v).hex() for v in state["w"]], f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, a.out)
    print("child done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
