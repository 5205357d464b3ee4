"""Distributed runs through the real supervisor and torchrun (issue 8).

``ckrun submit --nproc-per-node N dist_train.py`` runs the ranks under
``python -m torch.distributed.run``; the notice is a real SIGUSR1 to the supervisor at a
random step, delivered to the ranks by notice.json and by signals to the worker
processes (torchrun forwards neither).  Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import TRAIN, manifests, read_json

FAST = {
    "CKRUN_KILL_DELAY_S": "1",
    "CKRUN_MARGIN_S": "0.5",
    "CKRUN_BACKOFF_S": "0.1",
    "OMP_NUM_THREADS": "1",
}


def _submit(
    tmp: Path,
    run: str,
    world: int,
    train_args: list[str],
    *ckrun_args: str,
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKRUN_")}
    env.update(FAST)
    cmd = [
        sys.executable,
        "-m",
        "ckrun.cli",
        "submit",
        "--run",
        run,
        "--storage",
        str(tmp),
        "--nproc-per-node",
        str(world),
        *ckrun_args,
        TRAIN,
        "--",
        *train_args,
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp
    )


def _finish(p: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"ckrun did not finish in {timeout} s:\n{out[-4000:]}") from None
    return p.returncode, out


def _wait_step(
    progress: Path,
    step: int,
    p: subprocess.Popen[str],
    timeout: float = 120,
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if int(progress.read_text() or 0) >= step:
                return
        except (OSError, ValueError):
            pass
        assert p.poll() is None, f"ckrun exited early: {p.communicate()[0][-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(d: Path) -> list[int]:
    return [int(f.read_text()) for f in d.iterdir() if f.name.isdigit()]


def _interrupted_equals_uninterrupted(tmp_path: Path, world: int) -> None:
    steps = 24
    code, out = _finish(
        _submit(
            tmp_path,
            "plain",
            world,
            ["--steps", str(steps), "--dump", str(tmp_path / "plain.json")],
        )
    )
    assert code == 0, out[-3000:]
    pids, prog = tmp_path / "pids", tmp_path / "progress"
    pids.mkdir()
    notice_at = random.Random().randint(3, steps - 6)
    p = _submit(
        tmp_path,
        "cut",
        world,
        [
            "--steps",
            str(steps),
            "--step-s",
            "0.15",
            "--progress",
            str(prog),
            "--pid-dir",
            str(pids),
            "--dump",
            str(tmp_path / "cut.json"),
            "--hold-at",
            str(notice_at),  # the ranks wait there for the notice: caught on any machine
        ],
        "--grace",
        "60",
    )
    _wait_step(prog, notice_at, p)
    first = _pids(pids)
    os.kill(p.pid, signal.SIGUSR1)  # the notice, to the supervisor only
    code, out = _finish(p)
    assert code == 0, out[-3000:]
    assert "preempt" in out and "run completed" in out, out[-3000:]
    assert not any(_alive(pid) for pid in first)  # the first attempt's ranks are gone
    ms = manifests(tmp_path / "cut")
    saved = [m for m in ms if m["kind"] == "recovery"]
    assert saved and saved[0]["step"] >= notice_at
    for m in ms:  # one step, every rank's shard
        assert m["world_size"] == world and [s["rank"] for s in m["shards"]] == list(range(world))
    assert read_json(tmp_path / "cut.json") == read_json(tmp_path / "plain.json")
    events = [
        json.loads(x)
        for x in (tmp_path / "cut" / "events.jsonl").read_text().splitlines()
        if x.strip()
    ]
    assert [e["kind"] for e in events].count("spawn") == 2


@pytest.mark.parametrize("world", [1, 2])
def test_notice_at_a_random_step_resumes_to_the_uninterrupted_result(
    tmp_path: Path, world: int
) -> None:
    _interrupted_equals_uninterrupted(tmp_path, world)


@pytest.mark.slow
def test_notice_at_a_random_step_with_four_ranks(tmp_path: Path) -> None:
    _interrupted_equals_uninterrupted(tmp_path, 4)


def test_a_rank_hanging_in_the_save_is_killed_at_the_deadline(tmp_path: Path) -> None:
    pids, prog = tmp_path / "pids", tmp_path / "progress"
    pids.mkdir()
    p = _submit(
        tmp_path,
        "hang",
        2,
        [
            "--steps",
            "400",
            "--save-every",
            "4",
            "--step-s",
            "0.1",
            "--progress",
            str(prog),
            "--pid-dir",
            str(pids),
            "--fault",
            "hang:1:5",
        ],
        "--grace",
        "6",
        "--max-requeues",
        "0",
    )
    _wait_step(prog, 6, p)
    ranks = _pids(pids)
    assert len(ranks) == 2
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGUSR1)
    code, out = _finish(p, timeout=60)
    took = time.monotonic() - t0
    assert code == 75, out[-3000:]  # preempted; this attempt's newest commit is step 4
    assert took < 6 + 1 + 5, out[-3000:]  # grace, kill delay, slack
    assert not any(_alive(pid) for pid in ranks), out[-3000:]
    ms = manifests(tmp_path / "hang")
    assert [m["step"] for m in ms] == [4]  # the hung save (>= 5) committed nothing


def test_preempted_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """Machine loss on 2 ranks (SIGTERM to the supervisor: exit 75, no local restart),
    then the same run submitted on 1 process: the checkpoint reshards, so it resumes
    without --allow-change and completes."""
    prog = tmp_path / "progress"
    p = _submit(
        tmp_path,
        "shrink",
        2,
        ["--steps", "30", "--step-s", "0.15", "--progress", str(prog)],
        "--grace",
        "60",
    )
    _wait_step(prog, 6, p)
    os.kill(p.pid, signal.SIGTERM)
    code, out = _finish(p)
    assert code == 75, out[-3000:]
    saved = [m for m in manifests(tmp_path / "shrink") if m["kind"] == "recovery"]
    assert saved and saved[0]["world_size"] == 2
    code, out = _finish(
        _submit(
            tmp_path, "shrink", 1, ["--steps", "30", "--step-s", "0.15", "--progress", str(prog)]
        )
    )
    assert code == 0, out[-3000:]
    assert f"resuming from step {saved[0]['step']}" in out and "run completed" in out
    final = next(m for m in manifests(tmp_path / "shrink") if m["kind"] == "final")
    assert final["world_size"] == 1 and final["resumed_from"] is not None
