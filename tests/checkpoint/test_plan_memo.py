"""The single-rank save plan kept between saves of the same structure (issue 19,
ckrun.checkpoint.plan_memo): a save planned from the memo writes the bytes a fresh plan
writes, and any change of structure is planned again."""

from __future__ import annotations

import collections
import enum
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckrun import Checkpointer
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import sharding, st_format
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.process_group import Group
from ckrun.checkpoint.state import capture
from ckrun.errors import CheckpointError


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    extra = {
        "step": 0,
        "c128": torch.randn(3, dtype=torch.complex128),  # stored as U8 bytes
        "np": np.arange(7, dtype=np.int16),
        "t": torch.arange(6).reshape(2, 3).t(),  # not contiguous: written as a copy
    }
    return {"model": net, "optimizer": opt, "scheduler": sched, "extra": extra}


def _train(state: dict[str, Any], step: int) -> None:
    """One step: every value changes, and so do leaves of the tree (lr, step)."""
    net, opt = state["model"], state["optimizer"]
    net(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    state["scheduler"].step()
    state["extra"]["step"] = step
    state["extra"]["np"] += 1


def _files(root: Path, m: Manifest) -> tuple[bytes, str]:
    lay = json.dumps(m.tensor_layout, sort_keys=True)
    return (root / m.shards[0].key).read_bytes(), lay


def test_a_save_from_the_memo_writes_what_a_fresh_plan_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKRUN_PIECE_BYTES", str(16 * 4 * 3))  # weights cut into pieces
    state = _state()
    with Checkpointer(str(tmp_path / "a"), rng=False, lock=False) as ck:
        for step in range(1, 4):
            _train(state, step)
            m = ck.save(step, state)
        assert ck._ctx.plans.hits == 2  # steps 2 and 3 reused step 1's plan
        assert len(m.tensor_layout["tensors"]["user.model.0.weight"]["pieces"]) == 3
    with Checkpointer(str(tmp_path / "b"), rng=False, lock=False) as fresh:
        m_fresh = fresh.save(3, state)
        assert fresh._ctx.plans.hits == 0
    assert _files(tmp_path / "a", m) == _files(tmp_path / "b", m_fresh)
    loaded = _state()
    with Checkpointer(str(tmp_path / "a"), rng=False, lock=False) as ck:
        assert ck.load(loaded) is not None
    assert loaded["extra"]["step"] == 3 and np.array_equal(
        loaded["extra"]["np"], state["extra"]["np"]
    )
    assert loaded["optimizer"].param_groups[0]["lr"] == state["optimizer"].param_groups[0]["lr"]
    for a, b in zip(loaded["model"].parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_every_change_of_structure_is_planned_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state: dict[str, Any] = {"w": torch.ones(4), "n": np.zeros(2, dtype=np.float32)}
    changes = [
        lambda: state.update(w=torch.ones(5)),  # a shape
        lambda: state.update(w=torch.ones(5, dtype=torch.float64)),  # a dtype
        lambda: state.update(n=np.zeros(2, dtype=np.float64)),  # an array's dtype
        lambda: state.update(v=torch.zeros(3)),  # a new tensor
        lambda: state.update(v=torch.zeros(3)) or state.pop("w"),  # a tensor gone
        lambda: state.update(v={"inner": state.pop("v")}),  # a tensor moved
        lambda: monkeypatch.setenv("CKRUN_PIECE_BYTES", "4"),  # the piece limit
    ]
    with Checkpointer(str(tmp_path), rng=False, lock=False) as ck:
        ck.save(0, state)
        for step, change in enumerate(changes, start=1):
            change()
            m = ck.save(step, state)
            assert ck._ctx.plans.hits == 0, step
            got: dict[str, Any] = dict.fromkeys(state)  # placeholders: replaced by load
            loaded = ck.load(got)
            assert loaded is not None and loaded.step == m.step
            for k, v in state.items():
                want = v if not isinstance(v, dict) else v["inner"]
                have = got[k] if not isinstance(v, dict) else got[k]["inner"]
                assert type(have) is type(want) and have.dtype == want.dtype, (step, k)
                assert have.shape == want.shape and (have == want).all(), (step, k)
        ck.save(len(changes) + 1, state)
        assert ck._ctx.plans.hits == 1  # unchanged again: reused


def _reference_header(tree: Any, tensors: list[Any], names: list[str]) -> bytes:
    """The header as ``json.dumps`` of the whole object (the shard format's definition,
    ckrun.checkpoint.st_format's module docstring), not assembled from parts."""
    tab, data_bytes = st_format.table(tensors)
    descs, head = [], {}
    for t, name, e in zip(tensors, names, tab, strict=True):
        desc, st, shape = st_format.entry_meta(t)
        descs.append({"name": name, **desc})
        head[name] = {
            "dtype": st,
            "shape": shape,
            "data_offsets": [e["offset"], e["offset"] + e["nbytes"]],
        }
    ck = json.dumps(
        {"tree": tree, "entries": descs, "data_bytes": data_bytes}, separators=(",", ":")
    )
    meta = {"format": fmt.FORMAT, "format_version": "2", "ckrun": ck}
    body = json.dumps({"__metadata__": meta, **head}, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % fmt.DATA_ALIGN)
    return len(body).to_bytes(8, "little") + body


@pytest.mark.parametrize(
    "obj",
    [
        {"k": 1},  # no tensor at all
        {"é\n": torch.ones(3), "x": {"ü": 1.5, "n": None, "s": '"q"'}, "e": []},
        {"a": np.arange(4, dtype=np.int16), "c": torch.zeros(2, dtype=torch.complex128)},
    ],
)
def test_the_assembled_header_is_the_json_of_the_whole_header(obj: dict[str, Any]) -> None:
    p = sharding.plan(fmt.snapshot(capture(obj)), Group(0, 1))
    head, tab, data_bytes = st_format.build_header(p.tree, p.tensors, p.names)
    assert head == _reference_header(p.tree, p.tensors, p.names)
    assert (tab, data_bytes) == st_format.table(p.tensors)


def _names(m: Manifest) -> list[str]:
    return sorted(m.tensor_layout["tensors"])


class _Color(str, enum.Enum):
    """A ``str`` key that formats its own name (``C.RED``), equal to ``"red"``."""

    RED = "red"

    def __format__(self, spec: str) -> str:
        return f"C.{self.name}"


def test_a_change_that_renames_a_tensor_is_planned_again(tmp_path: Path) -> None:
    """The memo's key is where each tensor sits (the encoder's chains, not the names):
    every change below renames a tensor under a dict with other than string keys, and
    each save's names are those a fresh plan gives."""
    t, u = torch.ones(2), torch.zeros(3)
    states: list[dict[str, Any]] = [
        {"d": {1: t, "s": u}},
        {"d": {True: t, "s": u}},  # 1 == True: named "#0", not "1"
        {"d": {"s": u, True: t}},  # the same key at another position: "#1"
        {"d": {"s": u, 1.5: t}},  # another non-plain key at that position: same names
        {"d": {"s": u, 2: t}},  # an int key: named by its value
        {"d": {"s": u, "2": t}},  # a string key of the same text: same name, replanned
        {"d": {"s": u, _Color.RED: t}},  # == "red" but named by its own format: C.RED
        {"d": {"s": u, "red": t}},  # and back
    ]
    seen: list[list[str]] = []
    with Checkpointer(str(tmp_path / "a"), rng=False, lock=False) as ck:
        for step, state in enumerate(states):
            hits = ck._ctx.plans.hits
            m = ck.save(step, state)
            with Checkpointer(str(tmp_path / f"fresh{step}"), rng=False, lock=False) as fresh:
                assert _names(m) == _names(fresh.save(step, state)), step
            seen.append(_names(m))
            replanned = ck._ctx.plans.hits == hits
            assert replanned == (step != 3), step  # 1.5 at #1 is named as True at #1
    assert seen[0] == ["user.d.1", "user.d.s"] and seen[1] == ["user.d.#0", "user.d.s"]
    assert seen[2] == seen[3] == ["user.d.#1", "user.d.s"]
    assert seen[4] == seen[5] == ["user.d.2", "user.d.s"]
    assert seen[6] == ["user.d.C.RED", "user.d.s"] and seen[7] == ["user.d.red", "user.d.s"]


def test_a_snapshot_without_the_encoders_placeholders_is_planned_alike() -> None:
    """``materialize`` replaces the encoder's placeholders in place; a snapshot built
    otherwise (no ``slots``) gets the same tree by a walk."""
    obj = {"a": [torch.ones(2), {3: torch.zeros(1)}], "n": np.arange(3), "k": 1}
    snap = fmt.snapshot(capture(obj))
    bare = fmt.Snapshot(json.loads(json.dumps(snap.tree)), list(snap.tensors), snap.nbytes)
    p, q = sharding.plan(snap, Group(0, 1)), sharding.plan(bare, Group(0, 1))
    assert p.tree is snap.tree and q.tree is not bare.tree
    assert p.tree == q.tree and p.names == q.names and p.nbytes == q.nbytes
    assert p.tree["user"]["a"][1]["items"] == [[3, {"__ckrun__": "global", "name": "user.a.1.3"}]]
    assert p.tree["user"]["a"][0] == {"__ckrun__": "global", "name": "user.a.0"}


@pytest.mark.parametrize(
    "obj",
    [
        {"d": {(1, torch.ones(1)): 1.0}},  # a tensor inside a key
        {"d": {torch.ones(2): 1.0}},  # a tensor as a key
    ],
)
def test_a_tensor_in_a_dict_key_is_refused_by_name(obj: dict[str, Any]) -> None:
    """A tensor in a key would have no name in the shard: a clear error naming the dict
    (before: a KeyError or a zip() ValueError from the plan)."""
    with pytest.raises(CheckpointError, match=r"^state\.user\.d: a dict key .* holds a tensor"):
        sharding.plan(fmt.snapshot(capture(obj)), Group(0, 1))


def test_an_ordered_dicts_metadata_with_a_tensor_is_refused() -> None:
    od: Any = collections.OrderedDict(w=torch.ones(1))
    od._metadata = {"": {"t": torch.zeros(1)}}
    with pytest.raises(CheckpointError, match=r"^state\.m: .*_metadata"):
        fmt.snapshot({"m": od})  # the encoder itself (capture keeps a module's metadata)
