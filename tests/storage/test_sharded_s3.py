"""Format-2 checkpoints on S3 (issue 14): saved and loaded through ranged GETs."""

from __future__ import annotations

import pytest
import torch
from ckrun import Checkpointer
from ckrun.storage.s3 import S3Storage


@pytest.mark.s3
def test_checkpoint_on_s3_loads_with_ranged_reads(s3_storage: S3Storage) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 64)).sum().backward()
    opt.step()
    with Checkpointer(s3_storage, lock=False) as ck:
        m = ck.save(1, {"model": net, "optimizer": opt})
    assert m.tensor_layout is not None
    calls: list[tuple[str, int, int]] = []
    read_into = s3_storage.read_into

    def counting(key: str, offset: int, buf: memoryview) -> None:
        calls.append((key, offset, len(buf)))
        read_into(key, offset, buf)

    s3_storage.read_into = counting  # type: ignore[method-assign]
    net2 = torch.nn.Linear(64, 32)
    opt2 = torch.optim.AdamW(net2.parameters())
    with Checkpointer(s3_storage, lock=False) as ck:
        assert ck.load({"model": net2, "optimizer": opt2}) is not None
    assert torch.equal(net2.weight, net.weight) and torch.equal(net2.bias, net.bias)
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    # the header, then one range per entry; never the whole object at once
    assert calls[0][1] == 0 and len(calls) > 2
    assert all(n < m.shards[0].size_bytes for _, _, n in calls)
