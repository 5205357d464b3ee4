"""Issue 13 on S3 (moto's server on 127.0.0.1): corruption falls back, dropped reads are
retried, saves never buffer a whole tensor, one Checkpointer per run and process."""

from __future__ import annotations

import ckrun
import pytest
import torch
from ckrun.errors import RunLocked
from s3_server import MotoS3

pytestmark = pytest.mark.s3


def test_second_checkpointer_refused_on_s3_too(moto_s3: MotoS3) -> None:
    url = f"s3://{moto_s3.new_bucket()}/run"
    a = ckrun.Checkpointer(moto_s3.storage(url), rng=False)
    a.save(1, {"w": torch.ones(1)})
    b = ckrun.Checkpointer(moto_s3.storage(url), rng=False)
    with pytest.raises(RunLocked, match="in this process"):
        b.load({"w": torch.ones(1)})
    a.close()
    assert b.load({"w": torch.ones(1)}) is not None
    b.close()
