"""The manifest is a conditional create (``put(..., if_absent=True)``): two attempts can
never both commit one step; a corrupt manifest of a re-reached step is replaced."""

from __future__ import annotations

import os
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import discovery, layout
from ckrun.checkpoint.commit import StepAlreadyCommitted
from ckrun.checkpoint.verify import verify_manifest


def _state(v: float) -> dict[str, object]:
    return {"w": torch.full((4096,), v), "extra": {"v": v}}


def test_corrupt_manifest_of_a_rereached_step_is_replaced(run_dir: Path) -> None:
    with ckrun.Checkpointer(storage=str(run_dir), rng=False, attempt=0) as ck:
        ck.save(1, _state(1.0))
        m2 = ck.save(2, _state(2.0))
    shard = run_dir / m2.shards[0].key
    os.truncate(shard, shard.stat().st_size // 2)  # step 2 is now corrupt
    got = _state(0.0)
    with ckrun.Checkpointer(storage=str(run_dir), rng=False, attempt=1) as ck2:
        assert ck2.load(got).step == 1
        assert ck2.skipped and "step 2" in ck2.skipped[0]
        m = ck2.save(2, _state(22.0))  # the run re-reaches step 2
    assert m.attempt == 1
    st = ckrun.open_storage(str(run_dir))
    newest = discovery.scan(st).manifests[0]
    assert (newest.step, newest.attempt) == (2, 1) and verify_manifest(st, newest) == []
    again = _state(0.0)
    with ckrun.Checkpointer(storage=str(run_dir), rng=False) as ck3:
        assert ck3.load(again).step == 2
    assert again["extra"] == {"v": 22.0}


def test_verified_manifest_of_another_writer_is_never_overwritten(run_dir: Path) -> None:
    with ckrun.Checkpointer(storage=str(run_dir), rng=False, attempt=0) as a:
        first = a.save(5, _state(5.0))
    mkey = run_dir / layout.manifest_key(5)
    body = mkey.read_bytes()
    with ckrun.Checkpointer(storage=str(run_dir), rng=False, attempt=1, lock=False) as b:
        with pytest.raises(StepAlreadyCommitted, match="attempt 0") as ei:
            b.save(5, _state(-5.0))
        assert ei.value.existing.attempt == 0
        same = b.save(5, _state(5.0))  # identical contents: the existing commit is kept
    assert same.attempt == 0 and same.shards == first.shards
    assert mkey.read_bytes() == body
    got = _state(0.0)
    with ckrun.Checkpointer(storage=str(run_dir), rng=False) as ck:
        assert ck.load(got).step == 5
    assert got["extra"] == {"v": 5.0}


def test_unparsable_manifest_is_replaced(run_dir: Path) -> None:
    with ckrun.Checkpointer(storage=str(run_dir), rng=False) as ck:
        ck.save(1, _state(1.0))
    (run_dir / layout.manifest_key(2)).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / layout.manifest_key(2)).write_bytes(b"{not json")
    with ckrun.Checkpointer(storage=str(run_dir), rng=False, attempt=1) as ck2:
        assert ck2.save(2, _state(2.0)).attempt == 1
    st = ckrun.open_storage(str(run_dir))
    sc = discovery.scan(st)
    assert [m.step for m in sc.manifests] == [2, 1] and sc.problems == []
