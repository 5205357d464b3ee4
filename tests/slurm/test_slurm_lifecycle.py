"""Issue 11 item 6 on the real Slurm: a time-limit notice signal that lands after the run
completed leaves the job COMPLETED (the supervisor keeps its handlers until it exits).

The signal is sent the way Slurm's ``--signal=B:USR1`` is (a ``kill`` of the batch shell,
which *is* ckrun: ``exec`` in slurm/ckrun.sbatch), by a process the command leaves in its
own session: it waits for the run's ``completed`` event and then signals the supervisor
as fast as it can until it is gone, so the signal lands in every phase of the exit."""

from __future__ import annotations

import os
import uuid

import pytest
from slurm_helpers import CKRUN, REPO, job_done, wait_for
from test_slurm_e2e import _env, _events, _sbatch

pytestmark = pytest.mark.slurm


def test_time_limit_signal_after_completion_leaves_the_job_completed(
    cluster, tmp_path, cancel_jobs
) -> None:
    name = f"late-{uuid.uuid4().hex[:8]}"
    spam = (
        'sup=$PPID; ev="$CKRUN_CONTROL_DIR/../events.jsonl"; setsid sh -c "'
        "until grep -q '\\\"completed\\\"' $ev; do sleep 0.002; done; "
        'while kill -USR1 $sup 2>/dev/null; do :; done" >/dev/null 2>&1 &'
    )
    job = _sbatch(
        [f"--job-name={name}", "--time=2", "--signal=B:USR1@30",
         f"--output={tmp_path}/{name}-%j.out",
         str(REPO / "slurm" / "ckrun.sbatch"), "sh", "-c", f"{spam} exit 0"],
        _env(tmp_path, CKRUN_LEAD_S="30"), tmp_path,
    )  # fmt: skip
    cancel_jobs.append(job)
    rec = wait_for(lambda: job_done(job), 120, "the job to end")
    assert isinstance(rec, dict)
    out = (tmp_path / f"{name}-{job}.out").read_text()
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), out
    kinds = [e["kind"] for e in _events(tmp_path, name)]
    assert kinds.count("spawn") == 1 and "completed" in kinds
    assert os.path.exists(CKRUN)
