"""The README's test command on a machine with Slurm's client but no controller: the
``slurm`` tests skip with the reason (and fail with ``CKRUN_REQUIRE_SLURM=1``).

Runs pytest in a subprocess with ``SLURM_CONF`` pointing at a controller that does not
exist (a closed local port), so ``sinfo`` is real and fails as it would there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

CONF = """ClusterName=nowhere
SlurmctldHost=localhost
SlurmctldPort=9
MessageTimeout=1
TCPTimeout=1
NodeName=localhost CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES
"""


def _pytest(tmp_path: Path, require: str) -> subprocess.CompletedProcess[str]:
    conf = tmp_path / "slurm.conf"
    conf.write_text(CONF)
    env = dict(os.environ, SLURM_CONF=str(conf), CKRUN_REQUIRE_SLURM=require)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         str(HERE / "test_slurm_e2e.py"), "-k", "dead_supervisor or requeue", "-x"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="needs Slurm's client (sinfo)")
def test_client_without_controller_skips_with_the_reason(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skipped" in r.stdout and "no Slurm controller answers" in r.stdout, r.stdout
    r = _pytest(tmp_path, "1")
    assert r.returncode == 1 and "no Slurm controller answers" in r.stdout, r.stdout
