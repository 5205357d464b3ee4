"""Fencing (DESIGN.md §7): a writer whose lease epoch is no longer current commits nothing.

Real LocalStorage, real lease objects; the "other machine" is a second Lease that takes
the run over (its holder marked as another machine, the TTL elapsed on its own clock).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ckrun import Checkpointer
from ckrun.checkpoint import layout
from ckrun.checkpoint.commit import commit_manifest
from ckrun.checkpoint.lease import EPOCH_ENV, Fence, Lease
from ckrun.checkpoint.manifest import Manifest
from ckrun.errors import LeaseLost
from ckrun.storage.local import LocalStorage


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _hold(storage: LocalStorage, clock: _Clock) -> Lease:
    lease = Lease(storage, "r1", ttl_s=10, clock=clock, sleep=lambda s: None)
    lease.holder = dataclasses.replace(lease.holder, machine="machine-a")
    lease.acquire()
    return lease


def _take_over(storage: LocalStorage, clock: _Clock) -> Lease:
    b = Lease(storage, "r1", ttl_s=10, clock=clock, sleep=lambda s: None)
    watch: dict[str, Any] = {}
    assert b.try_acquire(watch) is None
    clock.t += 11
    assert b.try_acquire(watch) is not None
    return b


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_stale_writer_commits_nothing_and_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = LocalStorage(str(tmp_path / "run"))
    clock = _Clock()
    a = _hold(storage, clock)
    monkeypatch.setenv(EPOCH_ENV, str(a.epoch))
    ck = Checkpointer(storage, {"model_version": 1}, keep_last=1, run="r1")
    state = _state()
    m1 = ck.save(1, state)
    assert m1.lease_epoch == 1
    assert json.loads(storage.get(m1.key))["lease_epoch"] == 1

    b = _take_over(storage, clock)  # machine B owns the run now (epoch 2)
    monkeypatch.setenv(EPOCH_ENV, str(b.epoch))
    ck_b = Checkpointer(storage, {"model_version": 1}, keep_last=1, run="r1")
    m2 = ck_b.save(2, state)
    assert m2.lease_epoch == 2
    ck_b.close()  # B's retention pass (in the background) is done
    before = sorted(o.key for o in storage.list())

    with pytest.raises(LeaseLost, match="lease epoch 1 .* epoch 2"):
        ck.save(3, state)  # A wakes up: refused before publishing
    assert storage.head(layout.manifest_key(3)) is None
    with pytest.raises(LeaseLost):
        ck.finalize(4, state)
    assert storage.head(layout.COMPLETE) is None
    assert set(before) <= {o.key for o in storage.list()}  # nothing of B's deleted
    assert storage.head(m2.key) is not None


def test_commit_withdrawn_when_the_lease_moves_during_the_create(tmp_path: Path) -> None:
    clock = _Clock()

    class Racy(LocalStorage):
        """B takes the run over while A's manifest create is on its way."""

        def put(self, key: str, data: Any, **kw: Any) -> Any:
            info = super().put(key, data, **kw)
            if key.endswith(layout.MANIFEST):
                _take_over(LocalStorage(self.root), clock)
            return info

    storage = Racy(str(tmp_path / "run"))
    a = _hold(storage, clock)
    m = Manifest(
        run="r1",
        step=5,
        kind="recovery",
        attempt=0,
        world_size=1,
        shards=(),
        compat={},
        metrics={},
        resumed_from=None,
        created_utc="",
        committed_utc="",
        save_duration_s=0.0,
        lease_epoch=a.epoch,
        key=layout.manifest_key(5),
    )
    with pytest.raises(LeaseLost):
        commit_manifest(storage, m, Fence(storage, a.epoch))
    assert storage.head(layout.manifest_key(5)) is None  # withdrawn


def test_unfenced_without_a_supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EPOCH_ENV, raising=False)
    storage = LocalStorage(str(tmp_path / "run"))
    ck = Checkpointer(storage, {"model_version": 1}, run="r1")
    m = ck.save(1, _state())
    assert m.lease_epoch is None and "lease_epoch" not in json.loads(storage.get(m.key))
    assert not ck.fence.fenced
    ck.close()


def test_a_deleted_lease_never_hands_an_old_epoch_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = LocalStorage(str(tmp_path / "run"))
    clock = _Clock()
    a = _hold(storage, clock)
    monkeypatch.setenv(EPOCH_ENV, str(a.epoch))
    ck = Checkpointer(storage, {"model_version": 1}, run="r1")
    ck.save(1, _state())
    storage.delete([layout.LEASE])  # someone "cleans up" the lock directory
    b = Lease(storage, "r1", ttl_s=10, clock=clock, sleep=lambda s: None)
    assert b.acquire().epoch == 2  # above the newest commit's epoch
    with pytest.raises(LeaseLost):
        ck.save(2, _state())
