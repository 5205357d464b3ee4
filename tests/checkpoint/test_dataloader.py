"""Issue 13 item 2: exact data position under DataLoader workers, any count before/after."""

from __future__ import annotations

from typing import Any

import ckrun
import pytest
import torch

N, BATCH, EPOCHS = 40, 4, 2  # 10 batches per epoch
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _loader(workers: int) -> tuple[ckrun.ResumableSampler, Any]:
    data = torch.arange(N)
    s = ckrun.ResumableSampler(N, seed=5)
    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw["prefetch_factor"] = 4  # prefetch the whole tail of the epoch
    return s, ckrun.ResumableDataLoader(data, sampler=s, batch_size=BATCH, **kw)


def _consume(
    s: ckrun.ResumableSampler, loader: Any, stop_after: int | None = None
) -> tuple[list[int], dict[str, Any] | None]:
    """Train through EPOCHS; with ``stop_after`` k, the notice lands after the k-th batch
    received (0-based, counted from this start) and the sampler state is returned."""
    seen: list[int] = []
    k = 0
    while s.epoch < EPOCHS:
        for batch in loader:
            seen += batch.tolist()
            if stop_after is not None and k == stop_after:
                return seen, s.state_dict()  # what the checkpoint would hold
            k += 1
    return seen, None


def _uninterrupted() -> list[int]:
    s, loader = _loader(0)
    return _consume(s, loader)[0]


@pytest.mark.parametrize("before,after", [(0, 2), (2, 3), (3, 0), (2, 2)])
def test_notice_in_the_last_three_batches_of_an_epoch_resumes_exactly(
    before: int, after: int
) -> None:
    want = _uninterrupted()
    assert len(want) == N * EPOCHS
    for stop in (7, 8, 9):  # each of the last three batches of epoch 0
        s, loader = _loader(before)
        first, sd = _consume(s, loader, stop)
        assert sd is not None and len(first) == (stop + 1) * BATCH
        assert (sd["epoch"], sd["position"]) == (0, (stop + 1) * BATCH)
        s2, loader2 = _loader(after)
        s2.load_state_dict(sd)
        rest, _ = _consume(s2, loader2)
        assert first + rest == want, f"stop after batch {stop}, workers {before}->{after}"


def test_loader_in_state_and_set_position_still_work(tmp_path: Any) -> None:
    s, loader = _loader(2)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    with ckrun.Checkpointer(str(tmp_path / "run"), rng=False) as ck:
        ck.save(1, {"loader": loader})
        s2, loader2 = _loader(0)
        ck.load({"loader": loader2})
    assert s2.state_dict()["position"] == 12
    nxt = next(iter(loader2)).tolist()
    assert nxt == _uninterrupted()[12:16] and sum(got, []) == _uninterrupted()[:12]
    s.set_position(4)  # an explicit position (the old path) still wins
    assert s.state_dict()["position"] == 4
    del it
