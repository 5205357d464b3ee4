"""Helpers of the distributed tests: N real rank processes on gloo, and ckrun runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TRAIN = str(Path(__file__).with_name("dist_train.py"))
FSDP_TRAIN = str(Path(__file__).with_name("fsdp_train.py"))
REPO = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, storage: str, **extra: str) -> dict[str, str]:
    """Environment of one rank (what torchrun would set) with CKRUN_STORAGE."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKRUN_")}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CKRUN_STORAGE=storage,
        CKRUN_RUN="dist",
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def start_world(
    world: int, storage: str, args: list[str], script: str = TRAIN, **extra: str
) -> list[subprocess.Popen[str]]:
    """Start ``world`` rank processes of ``script`` (dist_train.py; no supervisor, no
    torchrun)."""
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, script, *args],
            env=rank_env(r, world, port, storage, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]


def wait_all(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[int]:
    """Exit codes of every process (killed after ``timeout`` seconds: the test fails)."""
    end = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out = "\n".join((q.communicate()[0] or "")[-2000:] for q in procs)
            raise AssertionError(f"ranks did not finish in {timeout} s:\n{out}") from None
        codes.append(p.returncode)
    return codes


def run_world(
    world: int,
    storage: str,
    args: list[str],
    timeout: float = 120,
    script: str = TRAIN,
    **extra: str,
) -> list[int]:
    """Run ``world`` ranks to the end; their output is shown when a rank failed."""
    procs = start_world(world, storage, args, script, **extra)
    codes = wait_all(procs, timeout)
    if any(c not in (0, 75) for c in codes):
        out = "\n---\n".join((p.stdout.read() if p.stdout else "")[-3000:] for p in procs)
        raise AssertionError(f"exit codes {codes}:\n{out}")
    return codes


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


def manifests(root: str | Path) -> list[dict[str, Any]]:
    """Committed manifests under ``checkpoints/`` and ``final/``, by step."""
    out = []
    for area in ("checkpoints", "final"):
        d = Path(root) / area
        if d.is_dir():
            out += [read_json(m) for m in sorted(d.glob("step-*/manifest.json"))]
    return sorted(out, key=lambda m: m["step"])


def shard_files(root: str | Path, step: int) -> list[str]:
    d = Path(root) / "checkpoints" / f"step-{step:010d}"
    return sorted(p.name for p in d.glob("shard-*")) if d.is_dir() else []


def submit(
    tmp: Path, run: str, world: int, script: str, train_args: list[str], *ckrun_args: str
) -> subprocess.Popen[str]:
    """``ckrun submit --nproc-per-node world script -- train_args`` with fast timings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKRUN_")}
    env.update(CKRUN_KILL_DELAY_S="1", CKRUN_MARGIN_S="0.5", CKRUN_BACKOFF_S="0.1")
    env.update(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ckrun.cli", "submit", "--run", run, "--storage", str(tmp)]
    cmd += ["--nproc-per-node", str(world), *ckrun_args, script, "--", *train_args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp
    )


def finish(p: subprocess.Popen[str], timeout: float = 400) -> tuple[int, str]:
    """Exit code and output of a ``submit`` (killed after ``timeout`` s: the test fails)."""
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"ckrun did not finish in {timeout} s:\n{out[-4000:]}") from None
    return p.returncode, out


def wait_step(progress: Path, step: int, p: subprocess.Popen[str], timeout: float = 300) -> None:
    """Wait until ``progress`` holds a step >= ``step`` (the run must stay alive)."""
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
