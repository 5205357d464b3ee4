"""Crash consistency: a real process saving in a loop is SIGKILLed at random moments.

After every kill: no invalid manifest is visible, the newest committed checkpoint is at
least the last one whose ``save`` returned (durable on return), it verifies (re-hash) and
``load`` restores exactly that step.  ``CKRUN_CRASH_TRIALS`` sets the number of kills
(default 50), ``CKRUN_CRASH_SEED`` the random seed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import discovery
from ckrun.checkpoint.verify import verify_manifest

PROG = str(Path(__file__).parent / "progs" / "crash_zygote.py")
SIZE = 64 * 1024


def _readline(p: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, f"zygote ended: {p.stderr.read() if p.stderr else ''}"
    return line.strip()


def _trial(p: subprocess.Popen[str], run_dir: Path, delay_s: float) -> int:
    """One kill; returns the last step the saver reported committed (-1: none)."""
    assert p.stdin is not None
    p.stdin.write(f"go {run_dir}\n")
    p.stdin.flush()
    line = _readline(p)
    assert line.startswith("started "), line
    pid = int(line.split()[1])
    time.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)
    last = -1
    while True:
        line = _readline(p)
        if line.startswith("committed "):
            last = int(line.split()[1])
        elif line.startswith("reaped "):
            assert int(line.split()[2]) & 0x7F == signal.SIGKILL, line
            return last


def _check(run_dir: Path, last: int, trial: int) -> int:
    st = ckrun.open_storage(str(run_dir))
    sc = discovery.scan(st)
    assert sc.problems == [], f"trial {trial}: invalid manifest visible: {sc.problems}"
    if not sc.manifests:
        assert last == -1, f"trial {trial}: save of {last} returned but nothing committed"
        return -1
    newest = sc.manifests[0]
    assert newest.step >= last, f"trial {trial}: save {last} returned, newest {newest.step}"
    for m in sc.manifests:
        assert verify_manifest(st, m) == [], f"trial {trial}: step {m.step} does not verify"
    state = {
        "w": torch.zeros(SIZE),
        "b": torch.zeros(SIZE, dtype=torch.int64),
        "extra": {"step": -1},
    }
    with ckrun.Checkpointer(storage=str(run_dir), rng=False) as ck:
        m = ck.load(state)
    assert m is not None and m.step == newest.step
    assert state["extra"] == {"step": m.step}
    assert torch.equal(state["w"], torch.full((SIZE,), float(m.step)))
    assert torch.equal(state["b"], torch.arange(SIZE) + m.step)
    return m.step


@pytest.mark.slow
def test_sigkill_at_random_moments(tmp_path: Path) -> None:
    trials = int(os.environ.get("CKRUN_CRASH_TRIALS", "50"))
    seed = int(os.environ.get("CKRUN_CRASH_SEED", random.randrange(1 << 30)))
    rnd = random.Random(seed)
    run_dir = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, PROG],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    newest = -1
    try:
        for trial in range(trials):
            last = _trial(p, run_dir, rnd.uniform(0.02, 0.4))  # startup, saves, retention
            step = _check(run_dir, last, trial)
            assert step >= newest, f"trial {trial} (seed {seed}): went back to {step}"
            newest = step
    finally:
        if p.stdin:
            p.stdin.close()
        p.wait(30)
    assert newest >= trials // 2, f"too few commits ({newest}) to exercise the save (seed {seed})"
