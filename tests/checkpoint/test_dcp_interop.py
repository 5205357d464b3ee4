"""DCP interop (issue 14): ``ckrun export --format dcp`` writes what ``dcp.load`` reads;
``Checkpointer.load(state, from_dcp=PATH)`` seeds a run from a DCP checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckrun import Checkpointer


def _state(seed: int, steps: int = 1) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(steps):
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
    return {"model": net, "optimizer": opt, "extra": {"step": steps}}


def test_export_dcp_is_read_by_dcp_load(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state(0, steps=2)
    with Checkpointer(str(tmp_path / "run"), lock=False) as ck:
        ck.save(2, state)
    out = tmp_path / "dcp"
    r = subprocess.run(
        [sys.executable, "-m", "ckrun.cli", "export", str(tmp_path / "run"), "--format", "dcp",
         "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "exported step 2" in r.stdout and (out / ".metadata").is_file()
    other = _state(1)
    sd = {
        "model": other["model"].state_dict(),
        "optimizer": other["optimizer"].state_dict(),
        "extra": {"step": 0},
    }
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(sd["model"][k], v), k
    want = state["optimizer"].state_dict()["state"]
    for i, st in want.items():
        for k, v in st.items():
            assert torch.equal(sd["optimizer"]["state"][i][k], v), (i, k)
    assert sd["extra"]["step"] == 2
    again = subprocess.run(
        [sys.executable, "-m", "ckrun.cli", "export", str(tmp_path / "run"), "--format", "dcp",
         "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 2 and "not an empty directory" in again.stderr


def test_a_dcp_checkpoint_seeds_a_run_and_the_run_resumes(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = _state(0, steps=3)
    path = tmp_path / "titan"
    dcp.save(
        {
            "model": src["model"].state_dict(),
            "optimizer": src["optimizer"].state_dict(),
            "extra": {"step": 3},
        },
        checkpoint_id=str(path),
        no_dist=True,
    )
    fresh = _state(5, steps=0)
    with Checkpointer(str(tmp_path / "run"), lock=False) as ck:
        assert ck.load(fresh, from_dcp=str(path)) is None  # nothing of its own yet
        assert fresh["extra"]["step"] == 3
        for a, b in zip(fresh["model"].parameters(), src["model"].parameters(), strict=True):
            assert torch.equal(a, b)
        got = fresh["optimizer"].state_dict()["state"]
        assert torch.equal(
            got[1]["exp_avg_sq"], src["optimizer"].state_dict()["state"][1]["exp_avg_sq"]
        )
        # one more step of the seeded run equals one more step of the source
        for st in (fresh, src):
            torch.manual_seed(9)
            st["optimizer"].zero_grad()
            st["model"](torch.randn(4, 8)).sum().backward()
            st["optimizer"].step()
        assert torch.equal(fresh["model"][0].weight, src["model"][0].weight)
        ck.save(4, fresh)
    resumed = _state(6, steps=0)
    with Checkpointer(str(tmp_path / "run"), lock=False) as ck:
        m = ck.load(resumed, from_dcp=str(path))  # its own checkpoint wins over the seed
    assert m is not None and m.step == 4
    assert torch.equal(resumed["model"][0].weight, src["model"][0].weight)


def test_from_dcp_refuses_a_directory_without_metadata(tmp_path: Path) -> None:
    from ckrun.errors import ConfigError

    with (
        Checkpointer(str(tmp_path / "run"), lock=False) as ck,
        pytest.raises(ConfigError, match="not a torch.distributed.checkpoint"),
    ):
        ck.load(_state(0, steps=0), from_dcp=str(tmp_path))
