"""``ckrun.save`` / ``ckrun.load``: the torch.save drop-in (issue 15)."""

from __future__ import annotations

import os
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import fileset
from ckrun.checkpoint.discovery import committed
from ckrun.errors import CorruptCheckpoint
from ckrun.storage import open_storage


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def test_roundtrip_with_live_primitives_and_callables(tmp_path: Path) -> None:
    model, ns = _model(), {"iter_num": 7, "best_val_loss": 1.5}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    path = str(tmp_path / "out" / "ckpt.pt")
    state = {
        "model": model,
        "optimizer": opt,
        "cfg": lambda: {"lr": 0.1},
        **ckrun.live(ns, "iter_num", "best_val_loss"),
    }
    ckrun.save(state, path)
    ns["iter_num"] = 8  # the saved value was read at save time, not later
    ckrun.save(state, path)
    raw = ckrun.load(path)
    assert raw["iter_num"] == 8 and raw["best_val_loss"] == 1.5 and raw["cfg"] == {"lr": 0.1}
    assert torch.equal(raw["model"]["weight"], model.weight)
    # restore in place, live references written back
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    ns2 = {"iter_num": 0, "best_val_loss": 9.0}
    ckrun.load(
        path,
        into={"model": model2, "optimizer": opt2, **ckrun.live(ns2, "iter_num", "best_val_loss")},
    )
    assert ns2 == {"iter_num": 8, "best_val_loss": 1.5}
    assert torch.equal(model2.weight, model.weight)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    with open(path, "rb") as f:  # no pickle: the file starts with the ckrun shard magic
        assert f.read(8) == b"CKRUNSH1"


def test_damaged_or_truncated_file_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    ckrun.save({"w": torch.arange(1000.0), "iter_num": 3}, path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpoint, match="trailer"):
        ckrun.load(path)
    flipped = bytearray(data)
    flipped[5000] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(flipped))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        ckrun.load(path)


def test_save_is_atomic_a_failed_save_keeps_the_old_file(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt.pt")
    ckrun.save({"iter_num": 1}, path)
    with pytest.raises(ckrun.CheckpointError):
        ckrun.save({"iter_num": 2, "bad": object()}, path)
    assert ckrun.load(path)["iter_num"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_under_the_supervisor_save_commits_and_load_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv("CKRUN_STORAGE", str(run))
    monkeypatch.setenv("CKRUN_ATTEMPT", "0")
    monkeypatch.chdir(tmp_path)
    ckrun.save({"iter_num": 5, "w": torch.ones(3)}, "out/ckpt.pt")
    ms = committed(open_storage(str(run)))
    assert [m.step for m in ms] == [5] and fileset.is_file_set(ms[0])
    os.unlink("out/ckpt.pt")  # a new machine: the local file is gone
    got = ckrun.load("out/ckpt.pt")
    assert got["iter_num"] == 5 and torch.equal(got["w"], torch.ones(3))
