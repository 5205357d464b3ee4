"""``ckrun logs NAME -f`` of a run submitted to the real single-node Slurm: the job's
``.out``/``.err`` files recorded in ``job.json`` at submission, followed until the
supervisor has exited (the supervisor's lines and the command's output)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from slurm_helpers import CKRUN

pytestmark = pytest.mark.slurm


def test_logs_follow_a_slurm_job_to_its_end(cluster, tmp_path: Path, cancel_jobs) -> None:
    env = dict(os.environ, PATH=f"{Path(CKRUN).parent}:{os.environ['PATH']}")
    env.pop("CKRUN_STORAGE_BASE", None)
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    r = subprocess.run(
        [CKRUN, "submit", "--profile", "slurm", "--run", "lg", "--storage", str(runs),
         "--set", f"launcher={CKRUN}", "--set", f"log_dir={logs}", "--time", "5",
         "--", "bash", "-c", "echo hello-from-the-job"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = json.loads((runs / "lg" / "job.json").read_text())
    cancel_jobs.append(str(job["job_id"]))
    assert job["log_files"] == [
        str(logs / f"{job['job_id']}_0_log.out"),
        str(logs / f"{job['job_id']}_0_log.err"),
    ]
    assert f"ckrun logs lg -f --storage {runs}" in r.stderr
    r = subprocess.run(
        [CKRUN, "logs", "lg", "--storage", str(runs), "-f"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "hello-from-the-job" in r.stdout and "[ckrun] lg" in r.stdout, r.stdout
    assert "run completed" in r.stdout, r.stdout
    # the timeline page carries Slurm's own record of the job
    page = tmp_path / "lg.html"
    r = subprocess.run(
        [CKRUN, "status", "lg", "--storage", str(runs), "--html", str(page), "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)["scheduler"]
    assert view["backend"] == "slurm" and view["job_id"] == str(job["job_id"]), view
    text = page.read_text()
    assert f"<th>job_id</th><td>{job['job_id']}</td>" in text
    assert "state" in view and f"<th>state</th><td>{view['state']}</td>" in text, view
