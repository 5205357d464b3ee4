"""The README's FSDP2 example (issue 14): ``examples/train_charlm.py --fsdp`` under
``ckrun submit --nproc-per-node 2`` survives a preemption, then the same run resumes on
4 processes and on 1 and completes.  Real supervisor, torchrun, gloo; nothing mocked."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from dist_helpers import REPO, finish, manifests, submit

EXAMPLE = os.path.join(REPO, "examples", "train_charlm.py")
# paced at 0.1 s a step: a fast machine must not finish before the test preempts it
TINY = ["--fsdp", "--d-model", "32", "--layers", "2", "--heads", "2", "--block", "32",
        "--batch", "8", "--ckpt-every", "5", "--log-every", "5", "--steps", "40",
        "--step-seconds", "0.1"]  # fmt: skip


def _stop_after_a_checkpoint(tmp: Path, world: int, *extra: str) -> tuple[int, str]:
    """Submit on ``world`` processes, SIGTERM (machine loss) once a new recovery
    checkpoint is committed; returns the step the run saved at and the output."""
    before = {m["step"] for m in manifests(tmp / "lm")}
    p = submit(tmp, "lm", world, EXAMPLE, TINY, "--grace", "120", *extra)
    end = time.monotonic() + 400
    while not ({m["step"] for m in manifests(tmp / "lm")} - before):
        assert p.poll() is None, p.communicate()[0][-3000:]
        assert time.monotonic() < end, "no checkpoint in 400 s"
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGTERM)
    code, out = finish(p)
    assert code == 75, out[-3000:]
    saved = max(m["step"] for m in manifests(tmp / "lm") if m["kind"] == "recovery")
    assert next(m for m in manifests(tmp / "lm") if m["step"] == saved)["world_size"] == world
    return saved, out


@pytest.mark.slow
def test_fsdp_example_preempted_on_2_resumes_on_4_and_on_1(tmp_path: Path) -> None:
    s2, _ = _stop_after_a_checkpoint(tmp_path, 2)
    s4, out = _stop_after_a_checkpoint(tmp_path, 4, "--allow-change", "launch_hash")
    assert f"resumed at step {s2 + 1}" in out and s4 > s2, out[-3000:]
    code, out = finish(submit(tmp_path, "lm", 1, EXAMPLE, TINY, "--allow-change", "launch_hash"))
    assert code == 0, out[-3000:]
    assert f"resumed at step {s4 + 1}" in out and "done: 40 steps" in out, out[-3000:]
    final = next(m for m in manifests(tmp_path / "lm") if m["kind"] == "final")
    assert final["world_size"] == 1 and final["resumed_from"] == s4
