"""Retention as property tests (hypothesis) on the pure selection, plus plan ordering."""

from __future__ import annotations

from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import layout, retention
from ckrun.checkpoint.lease import EPOCH_ENV, Lease
from ckrun.storage.local import LocalStorage
from hypothesis import given, settings
from hypothesis import strategies as st

steps_st = st.dictionaries(
    st.integers(0, 500), st.sampled_from(["recovery", "milestone"]), max_size=40
)


@settings(max_examples=300, deadline=None)
@given(
    steps=steps_st,
    keep_last=st.integers(1, 6),
    milestone_every=st.one_of(st.none(), st.integers(1, 50)),
    resumed=st.one_of(st.none(), st.integers(0, 500)),
)
def test_selection_properties(
    steps: dict[int, str], keep_last: int, milestone_every: int | None, resumed: int | None
) -> None:
    protect = set() if resumed is None else {resumed}
    if steps:
        protect.add(max(steps))  # the checkpoint just committed
    drop = retention.select(
        steps, keep_last=keep_last, milestone_every=milestone_every, protect=protect
    )
    assert drop <= set(steps)
    if steps:
        assert max(steps) not in drop
    if resumed is not None:
        assert resumed not in drop
    newest = sorted(steps, reverse=True)[:keep_last]
    assert not drop & set(newest)
    for s, kind in steps.items():
        if kind == "milestone" or (milestone_every and s % milestone_every == 0):
            assert s not in drop
    kept = set(steps) - drop
    assert len(kept) >= min(keep_last, len(steps))
    # everything not protected by a rule is deleted (retention does not leak)
    for s in drop:
        assert s not in protect


@given(st.lists(st.integers(0, 100), unique=True, min_size=1, max_size=20))
def test_final_is_never_deleted(steps: list[int]) -> None:
    kinds = {s: "final" for s in steps}
    assert retention.select(kinds, keep_last=1) == set()


def test_keep_last_must_be_positive() -> None:
    with pytest.raises(ValueError):
        retention.select({1: "recovery"}, keep_last=0)


def test_orphans_of_a_newer_attempt_are_left_alone_when_fenced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a fenced run (a lease), retention collects shards no manifest names, but never
    those of a newer attempt than its own: a stale owner must not delete the shard a new
    owner is writing under its final key before its manifest (issue 19); a dead, older
    attempt's are collected.  (Unfenced, any attempt's are: test_checkpointer.py.)"""
    st = LocalStorage(str(tmp_path))
    lease = Lease(st, "r1", ttl_s=10, clock=lambda: 0.0, sleep=lambda s: None)
    lease.acquire()
    monkeypatch.setenv(EPOCH_ENV, str(lease.epoch))
    newer, older = layout.shard_key(1, 0, 3), layout.shard_key(1, 0, 1)
    st.put(newer, b"in flight")
    st.put(older, b"left by a killed save")
    ck = ckrun.Checkpointer(storage=st, attempt=2, run="r1", rng=False, keep_last=1)
    ck.save(1, {"w": torch.zeros(4)})
    ck.save(2, {"w": torch.ones(4)})
    ck.close()  # joins the retention pass
    assert st.head(newer) is not None
    assert st.head(older) is None
    left = {o.key for o in st.list(layout.CHECKPOINTS)}
    latest = ck.latest()
    assert latest is not None and latest.step == 2
    assert left == {newer, layout.manifest_key(2), *(s.key for s in latest.shards)}, left
