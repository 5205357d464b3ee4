"""current(), requeue() and the time-limit watcher without a cluster.

The job environment is a dict handed to ``SlurmScheduler(env=...)``; its PATH points at
an empty directory (no Slurm tools) or at a stand-in ``scontrol`` script where the test
says so.  The same paths run against the real Slurm in ``test_slurm_cluster.py``.
"""

from __future__ import annotations

import datetime as dt
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from ckrun.errors import ConfigError, ExitCode, RequeueError
from ckrun.notices import TIME_LIMIT
from ckrun.scheduler.base import JobInfo, JobState, RequeueOutcome, Scheduler
from ckrun.scheduler.slurm import Options, SlurmScheduler
from ckrun.scheduler.slurm_jobs import (
    TimeLimitWatcher,
    check_lead_time,
    map_state,
    parse_job_record,
    parse_slurm_time,
    parse_time_limit_s,
    validate_job_id,
)

UTC = dt.timezone.utc


def _env(tmp_path: Path, **slurm: str) -> dict[str, str]:
    empty = tmp_path / "nobin"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty), **slurm}


def test_protocol() -> None:
    assert isinstance(SlurmScheduler(), Scheduler)


def test_current_outside_slurm(tmp_path: Path) -> None:
    assert SlurmScheduler(env=_env(tmp_path)).current() is None


def test_current_first_run(tmp_path: Path) -> None:
    env = _env(tmp_path, SLURM_JOB_ID="4242", SLURM_PROCID="0", SLURM_NNODES="2",
               SLURMD_NODENAME="n1", SLURM_JOB_PARTITION="low")  # fmt: skip
    job = SlurmScheduler(env=env).current()
    assert job is not None
    assert (job.backend, job.job_id, job.attempt, job.rank) == ("slurm", "4242", 0, 0)
    assert job.time_limit_end_utc is None  # no squeue/scontrol on PATH
    assert job.detail["nnodes"] == 2 and job.detail["partition"] == "low"


def test_current_array_task_restart_rank(tmp_path: Path) -> None:
    env = _env(tmp_path, SLURM_JOB_ID="4250", SLURM_ARRAY_JOB_ID="4248",
               SLURM_ARRAY_TASK_ID="2", SLURM_RESTART_COUNT="3", SLURM_PROCID="1")  # fmt: skip
    job = SlurmScheduler(env=env).current()
    assert job is not None
    assert (job.job_id, job.attempt, job.rank) == ("4248_2", 3, 1)
    assert job.detail["slurm_job_id"] == "4250"


def test_current_rejects_odd_job_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid Slurm job id"):
        SlurmScheduler(env=_env(tmp_path, SLURM_JOB_ID="12 --all")).current()


@pytest.mark.parametrize("bad", ["", "-1", "12 34", "12;rm", "1_2_3", "abc", "1_", "0x10"])
def test_validate_job_id_rejects(bad: str) -> None:
    with pytest.raises(ConfigError):
        validate_job_id(bad)


def test_validate_job_id_accepts() -> None:
    assert validate_job_id(" 17 ") == "17" and validate_job_id("17_3") == "17_3"


def test_requeue_without_scontrol_exits_6(tmp_path: Path) -> None:
    s = SlurmScheduler(env=_env(tmp_path))
    with pytest.raises(RequeueError) as ei:
        s.requeue(JobInfo(backend="slurm", job_id="77"))
    assert ei.value.exit_code == ExitCode.REQUEUE_FAILED == 6
    msg = str(ei.value)
    assert "scontrol not found" in msg and "container" in msg and "scontrol requeue 77" in msg


def test_requeue_other_ranks_do_not_call(tmp_path: Path) -> None:
    # no scontrol on PATH: had rank 1 called it, RequeueError would be raised
    s = SlurmScheduler(env=_env(tmp_path))
    assert s.requeue(JobInfo(backend="slurm", job_id="77", rank=1)) == RequeueOutcome.REQUEUED


