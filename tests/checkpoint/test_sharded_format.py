"""Format-2 shards and manifests (issue 14), single process: safetensors readers open a
ckrun shard, format-1 checkpoints keep loading, ranged reads are verified, pieces."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckrun import Checkpointer
from ckrun.checkpoint import layout
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.commit import commit_manifest
from ckrun.checkpoint.manifest import Manifest, ShardInfo
from ckrun.checkpoint.state import capture
from ckrun.errors import CorruptCheckpoint
from ckrun.storage.local import LocalStorage


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(4, 16)).sum().backward()
    opt.step()
    extra = {
        "step": 5,
        "c128": torch.randn(3, dtype=torch.complex128),  # no safetensors dtype: U8 bytes
        "flags": torch.tensor([True, False, True]),
        "np": np.arange(7, dtype=np.int16),
    }
    return {"model": net, "optimizer": opt, "extra": extra}


def test_safe_open_lists_and_reads_a_ckrun_shard(tmp_path: Path) -> None:
    from safetensors import safe_open

    state = _state()
    with Checkpointer(str(tmp_path), lock=False) as ck:
        m = ck.save(5, state)
    path = tmp_path / m.shards[0].key
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0 and raw[8 + n - 1 : 8 + n] == b" "  # padded, aligned data
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        w = f.get_tensor("user.model.0.weight")
        ea = f.get_tensor("user.optimizer.state.0.exp_avg")
        flags = f.get_tensor("user.extra.flags")
    assert meta["format"] == "ckrun.shard" and meta["format_version"] == "2"
    assert json.loads(meta["ckrun"])["tree"]["version"] == 1
    assert {"user.model.1.bias", "rng.torch", "user.extra.c128"} <= keys
    assert torch.equal(w, state["model"][0].weight.detach())
    assert torch.equal(ea, state["optimizer"].state_dict()["state"][0]["exp_avg"])
    assert torch.equal(flags, state["extra"]["flags"])


def test_roundtrip_of_odd_dtypes_and_numpy(tmp_path: Path) -> None:
    state = _state()
    with Checkpointer(str(tmp_path), lock=False) as ck:
        ck.save(5, state)
    fresh = _state(seed=1)
    fresh["extra"] = {}
    with Checkpointer(str(tmp_path), lock=False) as ck:
        m = ck.load(fresh)
    assert m is not None and m.tensor_layout is not None
    got = fresh["extra"]
    assert torch.equal(got["c128"], state["extra"]["c128"]) and got["step"] == 5
    assert np.array_equal(got["np"], state["extra"]["np"]) and got["np"].dtype == np.int16
    for a, b in zip(fresh["model"].parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_format_1_checkpoint_still_loads(tmp_path: Path) -> None:
    """A checkpoint as the previous version wrote it (shard format 1, manifest 1)."""
    state = _state()
    st = LocalStorage(str(tmp_path))
    key = layout.shard_key(3, 0, 0)
    size, crc = fmt.write_object(st.open_write(key), fmt.snapshot(capture(state)))
    with Checkpointer(st, lock=False) as ck:
        compat = ck.compat_block(state)
    m = Manifest(
        run="r", step=3, kind="recovery", attempt=0, world_size=1,
        shards=(ShardInfo(key, 0, size, crc),), compat=compat, metrics={},
        resumed_from=None, created_utc="", committed_utc="", save_duration_s=0.0,
        key=layout.manifest_key(3),
    )  # fmt: skip
    commit_manifest(st, m)
    assert json.loads(st.get(m.key))["format_version"] == 1
    assert st.get(key)[:8] == fmt.MAGIC
    fresh = _state(seed=1)
    with Checkpointer(st, lock=False) as ck:
        got = ck.load(fresh)
    assert got is not None and got.tensor_layout is None and got.step == 3
    for a, b in zip(fresh["model"].parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_damaged_piece_is_caught_by_its_ranged_read(tmp_path: Path) -> None:
    state = _state()
    with Checkpointer(str(tmp_path), lock=False, keep_last=5) as ck:
        ck.save(1, state)
        m2 = ck.save(2, state)
    assert m2.tensor_layout is not None
    b, _, _ = m2.tensor_layout["shards"][0]["entries"]["user.model.0.weight"]
    path = tmp_path / m2.shards[0].key
    data = bytearray(path.read_bytes())
    data[b + 3] ^= 0x08
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with Checkpointer(str(tmp_path), lock=False) as ck:
        got = ck.load(_state(seed=1))
        assert got is not None and got.step == 1  # fell back
        assert "checksum mismatch in user.model.0.weight" in ck.skipped[0]


def test_pieces_are_cut_along_dim_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKRUN_PIECE_BYTES", str(16 * 4 * 3))  # three rows of Linear(16, 8)
    state = _state()
    with Checkpointer(str(tmp_path), lock=False) as ck:
        m = ck.save(1, state)
    assert m.tensor_layout is not None
    spec = m.tensor_layout["tensors"]["user.model.0.weight"]
    assert spec["shape"] == [8, 16]
    assert [p[2:] for p in spec["pieces"]] == [
        [[0, 0], [3, 16]], [[3, 0], [3, 16]], [[6, 0], [2, 16]]
    ]  # fmt: skip
    fresh = _state(seed=1)
    with Checkpointer(str(tmp_path), lock=False) as ck:
        ck.load(fresh)
    assert torch.equal(fresh["model"][0].weight, state["model"][0].weight)


def test_manifest_2_roundtrip_and_bad_layout() -> None:
    lay = {
        "version": 1,
        "shards": [{"header_bytes": 4096, "header_crc": "crc32c:00000000",
                    "entries": {"w": [4096, 4112, "crc32c:00000001"]}}],
        "tensors": {"w": {"dtype": "float32", "shape": [4], "pieces": [[0, "w", [0], [4]]]}},
    }  # fmt: skip
    m = Manifest(
        run="r", step=1, kind="recovery", attempt=0, world_size=1,
        shards=(ShardInfo(layout.shard_key(1, 0, 0), 0, 4112, "crc32c:00000002"),),
        compat={}, metrics={}, resumed_from=None, created_utc="", committed_utc="",
        save_duration_s=0.0, tensor_layout=lay,
    )  # fmt: skip
    body = json.loads(m.dumps())
    assert body["format_version"] == 2 and Manifest.loads(m.dumps()) == m
    body["tensor_layout"]["tensors"]["w"]["pieces"][0][1] = "nope"
    with pytest.raises(CorruptCheckpoint, match="tensor_layout"):
        Manifest.loads(json.dumps(body).encode())
