"""The Slurm backend against the real single-node Slurm, with ``probe.py`` standing in
for the supervisor (the full supervisor runs in ``test_slurm_e2e.py``).

Covers: submit through submitit (srun path), ``current()`` inside the job, the
time-limit watcher reading the real end time, ``scontrol requeue`` from inside (same job
id, attempt 1, the SIGTERM that follows), an array task requeueing only itself, a refused
requeue (exit 6 naming the fix), ``status``/``cancel``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path

import pytest
from ckrun.errors import SchedulerError
from ckrun.notices import parse_utc
from ckrun.scheduler.base import JobSpec, JobState
from ckrun.scheduler.slurm import Options, SlurmScheduler
from slurm_helpers import PYTHON, REPO, job_done, job_record, wait_for

pytestmark = pytest.mark.slurm
PROBE = str(Path(__file__).resolve().with_name("probe.py"))


def _read(root: Path, attempt: int) -> dict:
    path = root / f"attempt-{attempt}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _sbatch(args: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", *args], capture_output=True, text=True, env=env, cwd=cwd,
        timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_submitit_path_watcher_and_requeue(cluster, tmp_path, cancel_jobs) -> None:
    # Slurm sends --signal's warning at its first 30 s check once the job is within
    # lead + 30 s of its end: with a 60 s limit the lead stays under 30 s, so the USR1
    # never comes as the step starts, before any Python handler exists (CI, job 37:
    # "task 0 died by signal: 10" 0.1 s after launch with lead_s=50)
    opts = Options(time="1", lead_s=25, log_dir=str(tmp_path / "logs"),
                   launcher=f"{PYTHON} {PROBE}", partition="low")  # fmt: skip
    spec = JobSpec(run="probe", command=("python", "train.py"), storage=str(tmp_path),
                   env={"PROBE_MODE": "watch_requeue"})  # fmt: skip
    sched = SlurmScheduler(opts)
    job_id = sched.submit(spec)
    cancel_jobs.append(job_id)
    assert job_id.isdigit()
    root = tmp_path / "probe"
    wait_for(lambda: _read(root, 1), 120, "attempt 1 of the requeued job")
    rec = wait_for(lambda: job_done(job_id), 60, "job to finish")
    a0, a1 = _read(root, 0), _read(root, 1)
    assert (a0["job"]["job_id"], a0["job"]["attempt"], a0["job"]["rank"]) == (job_id, 0, 0)
    assert (a1["job"]["job_id"], a1["job"]["attempt"]) == (job_id, 1)
    assert a0["job"]["detail"]["in_step"] is True  # the supervisor runs as an srun step
    assert a0["lead_s"] == 25 and a0["command"] == ["python", "train.py"]
    # the watcher fired lead_s before the end time Slurm reported (1 min limit)
    end = parse_utc(a0["job"]["end"])
    started = parse_utc(a0["started_utc"])
    assert 40 <= (end - started).total_seconds() <= 61
    notice = a0["notice"]
    assert notice["kind"] == "time_limit" and parse_utc(notice["deadline_utc"]) == end
    left = (end - parse_utc(notice["detected_at"])).total_seconds()
    assert 22 <= left <= 25.5, left  # the probe polls every 0.1 s; slack for a loaded CI
    # requeue: accepted, then SIGTERM reaches the caller shortly after scontrol returns
    assert a0["requeue"] == "requeued"
    assert a0["sigterm_after_return_s"] is not None and a0["sigterm_after_return_s"] < 2
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1"
    assert sched.status(job_id) == JobState.COMPLETED
    info = sched.describe(job_id)
    assert (info["state"], info["slurm_state"], info["restarts"]) == ("COMPLETED", "COMPLETED", 1)
    log = (tmp_path / "logs" / f"{job_id}_0_log.out").read_text()
    assert f"probe attempt 0 of {job_id}" in log and f"probe attempt 1 of {job_id}" in log


def test_array_task_requeues_only_itself(cluster, tmp_path, cancel_jobs) -> None:
    env = dict(os.environ, CKRUN=f"{PYTHON} {PROBE}", CKRUN_STORAGE=str(tmp_path),
               PROBE_MODE="requeue_task1", CKRUN_LEAD_S="30")  # fmt: skip
    array_id = _sbatch(
        ["--array=0-1", "--job-name=arr", "--time=2", "--signal=B:USR1@30",
         f"--output={tmp_path}/%x-%A_%a.out", str(REPO / "slurm" / "ckrun.sbatch"),
         "python", "train.py"],
        env, tmp_path,
    )  # fmt: skip
    cancel_jobs.append(array_id)
    wait_for(lambda: _read(tmp_path / "arr-1", 1), 120, "attempt 1 of array task 1")
    t0 = wait_for(lambda: job_done(f"{array_id}_0"), 60, "task 0 to finish")
    t1 = wait_for(lambda: job_done(f"{array_id}_1"), 60, "task 1 to finish")
    assert (t0["JobState"], t0["Restarts"]) == ("COMPLETED", "0")
    assert (t1["JobState"], t1["Restarts"]) == ("COMPLETED", "1")
    assert not (tmp_path / "arr-0" / "attempt-1.json").exists()
    a1 = _read(tmp_path / "arr-1", 1)
    assert a1["job"]["job_id"] == f"{array_id}_1" and a1["job"]["attempt"] == 1
    assert _read(tmp_path / "arr-1", 0)["requeue"] == "requeued"
    assert a1["job"]["detail"]["in_step"] is False  # ckrun.sbatch: exec'd as the batch shell


def test_refused_requeue_exits_6_with_the_fix(cluster, tmp_path, cancel_jobs) -> None:
    env = dict(os.environ, CKRUN=f"{PYTHON} {PROBE}", CKRUN_STORAGE=str(tmp_path),
               PROBE_MODE="requeue", CKRUN_LEAD_S="30")  # fmt: skip
    job_id = _sbatch(
        ["--no-requeue", "--job-name=noreq", "--time=2", "--signal=B:USR1@30",
         f"--output={tmp_path}/%j.out",
         str(REPO / "slurm" / "ckrun.sbatch"), "python", "train.py"],
        env, tmp_path,
    )  # fmt: skip
    cancel_jobs.append(job_id)
    rec = wait_for(lambda: job_done(job_id), 60, "the --no-requeue job to end")
    a0 = _read(tmp_path / "noreq", 0)
    assert a0["exit_code"] == 6 and "--requeue" in a0["requeue_error"]
    assert "presently disabled" in a0["requeue_error"]
    assert rec["JobState"] == "FAILED" and rec["ExitCode"] == "6:0" and rec["Restarts"] == "0"


def test_status_and_cancel(cluster, tmp_path, cancel_jobs) -> None:
    job_id = _sbatch(["--time=2", "--wrap", "sleep 60", f"--output={tmp_path}/%j.out"],
                     dict(os.environ), tmp_path)  # fmt: skip
    cancel_jobs.append(job_id)
    sched = SlurmScheduler()
    wait_for(lambda: sched.status(job_id) == JobState.RUNNING, 30, "the job to run")
    end = sched.end_time(job_id)
    assert end is not None
    now = dt.datetime.now(dt.timezone.utc)
    assert 60 <= (end - now).total_seconds() <= 121
    sched.cancel(job_id)
    wait_for(lambda: sched.status(job_id) == JobState.CANCELLED, 30, "the job to be cancelled")
    sched.cancel(job_id)  # idempotent
    assert sched.status("99999999") == JobState.UNKNOWN
    assert job_record(job_id)["JobState"] == "CANCELLED"


def test_submit_refused_names_the_problem(cluster, tmp_path) -> None:
    opts = Options(partition="no-such-partition", log_dir=str(tmp_path / "logs"))
    spec = JobSpec(run="x", command=("true",), storage=str(tmp_path / "x"))
    with pytest.raises(SchedulerError, match="sbatch refused the job") as ei:
        SlurmScheduler(opts).submit(spec)
    assert "partition" in str(ei.value).lower()