def _fake_scontrol(tmp_path: Path, body: str) -> dict[str, str]:
    """A stand-in scontrol (shell script) logging its argv; used where no cluster runs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": str(bindir)}


def test_requeue_refused_names_the_fix(tmp_path: Path) -> None:
    # Stand-in for the real message measured on Slurm 22.05 (test_slurm_cluster checks it live).
    body = (
        'case "$1" in requeue) echo "Requested operation is presently disabled for job 9" >&2;'
        ' exit 1;; show) echo "JobId=9 JobState=RUNNING Restarts=0"; exit 0;; esac'
    )
    s = SlurmScheduler(env=_fake_scontrol(tmp_path, body))
    with pytest.raises(RequeueError, match=r"--requeue") as ei:
        s.requeue(JobInfo(backend="slurm", job_id="9"))
    assert "presently disabled" in str(ei.value) and "checkpoint is" in str(ei.value)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["show job -o 9", "requeue 9", "show job -o 9"]


def test_requeue_once_and_argv_only(tmp_path: Path) -> None:
    body = 'case "$1" in show) echo "JobId=9_4 JobState=RUNNING Restarts=0";; esac; exit 0'
    s = SlurmScheduler(env=_fake_scontrol(tmp_path, body))
    job = JobInfo(backend="slurm", job_id="9_4")
    assert s.requeue(job) == RequeueOutcome.REQUEUED
    assert s.requeue(job) == RequeueOutcome.REQUEUED
    assert (tmp_path / "calls").read_text().splitlines() == ["show job -o 9_4", "requeue 9_4"]
    with pytest.raises(ConfigError):
        s.requeue(JobInfo(backend="slurm", job_id="9; touch /tmp/x"))


def test_requeue_already_requeued_by_preemption(tmp_path: Path) -> None:
    # Measured: during a PreemptMode=REQUEUE preemption scontrol answers "Job is pending
    # execution" and the job shows COMPLETING with Restarts already incremented.
    body = (
        'case "$1" in requeue) echo "Job is pending execution for job 5" >&2; exit 1;;'
        ' show) echo "JobId=5 JobState=COMPLETING Requeue=1 Restarts=1"; exit 0;; esac'
    )
    s = SlurmScheduler(env=_fake_scontrol(tmp_path, body))
    assert s.requeue(JobInfo(backend="slurm", job_id="5", attempt=0)) == RequeueOutcome.REQUEUED


@pytest.mark.parametrize(
    ("record", "calls_requeue", "outcome"),
    [
        # records measured on Slurm 22.05 inside the job, right after its SIGTERM:
        ("JobState=COMPLETING Reason=None Restarts=0", False, "cancelled"),  # scancel
        ("JobState=CANCELLED Reason=None Restarts=0", False, "cancelled"),
        ("JobState=COMPLETING Reason=TimeLimit Restarts=0", True, "requeued"),  # past limit
        ("JobState=RUNNING Reason=None Restarts=0", True, "requeued"),  # srun preemption
        ("JobState=COMPLETING Reason=None Restarts=1", False, "requeued"),  # after GraceTime
    ],
)
def test_requeue_reads_the_job_state_first(
    tmp_path: Path, record: str, calls_requeue: bool, outcome: str
) -> None:
    body = f'case "$1" in show) echo "JobId=5 {record}";; esac; exit 0'
    s = SlurmScheduler(env=_fake_scontrol(tmp_path, body))
    job = JobInfo(backend="slurm", job_id="5", attempt=0)
    if outcome == "cancelled":
        with pytest.raises(RequeueError, match="being cancelled"):
            s.requeue(job)
    else:
        assert s.requeue(job) == RequeueOutcome.REQUEUED
    assert ("requeue 5" in (tmp_path / "calls").read_text().splitlines()) is calls_requeue


@pytest.mark.parametrize(
    ("text", "secs"),
    [("90", 5400), ("1:30", 90), ("4:00:00", 14400), ("1-0", 86400), ("1-2:03", 93780),
     ("2-00:00:05", 172805)],
)  # fmt: skip
def test_parse_time_limit(text: str, secs: int) -> None:
    assert parse_time_limit_s(text) == secs


def test_parse_slurm_time_uses_local_zone() -> None:
    code = (
        "from ckrun.scheduler.slurm_jobs import parse_slurm_time as p;"
        "print(p('2026-01-15T10:00:00').isoformat(), p('Unknown'), p('N/A'))"
    )
    env = dict(os.environ, TZ="Europe/Berlin")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["2026-01-15T09:00:00+00:00", "None", "None"], out.stderr


def test_parse_job_record() -> None:
    rec = parse_job_record("JobId=5 JobName=a b JobState=COMPLETED Restarts=1 EndTime=Unknown")
    assert rec["JobState"] == "COMPLETED" and rec["Restarts"] == "1" and rec["JobName"] == "a"
    assert parse_slurm_time(rec["EndTime"]) is None


class _Clock:
    def __init__(self, t: dt.datetime) -> None:
        self.t = t

    def __call__(self) -> dt.datetime:
        return self.t


def test_watcher_fires_lead_before_end_once() -> None:
    t0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    end = t0 + dt.timedelta(seconds=600)
    clock = _Clock(t0)
    w = TimeLimitWatcher("7", 120, lambda jid: end, refresh_s=3600, now=clock)
    try:
        assert w.wait_read(5)
        assert w.poll() is None
        clock.t = end - dt.timedelta(seconds=121)
        assert w.poll() is None
        clock.t = end - dt.timedelta(seconds=120)
        n = w.poll()
        assert n is not None and n.kind == TIME_LIMIT and n.source == "slurm:time_limit"
        assert n.deadline_utc == end and n.detail["job_id"] == "7" and n.detail["lead_s"] == 120
        assert w.poll() is None
    finally:
        w.close()


def test_watcher_follows_a_changed_end_time_and_survives_errors() -> None:
    t0 = dt.datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    end = t0 + dt.timedelta(seconds=100)
    answers = iter([None, RuntimeError("slurmctld down")])  # then `end` for ever

    def reader(jid: str) -> dt.datetime | None:
        value = next(answers, end)
        if isinstance(value, Exception):
            raise value
        return value

    w = TimeLimitWatcher("7", 120, reader, refresh_s=0.01, now=lambda: t0)
    try:
        waited = threading.Event()
        for _ in range(500):
            if w.end_utc is not None:
                break
            waited.wait(0.01)
        assert w.end_utc == end
        n = w.poll()  # 100 s left < lead 120: fires at once
        assert n is not None and n.seconds_left(t0) == 100
    finally:
        w.close()


def test_notice_sources(tmp_path: Path) -> None:
    s = SlurmScheduler(Options(lead_s=45), env=_env(tmp_path))
    assert s.notice_sources(None) == []
    (w,) = s.notice_sources(JobInfo(backend="slurm", job_id="3"))
    try:
        assert isinstance(w, TimeLimitWatcher) and w.lead_s == 45
        assert w.wait_read(5) and w.poll() is None  # end time unknown without Slurm
    finally:
        w.close()


def test_lead_from_env_when_no_options(tmp_path: Path) -> None:
    assert SlurmScheduler(env=_env(tmp_path, CKRUN_LEAD_S="33")).lead_s == 33
    assert SlurmScheduler(Options(lead_s=50), env=_env(tmp_path, CKRUN_LEAD_S="33")).lead_s == 50
    with pytest.raises(ConfigError, match="whole seconds"):
        SlurmScheduler(env=_env(tmp_path, CKRUN_LEAD_S="2m"))


@pytest.mark.parametrize(
    ("lead", "limit", "ok"),
    [
        (0, 60, True),
        (59, 60, True),
        (60, 60, False),
        (120, 120, False),
        (300, 120, False),
        (-1, 60, False),
    ],
)
def test_check_lead_time_rule(lead: int, limit: int, ok: bool) -> None:
    # sbatch(1) --signal: the warning is due once the job is within the lead of its end,
    # so a lead of the whole limit (or more) is due from the start: refused, naming both.
    if ok:
        check_lead_time(lead, limit, "time='1'", "FIX")
        return
    with pytest.raises(ConfigError) as ei:
        check_lead_time(lead, limit, "time='1'", "FIX")
    msg = str(ei.value)
    assert f"lead_s={lead}" in msg and f"time='1' ({limit} s)" in msg and msg.endswith("FIX")


def _job_with_limit(tmp_path: Path, limit: str, lead: str) -> dict[str, str]:
    body = f'case "$1" in show) echo "JobId=5 JobState=RUNNING Restarts=0 TimeLimit={limit}";; esac'
    env = _fake_scontrol(tmp_path, body)
    return {**env, "SLURM_JOB_ID": "5", "CKRUN_LEAD_S": lead}


def test_current_refuses_a_lead_not_shorter_than_the_time_limit(tmp_path: Path) -> None:
    # sbatch --time=2 slurm/ckrun.sbatch with its 120 s lead: Slurm would send USR1 at once
    with pytest.raises(ConfigError) as ei:
        SlurmScheduler(env=_job_with_limit(tmp_path, "00:02:00", "120")).current()
    msg = str(ei.value)
    assert "lead_s=120" in msg and "TimeLimit=00:02:00 (120 s)" in msg
    assert "--signal=B:USR1@LEAD" in msg and "CKRUN_LEAD_S=LEAD" in msg
    assert ei.value.exit_code == ExitCode.CONFIG_INVALID


@pytest.mark.parametrize(("limit", "lead"), [("00:02:00", "30"), ("UNLIMITED", "120"),
                                             ("1-00:00:00", "86399")])  # fmt: skip
def test_current_accepts_a_lead_shorter_than_the_time_limit(
    tmp_path: Path, limit: str, lead: str
) -> None:
    job = SlurmScheduler(env=_job_with_limit(tmp_path, limit, lead)).current()
    assert job is not None and job.job_id == "5" and job.detail["lead_s"] == int(lead)
    assert "show job -o 5" in (tmp_path / "calls").read_text().splitlines()


@pytest.mark.parametrize(
    ("word", "state"),
    [("PREEMPTED", JobState.PREEMPTED), ("FAILED", JobState.FAILED),
     ("REQUEUED", JobState.REQUEUED), ("requeue_hold", JobState.REQUEUED),
     ("COMPLETING", JobState.RUNNING), ("TIMEOUT", JobState.TIMEOUT),
     ("CANCELLED", JobState.CANCELLED), ("OUT_OF_MEMORY", JobState.FAILED),
     ("PENDING", JobState.PENDING), ("WHATEVER", JobState.UNKNOWN)],
)  # fmt: skip
def test_map_state_keeps_preempted_apart(word: str, state: JobState) -> None:
    assert map_state(word) == state
