"""Issue 13 item 1: optimizer state follows parameters by name; real mismatches refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch
from ckrun.checkpoint import discovery, layout


class Two(torch.nn.Module):
    """Two same-shaped Linear layers; ``swap`` registers them in the other order."""

    def __init__(self, swap: bool = False, width: int = 4) -> None:
        super().__init__()
        if swap:
            self.b = torch.nn.Linear(4, width)
            self.a = torch.nn.Linear(4, 4)
        else:
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _state(swap: bool = False, width: int = 4) -> dict[str, Any]:
    model = Two(swap, width)
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=0.1)}


def _train(s: dict[str, Any], steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        s["model"](torch.randn(2, 4)).pow(2).sum().backward()
        s["optimizer"].step()
        s["optimizer"].zero_grad()


def _moments(s: dict[str, Any]) -> dict[str, torch.Tensor]:
    opt = s["optimizer"]
    return {n: opt.state[p]["exp_avg"].clone() for n, p in s["model"].named_parameters()}


def test_swapped_same_shape_modules_get_their_own_moments(run_dir: Path) -> None:
    s = _state()
    _train(s)
    want = _moments(s)
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        m = ck.save(1, s)
    assert m.signature is not None
    assert m.signature["modules"]["model"]["a.weight"] == {"shape": [4, 4], "dtype": "float32"}
    assert m.signature["optimizers"]["optimizer"][0][:2] == ["model.a.weight", "model.a.bias"]
    s2 = _state(swap=True)  # the refactor: b registered before a, same shapes
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        ck.load(s2)
    got = _moments(s2)
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{name} received another parameter's moments"
    assert torch.equal(s2["model"].a.weight, s["model"].a.weight)


def test_reshaped_parameter_refused_with_readable_diff(run_dir: Path) -> None:
    s = _state()
    _train(s, 1)
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        ck.save(1, s)
    with (
        ckrun.Checkpointer(str(run_dir), rng=False) as ck,
        pytest.raises(ckrun.IncompatibleCheckpoint) as ei,
    ):
        ck.load(_state(width=8))
    assert "model.b.weight: [4, 4] → [8, 4]" in ei.value.diff
    assert "model.b.bias: [4] → [8]" in ei.value.diff
    assert ck.resumed_from is None


def test_renamed_parameter_refused_unless_allowed(run_dir: Path) -> None:
    s = _state()
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        ck.save(1, s)
    renamed = {"model": torch.nn.ModuleDict({"a": s["model"].a, "c": s["model"].b})}
    renamed["optimizer"] = torch.optim.Adam(renamed["model"].parameters())
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        with pytest.raises(ckrun.IncompatibleCheckpoint) as ei:
            ck.load(renamed)
    assert "model.b.weight: [4, 4] → <absent>" in ei.value.diff
    assert "model.c.weight: <absent> → [4, 4]" in ei.value.diff
    # allowed: the gate passes (the model's own load_state_dict then decides)
    with ckrun.Checkpointer(str(run_dir), rng=False, allow_change=("signature",)) as ck:
        with pytest.raises(ckrun.CheckpointError, match="'model'"):
            ck.load(renamed)


def test_old_checkpoint_without_signature_loads_by_position(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = _state()
    _train(s)
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        m = ck.save(1, s)
    st = ckrun.open_storage(str(run_dir))
    body = json.loads(st.get(m.key))
    del body["signature"]  # what a manifest written before the signature looks like
    st.delete([m.key])
    st.put(m.key, json.dumps(body).encode())
    assert discovery.committed(st)[0].signature is None
    s2 = _state()
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        assert ck.load(s2) is not None
    assert "by position" in caplog.text
    assert all(torch.equal(_moments(s2)[n], t) for n, t in _moments(s).items())
    assert layout.COMPLETE  # layout imported for the keys above
