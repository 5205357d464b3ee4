"""Exact resume with async saves: the issue-2 harness (progs/train_tiny.py) with every
periodic and stop save an ``async_save`` (``CKRUN_TEST_ASYNC=1``); each interrupted
process exits 75 with its last save still in flight (drained at interpreter exit) and a
new process resumes from it.  Bitwise equal to the uninterrupted (synchronous) run."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import ckrun
import torch
from ckrun.checkpoint import discovery

PROG = str(Path(__file__).parent / "progs" / "train_tiny.py")
TOTAL = 13


def _train(run_dir: Path, stop_at: int, out: Path, async_: bool) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", CKRUN_TEST_ASYNC="1" if async_ else "0")
    r = subprocess.run(
        [sys.executable, PROG, str(run_dir), str(TOTAL), str(stop_at), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode in (0, 75), r.stderr
    assert "failed at exit" not in r.stderr, r.stderr
    return r.returncode


def test_async_interrupted_run_equals_uninterrupted(tmp_path: Path) -> None:
    seed = int(os.environ.get("CKRUN_RESUME_SEED", random.randrange(1 << 30)))
    stops = sorted(random.Random(seed).sample(range(1, TOTAL), 2))
    ref, got = tmp_path / "ref.pt", tmp_path / "got.pt"
    assert _train(tmp_path / "a", -1, ref, async_=False) == 0
    for s in stops:
        assert _train(tmp_path / "b", s, got, async_=True) == 75, f"seed {seed}, stops {stops}"
        newest = discovery.scan(ckrun.open_storage(str(tmp_path / "b"))).manifests[0]
        assert newest.step == s  # the save in flight at exit was committed
    assert _train(tmp_path / "b", -1, got, async_=True) == 0
    a = torch.load(ref, weights_only=True)
    b = torch.load(got, weights_only=True)
    assert a.keys() == b.keys() and len(a) > 10
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"differ after async resume (CKRUN_RESUME_SEED={seed}, stops {stops}): {diff}"
