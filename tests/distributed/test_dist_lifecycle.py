"""Issue 11 item 2 under torchrun: a supervisor killed with SIGKILL takes torchrun and its
worker ranks down with it (PR_SET_PDEATHSIG on torchrun; ``import ckrun`` sets it in each
worker, whose parent is torchrun's agent), and a resubmit resumes from the commit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_dist_supervisor import _alive, _finish, _pids, _submit, _wait_step

pytestmark = pytest.mark.slow


def test_sigkill_of_the_supervisor_takes_torchrun_and_the_ranks_down(tmp_path: Path) -> None:
    pids, prog = tmp_path / "pids", tmp_path / "progress"
    pids.mkdir()
    args = ["--steps", "80", "--save-every", "4", "--step-s", "0.05", "--progress", str(prog),
            "--pid-dir", str(pids)]  # fmt: skip
    p = _submit(tmp_path, "kill", 2, args)
    _wait_step(prog, 6, p)
    ranks = _pids(pids)
    assert len(ranks) == 2
    p.kill()  # SIGKILL: the supervisor runs no handler
    p.wait()
    end = time.monotonic() + 10
    while time.monotonic() < end and any(_alive(pid) for pid in ranks):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in ranks), "a rank outlived its supervisor"
    again = _submit(tmp_path, "kill", 2, args)
    code, out = _finish(again)
    assert code == 0, out[-3000:]
    assert "being written by another process" not in out
    evs = [json.loads(x) for x in (tmp_path / "kill" / "events.jsonl").read_text().splitlines()]
    starts = [e for e in evs if e["kind"] == "attempt_start"]
    assert len(starts) == 2 and starts[1]["step"] is not None  # resumed from a commit
