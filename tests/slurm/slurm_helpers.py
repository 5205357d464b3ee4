"""Helpers and fixtures for the Slurm tests (imported by ``conftest.py`` and the tests).

Tests marked ``slurm`` need the single-node cluster of ``slurm/dev-cluster.sh`` (``.ci/run``
starts it).  They are skipped, with the reason, only when ``sinfo`` is not installed; with
``CKRUN_REQUIRE_SLURM=1`` (set by ``.ci/run``) a missing or stopped cluster fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
CKRUN = str(Path(sys.executable).with_name("ckrun"))


def _require() -> bool:
    return os.environ.get("CKRUN_REQUIRE_SLURM", "") not in ("", "0")


@pytest.fixture(scope="session")
def cluster() -> dict[str, str]:
    """The running dev cluster: ``{"node": NAME}``; skips or fails as described above."""
    if shutil.which("sinfo") is None:
        if _require():
            pytest.fail(
                "CKRUN_REQUIRE_SLURM=1 but sinfo is not installed: run slurm/dev-cluster.sh install"
            )
        pytest.skip(
            "sinfo not found: Slurm is not installed (slurm/dev-cluster.sh install && start)"
        )
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T %P"], capture_output=True, text=True, timeout=30
        )
        lines, err = proc.stdout.split(), proc.stderr.strip()
    except subprocess.TimeoutExpired:
        proc, lines, err = None, [], "sinfo timed out after 30 s"
    if proc is None or proc.returncode != 0 or not lines:
        why = (
            f"sinfo is installed but no Slurm controller answers ({err}): "
            "run slurm/dev-cluster.sh start"
        )
        if _require():
            pytest.fail(why)
        pytest.skip(why)
    node, state = lines[0], lines[1]
    if not state.startswith(("idle", "mixed", "alloc", "compl")):
        why = f"node {node} is {state}: run slurm/dev-cluster.sh start"
        if _require():
            pytest.fail(why)
        pytest.skip(why)
    return {"node": node}


def wait_for(
    cond: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.5
) -> object:
    """Poll ``cond`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{cluster_state()}")
        time.sleep(every_s)


def cluster_state() -> str:
    """What the cluster was doing, for a failed wait: every job with its state and reason
    (``squeue``), the node's state and reason (``sinfo -N``) and the last lines of the
    controller's and node daemon's logs (``slurm/dev-cluster.sh`` writes them)."""
    parts = []
    for argv in (
        ["squeue", "-a", "-o", "%i %T %r %S %e %N %j"],
        ["sinfo", "-N", "-o", "%N %T %E"],
    ):
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            parts.append(f"$ {' '.join(argv)}\n{proc.stdout}{proc.stderr}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            parts.append(f"$ {' '.join(argv)}: {exc}")
    logs = Path(os.environ.get("CKRUN_SLURM_DIR", "/var/tmp/ckrun-slurm")) / "log"
    for name in ("slurmctld.log", "slurmd.log"):
        try:
            tail = (logs / name).read_text(errors="replace").splitlines()[-40:]
            parts.append(f"{logs / name} (last 40 lines):\n" + "\n".join(tail))
        except OSError as exc:
            parts.append(f"{logs / name}: {exc}")
    return "\n".join(parts)


def job_record(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (empty once Slurm forgot the job)."""
    from ckrun.scheduler.slurm_jobs import parse_job_record

    proc = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    )
    return parse_job_record(proc.stdout) if proc.returncode == 0 else {}


def job_done(job_id: str) -> dict[str, str] | None:
    """The job's record once it is in a final state (COMPLETED, FAILED, ...), else None."""
    rec = job_record(job_id)
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    return rec if rec.get("JobState") in final else None


@pytest.fixture
def cancel_jobs() -> object:
    """A list to append job ids to; every one is scancelled after the test."""
    jobs: list[str] = []
    yield jobs
    for jid in jobs:
        subprocess.run(["scancel", jid], capture_output=True, timeout=30)
