"""Shared helpers of the checkpoint tests (a unique module name: conftest is ambiguous)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch

COMPAT = {
    "config": {"lr": 1e-3, "batch": 8},
    "model_version": "v1",
    "dataset_version": "d1",
    "precision": "fp32",
}


def make_state(seed: int = 0, width: int = 16) -> dict[str, Any]:
    """A small model + AdamW + StepLR + sampler + extras, after two training steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "sampler": ckrun.ResumableSampler(100, seed=3),
        "extra": {"epoch": 0},
    }


def params_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(
            a["model"].state_dict().values(), b["model"].state_dict().values(), strict=True
        )
    )


def remount_ro(mnt: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot remount read-only")
