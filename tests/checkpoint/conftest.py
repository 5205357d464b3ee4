"""Fixtures of the checkpoint tests: a tiny training state, real small/read-only mounts."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckrun

COMPAT = {"config": {"lr": 1e-3, "batch": 8}, "model_version": "v1",
          "dataset_version": "d1", "precision": "fp32"}


def make_state(seed: int = 0, width: int = 16) -> dict[str, Any]:
    """A small model + AdamW + StepLR + sampler + extras, after two training steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched,
            "sampler": ckrun.ResumableSampler(100, seed=3), "extra": {"epoch": 0}}


def params_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["model"].state_dict().values(),
                                                 b["model"].state_dict().values(), strict=True))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 512 KiB tmpfs (root only, skipped otherwise)."""
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "512k"):
        pytest.skip("mounting a small tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def remount_ro(mnt: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot remount read-only")
