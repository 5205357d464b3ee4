"""A real child process SIGKILLed while its background persist runs: the previous
checkpoint stays the newest, nothing half-written is visible, and it loads exactly."""

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
from ckrun.checkpoint import discovery, layout
from ckrun.checkpoint.verify import verify_manifest

PROG = str(Path(__file__).parent / "progs" / "async_saver.py")
N = 16 << 20


def _expect(p: subprocess.Popen[str], want: str) -> None:
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line == want, f"child said {line!r}, expected {want!r}: " + (
        p.stderr.read() if p.stderr and p.poll() is not None else ""
    )


def _load(run: Path) -> tuple[int, torch.Tensor]:
    w = torch.zeros(N)
    state = {"w": w, "extra": {"step": -1}}
    with ckrun.Checkpointer(storage=str(run), rng=False) as ck:
        m = ck.load(state)
        latest = ck.latest()
        assert m is not None and latest is not None and latest.step == m.step
    assert state["extra"] == {"step": m.step}
    return m.step, w


def _poll(cond: object, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_kill_during_background_persist_keeps_previous(tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, PROG, str(run), "stall"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _expect(p, "durable 1")
        _expect(p, "returned 2")
        _expect(p, "stalled")
        step2 = run / layout.step_prefix(2)

        def partial_on_disk() -> bool:
            tmp = [f for f in step2.glob(".ckrun-tmp-*")] if step2.exists() else []
            return bool(tmp) and tmp[0].stat().st_size >= 16 << 20

        _poll(partial_on_disk)  # the shard of step 2 is half written, in a temp file
        os.kill(p.pid, signal.SIGKILL)
        assert p.wait(30) == -signal.SIGKILL
    finally:
        p.kill()
        p.wait(30)
    st = ckrun.open_storage(str(run))
    sc = discovery.scan(st)
    assert [m.step for m in sc.manifests] == [1] and sc.problems == []
    assert verify_manifest(st, sc.manifests[0]) == []
    assert [o.key for o in st.list(layout.step_prefix(2))] == []  # temp files are invisible
    step, w = _load(run)
    assert step == 1 and torch.equal(w, torch.full((N,), 1.0))


def test_kill_during_zero_copy_persist_keeps_previous(tmp_path: Path) -> None:
    """The plain local storage (O_DIRECT from the host buffers): killed as soon as the
    shard's temp file has data.  The persist is capped at 32 MB/s (seconds for the
    shard), so a fast disk does not commit before the kill; a trial where the commit
    still won the race is retried."""
    for trial in range(5):
        run = tmp_path / f"run{trial}"
        step2 = run / layout.step_prefix(2)
        p = subprocess.Popen(
            [sys.executable, PROG, str(run), "plain"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, CKRUN_PERSIST_MAX_MBPS="32"),
        )
        try:
            _expect(p, "durable 1")
            _expect(p, "returned 2")
            _poll(
                lambda d=step2: (
                    any(f.stat().st_size for f in d.glob(".ckrun-tmp-*")) if d.exists() else False
                )
            )
            os.kill(p.pid, signal.SIGKILL)
            assert p.wait(30) == -signal.SIGKILL
        finally:
            p.kill()
            p.wait(30)
        if (step2 / "manifest.json").exists():
            continue  # the persist finished before the kill: not this test's case
        assert list(step2.glob(".ckrun-tmp-*")), "killed mid-persist: the temp file remains"
        st = ckrun.open_storage(str(run))
        sc = discovery.scan(st)
        assert [m.step for m in sc.manifests] == [1] and sc.problems == []
        step, w = _load(run)
        assert step == 1 and torch.equal(w, torch.full((N,), 1.0))
        return
    pytest.fail("every trial committed before the kill: the persist is too fast to catch")


@pytest.mark.slow
def test_kill_at_random_moments_of_an_async_save_loop(tmp_path: Path) -> None:
    seed = int(os.environ.get("CKRUN_CRASH_SEED", random.randrange(1 << 30)))
    rnd = random.Random(seed)
    run = tmp_path / "run"
    newest = -1
    for trial in range(int(os.environ.get("CKRUN_ASYNC_KILL_TRIALS", "4"))):
        p = subprocess.Popen(
            [sys.executable, PROG, str(run), "loop"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        first = p.stdout.readline().strip()  # after import and load: the saves have begun
        assert first.startswith("durable "), first + (p.stderr.read() if p.stderr else "")
        time.sleep(rnd.uniform(0.0, 0.6))
        os.kill(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        last = max(int(x.split()[1]) for x in [first, *out.splitlines()] if x)
        st = ckrun.open_storage(str(run))
        sc = discovery.scan(st)
        assert sc.problems == [], f"trial {trial} (seed {seed}): {sc.problems}"
        assert sc.manifests[0].step >= last, f"trial {trial} (seed {seed})"
        step, w = _load(run)
        assert step >= newest and torch.equal(w, torch.full((N,), float(step)))
        newest = step
