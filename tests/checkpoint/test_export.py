"""Issue 13 item 8: read-only loading, export round trips, verify/ls wording."""

from __future__ import annotations

import json
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.cli.checkpoints import export, ls, verify
from click.testing import CliRunner


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _trained_run(run_dir: Path) -> dict[str, object]:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt, "extra": {"epoch": 1}}
    with ckrun.Checkpointer(str(run_dir), rng=False) as ck:
        for step in range(3):
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, state)
        ck.finalize(3, state)
    return state


def test_load_weights_reads_final_without_lock_or_compat(run_dir: Path) -> None:
    state = _trained_run(run_dir)
    final = state["model"]
    assert isinstance(final, torch.nn.Module)
    with ckrun.Checkpointer(str(run_dir), compat={"model_version": "other"}) as writer:
        writer.latest()  # another process/object may hold the run: reading is not writing
        fresh = _model()
        m = ckrun.load_weights(str(run_dir), fresh)
    assert m.kind == "final" and m.step == 3
    for a, b in zip(fresh.state_dict().values(), final.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    older = _model()
    assert ckrun.load_weights(str(run_dir), older, step=1).step == 1
    with pytest.raises(ckrun.CkrunError, match="no committed checkpoint at step 9"):
        ckrun.load_weights(str(run_dir), _model(), step=9)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_round_trips_into_a_fresh_model(run_dir: Path, tmp_path: Path, fmt: str) -> None:
    state = _trained_run(run_dir)
    final = state["model"]
    assert isinstance(final, torch.nn.Module)
    out = tmp_path / f"model.{fmt}"
    r = CliRunner().invoke(export, [str(run_dir), "--format", fmt, "-o", str(out), "--optimizer"])
    assert r.exit_code == 0, r.output
    assert "exported step 3 (final)" in r.output
    if fmt == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        tensors = load_file(str(out))
        sd = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}
        moment = tensors["optimizer.state.model.0.weight.exp_avg"]
        with safe_open(str(out), "pt") as f:
            meta = f.metadata()
        assert meta["ckrun.step"] == "3"
        groups = json.loads(meta["optimizer"])["param_groups"]
        assert groups[0]["param_names"][0] == "model.0.weight"
    else:
        body = torch.load(str(out), weights_only=True)
        sd = body["model"]
        moment = body["optimizer"]["state"]["model.0.weight"]["exp_avg"]
    fresh = _model()
    fresh.load_state_dict(sd)
    for a, b in zip(fresh.state_dict().values(), final.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    opt = state["optimizer"]
    assert isinstance(opt, torch.optim.Optimizer)
    assert torch.equal(moment, opt.state[final[0].weight]["exp_avg"])


def test_export_step_and_errors(run_dir: Path, tmp_path: Path) -> None:
    _trained_run(run_dir)
    out = tmp_path / "m.pt"
    r = CliRunner().invoke(
        export, [str(run_dir), "--step", "1", "--format", "torch", "-o", str(out)]
    )
    assert r.exit_code == 0 and "exported step 1 (recovery)" in r.output
    r = CliRunner().invoke(export, [str(run_dir), "--format", "onnx", "-o", str(out)])
    assert r.exit_code == 3 and "unknown export format 'onnx'" in r.output
    r = CliRunner().invoke(export, [str(tmp_path / "nope"), "--format", "torch", "-o", str(out)])
    assert r.exit_code == 2


def test_verify_without_a_run_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a run")
    r = CliRunner().invoke(verify, [str(tmp_path / "empty")])
    assert r.exit_code == 2 and "holds no ckrun run" in r.output


def test_ls_says_committed_unless_verified(run_dir: Path) -> None:
    _trained_run(run_dir)
    r = CliRunner().invoke(ls, [str(run_dir)])
    assert r.exit_code == 0, r.output
    rows = r.output.splitlines()[1:-1]
    assert rows and all(ln.rstrip().endswith("committed") for ln in rows)
    assert " ok" not in r.output
    r = CliRunner().invoke(ls, [str(run_dir), "--verify"])
    rows = r.output.splitlines()[1:-1]
    assert rows and all(ln.rstrip().endswith("verified") for ln in rows)
    r = CliRunner().invoke(verify, [str(run_dir)])
    assert r.exit_code == 0 and ": verified" in r.output and ": ok" not in r.output


def test_verification_results_are_typed(run_dir: Path) -> None:
    from ckrun.checkpoint import discovery
    from ckrun.checkpoint.verify import Problem, verify_shards

    with ckrun.Checkpointer(str(run_dir), keep_last=5, rng=False) as ck:
        ms = [ck.save(s, {"w": torch.arange(4000.0) * s}) for s in (1, 2, 3)]
    st = ckrun.open_storage(str(run_dir))
    (run_dir / ms[0].shards[0].key).unlink()
    os_path = run_dir / ms[1].shards[0].key
    data = bytearray(os_path.read_bytes())
    data[-7] ^= 1
    os_path.write_bytes(bytes(data))
    (run_dir / ms[2].shards[0].key).write_bytes(b"short")
    kinds = {m.step: [p.kind for p in verify_shards(st, m)] for m in discovery.committed(st)}
    assert kinds == {1: [Problem.MISSING], 2: [Problem.CHECKSUM], 3: [Problem.SIZE]}
