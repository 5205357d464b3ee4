"""Sharded training state (issue 14) with real rank processes on gloo.

FSDP2 (``fully_shard``) saves at one world size and loads at another, into FSDP2, DDP
or one process; each tensor equals the gathered original.  DDP at 4 ranks writes every
replicated byte once.  A rank killed mid-save commits nothing.  Programs:
fsdp_train.py (a small transformer) and dist_train.py (DDP).
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import FSDP_TRAIN, manifests, run_world, shard_files, start_world, wait_all

T = 400  # seconds: 4 ranks importing torch on a busy 2-core machine


def _saved(tmp: Path, world: int, layout: str, steps: int = 6) -> dict[str, Any]:
    run_world(
        world,
        str(tmp / "run"),
        ["--layout", layout, "--steps", str(steps), "--save-every", str(steps),
         "--dump", str(tmp / "saved.pt")],
        timeout=T,
        script=FSDP_TRAIN,
    )  # fmt: skip
    saved: dict[str, Any] = torch.load(tmp / "saved.pt")
    return saved


def _loaded(tmp: Path, world: int, layout: str) -> list[dict[str, Any]]:
    out = tmp / "loaded"
    run_world(
        world,
        str(tmp / "run"),
        ["--layout", layout, "--load-only", str(out)],
        timeout=T,
        script=FSDP_TRAIN,
    )
    return [torch.load(f"{out}.{r}.pt") for r in range(world)]


def _assert_equal_state(saved: dict[str, Any], got: dict[str, Any]) -> None:
    keys = [k for k in saved if k.startswith(("model.", "opt."))]
    assert keys and all(k in got for k in keys), sorted(set(keys) - set(got))
    for k in keys:
        assert torch.equal(got[k], saved[k]), k  # bitwise


@pytest.mark.parametrize(
    ("w_save", "w_load", "load_layout"),
    [
        (2, 4, "fsdp"),
        pytest.param(4, 2, "fsdp", marks=pytest.mark.slow),
        pytest.param(4, 1, "single", marks=pytest.mark.slow),
        pytest.param(2, 2, "ddp", marks=pytest.mark.slow),
    ],
)
def test_fsdp_state_loads_on_another_layout(
    tmp_path: Path, w_save: int, w_load: int, load_layout: str
) -> None:
    saved = _saved(tmp_path, w_save, "fsdp")
    m = manifests(tmp_path / "run")[-1]
    lay = m["tensor_layout"]
    w = lay["tensors"]["user.model.block.linear1.weight"]
    assert w["shape"] == [32, 16] and sorted(p[0] for p in w["pieces"]) == list(range(w_save))
    for r in range(w_save):  # no rank wrote a gathered tensor: only its local rows
        rows = [p[3][0] for p in w["pieces"] if p[0] == r]
        assert sum(rows) == 32 // w_save
    for r, got in enumerate(_loaded(tmp_path, w_load, load_layout)):
        _assert_equal_state(saved, got)
        assert got["step"] == 6 and got["world"] == w_load
        # a fresh optimizer's state takes its parameter's layout (DTensor under FSDP2)
        assert got["opt_types"] == (["DTensor"] if load_layout == "fsdp" else ["Tensor"])
        smp = got["sampler"]
        assert (smp["num_replicas"], smp["rank"]) == (w_load, r)
        assert smp["position"] == 6 * 4 * w_save // w_load


@pytest.mark.slow
def test_ddp_state_loads_into_fsdp(tmp_path: Path) -> None:
    saved = _saved(tmp_path, 2, "ddp")
    for got in _loaded(tmp_path, 2, "fsdp"):
        _assert_equal_state(saved, got)


def _nbytes(spec: dict[str, Any]) -> int:
    return (
        math.prod(spec["shape"])
        * torch.empty(0, dtype=getattr(torch, spec["dtype"])).element_size()
    )


def test_ddp_on_four_ranks_writes_the_replicated_state_once(tmp_path: Path) -> None:
    root = tmp_path / "run"
    run_world(4, str(root), ["--steps", "3", "--save-every", "3"], timeout=T)
    m = next(m for m in manifests(root) if m["kind"] == "recovery")
    lay = m["tensor_layout"]
    # model (Linear(8, 4)) and SGD momentum: each tensor saved once, as one piece
    state_bytes = sum(_nbytes(s) for s in lay["tensors"].values())
    assert state_bytes == 2 * (8 * 4 + 4) * 4
    assert all(len(s["pieces"]) == 1 for s in lay["tensors"].values())
    owners = {s["pieces"][0][0] for s in lay["tensors"].values()}
    assert len(owners) == 4  # ownership spread over the ranks
    pieces = {(p[0], p[1]) for s in lay["tensors"].values() for p in s["pieces"]}
    for r, (sh, info) in enumerate(zip(m["shards"], lay["shards"], strict=True)):
        local = [n for n in info["entries"] if (r, n) not in pieces]
        assert local and all(n.startswith("rng.") for n in local)  # rank-local: RNG only
        data = sum(e - b for b, e, _ in info["entries"].values())
        assert sh["size_bytes"] == info["header_bytes"] + data  # nothing else written
    written = sum(e - b for info in lay["shards"] for n, (b, e, _) in info["entries"].items()
                  if not n.startswith("rng."))  # fmt: skip
    assert written == state_bytes  # not 4x


@pytest.mark.slow
def test_fsdp_rank_killed_mid_save_commits_nothing(tmp_path: Path) -> None:
    root = tmp_path / "run"
    procs = start_world(
        2,
        str(root),
        ["--steps", "20", "--save-every", "2", "--fault", "kill:1:4"],
        FSDP_TRAIN,
        CKRUN_COLLECTIVE_TIMEOUT_S="60",
    )
    codes = wait_all(procs, timeout=T)
    assert codes[1] == -9 and codes[0] != 0
    assert [m["step"] for m in manifests(root)] == [2]
    assert (
        shard_files(root, 4) and not (root / "checkpoints/step-0000000004/manifest.json").exists()
    )
    for m in manifests(root):
        assert all(os.path.getsize(root / s["key"]) == s["size_bytes"] for s in m["shards"])


@pytest.mark.slow
def test_fsdp_preempted_through_the_supervisor_resumes_exactly(tmp_path: Path) -> None:
    """A notice (SIGUSR1 to ``ckrun submit``) at step >= 4 of 14 on 2 FSDP2 ranks: the
    run saves, restarts on 2 ranks and ends bitwise equal to an uninterrupted run."""
    from dist_helpers import finish, submit, wait_step

    steps = ["--steps", "14"]
    run_world(2, str(tmp_path / "plain"), [*steps, "--dump", str(tmp_path / "plain.pt")],
              timeout=T, script=FSDP_TRAIN)  # fmt: skip
    prog = tmp_path / "progress"
    args = [*steps, "--step-s", "0.3", "--progress", str(prog), "--dump", str(tmp_path / "cut.pt")]
    p = submit(tmp_path, "cut", 2, FSDP_TRAIN, args, "--grace", "120")
    wait_step(prog, 4, p)
    os.kill(p.pid, signal.SIGUSR1)
    code, out = finish(p)
    assert code == 0 and "preempt" in out and "run completed" in out, out[-3000:]
    saved = [m for m in manifests(tmp_path / "cut") if m["kind"] == "recovery"]
    assert saved and 4 <= saved[0]["step"] < 14 and saved[0]["world_size"] == 2
    plain, cut = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "cut.pt")
    assert plain.keys() == cut.keys()
    for k in plain:
        assert torch.equal(plain[k], cut[k]), k
