"""ResumableSampler: same order everywhere, exact mid-epoch resume, guarded state."""

from __future__ import annotations

import ckrun
import pytest
import torch
from torch.utils.data import DataLoader


def test_resume_mid_epoch_yields_the_remaining_batches() -> None:
    full = ckrun.ResumableSampler(50, seed=7)
    order = list(full) + list(full)  # two epochs
    a = ckrun.ResumableSampler(50, seed=7)
    it = iter(a)
    first = [next(it) for _ in range(23)]
    sd = a.state_dict()
    b = ckrun.ResumableSampler(50, seed=7)
    b.load_state_dict(sd)
    rest = list(b) + list(b)
    assert first + rest[: 50 - 23] == order[:50]
    assert rest[50 - 23 :] == order[50:]
    assert order[:50] != order[50:]  # a new permutation each epoch
    assert sorted(order[:50]) == list(range(50))


def test_with_dataloader_and_set_epoch() -> None:
    data = torch.arange(40).float()
    s = ckrun.ResumableSampler(data, seed=1)
    loader = DataLoader(data, batch_size=4, sampler=s)  # type: ignore[arg-type]
    s.set_epoch(0)
    batches = []
    for i, b in enumerate(loader):
        batches.append(b)
        if i == 3:
            break
    sd = s.state_dict()
    assert sd["position"] == 16 and sd["epoch"] == 0
    s2 = ckrun.ResumableSampler(data, seed=1)
    s2.load_state_dict(sd)
    s2.set_epoch(0)  # the resumed epoch: position kept
    rest = list(DataLoader(data, batch_size=4, sampler=s2))  # type: ignore[arg-type]
    ref = list(DataLoader(data, batch_size=4, sampler=ckrun.ResumableSampler(data, seed=1)))  # type: ignore[arg-type]
    assert [b.tolist() for b in batches + rest] == [b.tolist() for b in ref]
    s2.set_epoch(5)
    assert s2.position == 0 and s2.epoch == 5


def test_replicas_partition_the_epoch() -> None:
    parts = [list(ckrun.ResumableSampler(10, seed=2, num_replicas=3, rank=r)) for r in range(3)]
    assert all(len(p) == 4 for p in parts)
    assert set(sum(parts, [])) == set(range(10))


def test_changed_dataset_refused() -> None:
    a = ckrun.ResumableSampler(10, seed=2)
    with pytest.raises(ValueError, match="n changed"):
        ckrun.ResumableSampler(11, seed=2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError):
        a.set_position(11)
    with pytest.raises(ValueError):
        ckrun.ResumableSampler(10, num_replicas=2, rank=2)


def test_unshuffled_and_global_rng_untouched() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert list(ckrun.ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]
    list(ckrun.ResumableSampler(5))
    assert torch.equal(before, torch.get_rng_state())
