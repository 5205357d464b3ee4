"""End to end on the real Slurm: ckrun's supervisor, a real training child, real signals.

Issue 4's list: (1) a time limit with the signal lead → checkpoint → requeue → the same
job id, attempt 1 → completes with the parameters of an uninterrupted run, through
(5) the sbatch template and (6) ``ckrun submit --profile slurm`` (submitit) at once;
(2) preemption of a ``low`` job by a ``high`` job → checkpoint within GraceTime →
requeue → completes; (3) a completed job requeued by hand exits 0 at once and the child
never starts; (4) an array task requeues only itself.  Also: an ``scancel`` is not
undone by ckrun's requeue.

Slurm's time-limit warning arrives 0-30 s before ``lead`` (DESIGN.md §6), so each
time-limit job gets --time=1 and lead 20 s (the notice comes 10-40 s in) and 45 s of
work; once attempt 0 has requeued, the test raises the pending job's limit to 5 min so
attempt 1 finishes instead of being warned again (what a user would do with
``scontrol update``).  A requeued job starts ``cred_expire + 1`` = 11 s later.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import CKRUN, PYTHON, REPO, job_done, job_record, wait_for

pytestmark = pytest.mark.slurm
HERE = Path(__file__).resolve().parent
CHILD = str(HERE / "slurm_child.py")
sys.path.insert(0, str(HERE))
from slurm_child import uninterrupted  # noqa: E402

STEPS, STEP_S = 180, 0.25  # 45 s of work


def _child_args(tmp: Path, tag: str, steps: int = STEPS, step_s: float = STEP_S) -> list[str]:
    out, starts = str(tmp / f"{tag}.out.json"), str(tmp / f"{tag}.starts")
    return [CHILD, "--steps", str(steps), "--step-s", str(step_s), "--out", out, "--starts", starts]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PATH=f"{Path(CKRUN).parent}:{os.environ['PATH']}")
    env.update(CKRUN=CKRUN, CKRUN_STORAGE=str(tmp / "runs"), **extra)
    return env


def _sbatch(args: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=30)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _submit(tmp: Path, run: str, settings: dict[str, str], child: list[str]) -> str:
    argv = [CKRUN, "submit", "--profile", "slurm", "--run", run, "--storage", str(tmp / "runs")]
    for key, value in {"launcher": CKRUN, "log_dir": str(tmp / "logs"), **settings}.items():
        argv += ["--set", f"{key}={value}"]
    proc = subprocess.run([*argv, *child], capture_output=True, text=True, env=_env(tmp),
                          cwd=tmp, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job = json.loads((tmp / "runs" / run / "job.json").read_text())
    assert job["backend"] == "slurm"
    return str(job["job_id"])


def _said(text: str, run: str, attempt: int, phrase: str) -> bool:
    """Whether a ``[ckrun] RUN [job ID] attempt N: PHRASE`` line is in ``text``."""
    pattern = rf"\[ckrun\] {re.escape(run)} (job \S+ )?attempt {attempt}: {re.escape(phrase)}"
    return re.search(pattern, text) is not None


def _starts(tmp: Path, tag: str) -> list[str]:
    path = tmp / f"{tag}.starts"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def _final(tmp: Path, tag: str) -> list[str]:
    return json.loads((tmp / f"{tag}.out.json").read_text())


def _extend_when_requeued(job_id: str) -> dict[str, str] | None:
    """Once attempt 0 has requeued (PENDING, Restarts=1), give attempt 1 five minutes."""
    rec = job_record(job_id)
    if rec.get("JobState") == "PENDING" and rec.get("Restarts") == "1":
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=5"], check=True,
                       timeout=30)  # fmt: skip
        return rec
    return None


def _events(tmp: Path, run: str) -> list[dict]:
    lines = (tmp / "runs" / run / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_time_limit_requeue_template_and_submitit(cluster, tmp_path, cancel_jobs) -> None:
    tpl = _sbatch(
        ["--job-name=tl-tpl", "--time=1", "--signal=B:USR1@20", "--partition=low",
         f"--output={tmp_path}/tl-tpl-%j.out", str(REPO / "slurm" / "ckrun.sbatch"),
         PYTHON, *_child_args(tmp_path, "tpl")],
        _env(tmp_path, CKRUN_LEAD_S="20"), tmp_path,
    )  # fmt: skip
    sub = _submit(tmp_path, "tl-sub", {"time": "1", "lead_s": "20", "partition": "low"},
                  _child_args(tmp_path, "sub"))  # fmt: skip
    cancel_jobs += [tpl, sub]
    pending = {tpl, sub}

    def extended() -> bool:
        for jid in list(pending):
            if _extend_when_requeued(jid):
                pending.discard(jid)
        return not pending

    wait_for(extended, 120, "both jobs to checkpoint and requeue at their time limit")
    for jid in (tpl, sub):
        rec = wait_for(lambda j=jid: job_done(j), 120, f"job {jid} to complete")
        assert (rec["JobState"], rec["Restarts"], rec["ExitCode"]) == ("COMPLETED", "1", "0:0")
    expected = uninterrupted(STEPS)
    for tag, run, log in (("tpl", "tl-tpl", f"tl-tpl-{tpl}.out"),
                          ("sub", "tl-sub", f"logs/{sub}_0_log.err")):  # fmt: skip
        assert _final(tmp_path, tag) == expected, f"{tag}: parameters differ"
        assert [s.split()[1] for s in _starts(tmp_path, tag)] == ["0", "1"]
        text = (tmp_path / log).read_text()  # --open-mode=append: both attempts in one log
        assert _said(text, run, 0, "requeued by the scheduler"), text
        assert _said(text, run, 1, "run completed"), text
        ev = _events(tmp_path, run)
        notice = next(e for e in ev if e["kind"] == "notice")
        assert "SIGUSR1" in notice["message"] or "time_limit" in notice["message"]
        resumed = [e for e in ev if e["kind"] == "spawn"]
        assert len(resumed) == 2


def test_preemption_low_by_high(cluster, tmp_path, cancel_jobs) -> None:
    settings = {"time": "10", "lead_s": "60", "partition": "low", "cpus_per_task": "16"}
    low = _submit(tmp_path, "pre", settings, _child_args(tmp_path, "pre", steps=120))
    cancel_jobs.append(low)
    wait_for(lambda: len(_starts(tmp_path, "pre")) == 1, 60, "the low job's child to start")
    wait_for(lambda: "step 20" in _log(tmp_path, low), 60, "the child to make progress")
    t_high = dt.datetime.now(dt.timezone.utc)
    high = _sbatch(["--partition=high", "--cpus-per-task=16", "--time=1", "--wrap", "sleep 1",
                    f"--output={tmp_path}/high-%j.out"], dict(os.environ), tmp_path)  # fmt: skip
    cancel_jobs.append(high)
    rec = wait_for(lambda: job_done(low), 150, "the preempted job to resume and complete")
    assert (rec["JobState"], rec["Restarts"]) == ("COMPLETED", "1")
    assert job_done(high) is not None
    assert _final(tmp_path, "pre") == uninterrupted(120)
    assert [s.split()[1] for s in _starts(tmp_path, "pre")] == ["0", "1"]
    # `ckrun status` shows Slurm's record next to ckrun's own
    st = subprocess.run(
        [CKRUN, "status", "pre", "--storage", str(tmp_path / "runs"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    view = json.loads(st.stdout)
    assert view["preemptions"] == 1 and view["complete"]
    assert view["scheduler"]["backend"] == "slurm" and view["scheduler"]["job_id"] == low
    assert view["scheduler"]["state"] == "COMPLETED", view["scheduler"]
    # the checkpoint was committed within GraceTime (15 s) of the high job's submission
    manifests = sorted((tmp_path / "runs" / "pre" / "checkpoints").glob("step-*/manifest.json"))
    assert manifests, "no recovery checkpoint was written on preemption"
    committed = json.loads(manifests[-1].read_text())["committed_utc"]
    delay = (dt.datetime.fromisoformat(committed.replace("Z", "+00:00")) - t_high).total_seconds()
    assert 0 < delay < 15, delay
    notice = next(e for e in _events(tmp_path, "pre") if e["kind"] == "notice")
    assert "SIGTERM" in notice["message"]


def test_preemption_of_a_batch_shell_within_killwait(cluster, tmp_path, cancel_jobs) -> None:
    """ckrun.sbatch without preempt_send_user_signal: SIGTERM only when GraceTime ends,
    then KillWait (5 s here) to save; Slurm has already requeued the job by then and
    ``scontrol requeue`` answers "Job is pending execution", which counts as requeued."""
    low = _sbatch(
        ["--job-name=pre-tpl", "--time=10", "--signal=B:USR1@60", "--partition=low",
         "--cpus-per-task=16",
         f"--output={tmp_path}/pre-tpl-%j.out", str(REPO / "slurm" / "ckrun.sbatch"),
         PYTHON, *_child_args(tmp_path, "pret", steps=120)],
        _env(tmp_path, CKRUN_LEAD_S="60"), tmp_path,
    )  # fmt: skip
    cancel_jobs.append(low)
    out = tmp_path / f"pre-tpl-{low}.out"
    wait_for(lambda: "step 20" in _read(out), 60, "the low job's child to make progress")
    high = _sbatch(["--partition=high", "--cpus-per-task=16", "--time=1", "--wrap", "sleep 1",
                    f"--output={tmp_path}/high-%j.out"], dict(os.environ), tmp_path)  # fmt: skip
    cancel_jobs.append(high)
    rec = wait_for(lambda: job_done(low), 150, "the preempted job to resume and complete")
    assert (rec["JobState"], rec["Restarts"]) == ("COMPLETED", "1")
    assert _final(tmp_path, "pret") == uninterrupted(120)
    text = _read(out)
    assert _said(text, "pre-tpl", 0, "notice signal:SIGTERM"), text
    assert _said(text, "pre-tpl", 0, "requeued by the scheduler"), text
    assert _said(text, "pre-tpl", 1, "run completed"), text
    assert "CANCELLED AT" in text and "DUE TO PREEMPTION" in text


def _log(tmp: Path, job_id: str) -> str:
    path = tmp / "logs" / f"{job_id}_0_log.out"
    return path.read_text() if path.exists() else ""


def test_completed_job_requeued_by_hand_exits_at_once(cluster, tmp_path, cancel_jobs) -> None:
    job = _sbatch(
        ["--job-name=done", "--time=2", "--signal=B:USR1@30", f"--output={tmp_path}/done-%j.out",
         str(REPO / "slurm" / "ckrun.sbatch"), PYTHON,
         *_child_args(tmp_path, "done", steps=8, step_s=0.05)],
        _env(tmp_path, CKRUN_LEAD_S="30"), tmp_path,
    )  # fmt: skip
    cancel_jobs.append(job)
    wait_for(lambda: job_done(job), 60, "the job to complete")
    assert _final(tmp_path, "done") == uninterrupted(8)
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    rec = wait_for(
        lambda: (r := job_done(job)) and r.get("Restarts") == "1" and r,
        60,
        "the requeued completed job to run again and end",
    )
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0")
    assert len(_starts(tmp_path, "done")) == 1, "the child started again"
    text = (tmp_path / f"done-{job}.out").read_text()
    assert "already complete" in text.lower() or "complete" in text.splitlines()[-1].lower(), text


def test_template_lead_not_shorter_than_time_limit_is_refused(
    cluster, tmp_path, cancel_jobs
) -> None:
    """``sbatch --time=2 ckrun.sbatch`` keeps the template's 120 s lead (``--signal=B:USR1@120``,
    ``CKRUN_LEAD_S=120``): Slurm accepts it and would warn at once, so every attempt would
    checkpoint and requeue as it starts.  ckrun refuses in the job: exit 3, never requeued,
    the child never started, the message names both values and the fix."""
    env = _env(tmp_path)
    env.pop("CKRUN_LEAD_S", None)
    job = _sbatch(
        ["--job-name=short", "--time=2", f"--output={tmp_path}/short-%j.out",
         str(REPO / "slurm" / "ckrun.sbatch"), PYTHON, *_child_args(tmp_path, "short")],
        env, tmp_path,
    )  # fmt: skip
    cancel_jobs.append(job)
    rec = wait_for(lambda: job_done(job), 60, "the job to be refused")
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "3:0", "0")
    assert _starts(tmp_path, "short") == [], "the child started"
    text = _read(tmp_path / f"short-{job}.out")
    assert "lead_s=120" in text and "TimeLimit=00:02:00 (120 s)" in text, text
    assert "--signal=B:USR1@LEAD" in text, text


def test_array_task_requeues_only_itself(cluster, tmp_path, cancel_jobs) -> None:
    arr = _sbatch(
        ["--array=0-1", "--job-name=arr", "--time=5", "--signal=B:USR1@30",
         f"--output={tmp_path}/arr-%A_%a.out", str(REPO / "slurm" / "ckrun.sbatch"), PYTHON,
         CHILD, "--steps", "60", "--step-s", "0.25",
         "--out", f"{tmp_path}/arr.out.json", "--starts", f"{tmp_path}/arr.starts"],
        _env(tmp_path, CKRUN_LEAD_S="30"), tmp_path,
    )  # fmt: skip
    cancel_jobs.append(arr)
    task1 = f"{arr}_1"
    wait_for(lambda: "step 20" in _read(tmp_path / f"arr-{arr}_1.out"), 60, "task 1 progress")
    # the notice signal to task 1's batch shell only (that is, to its ckrun supervisor)
    subprocess.run(["scancel", "--batch", "--signal=USR1", task1], check=True, timeout=30)
    t0 = wait_for(lambda: job_done(f"{arr}_0"), 120, "task 0 to complete")
    t1 = wait_for(lambda: job_done(task1), 120, "task 1 to requeue and complete")
    assert (t0["JobState"], t0["Restarts"]) == ("COMPLETED", "0")
    assert (t1["JobState"], t1["Restarts"]) == ("COMPLETED", "1")
    out1 = _read(tmp_path / f"arr-{arr}_1.out")
    assert _said(out1, "arr-1", 0, "requeued by the scheduler"), out1
    assert _said(out1, "arr-1", 1, "run completed"), out1
    assert "requeued" not in _read(tmp_path / f"arr-{arr}_0.out")
    assert _final(tmp_path, "arr") == uninterrupted(60)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_scancel_is_not_undone(cluster, tmp_path, cancel_jobs) -> None:
    job = _sbatch(
        ["--job-name=canc", "--time=5", "--signal=B:USR1@30", f"--output={tmp_path}/canc-%j.out",
         str(REPO / "slurm" / "ckrun.sbatch"), PYTHON, *_child_args(tmp_path, "canc")],
        _env(tmp_path, CKRUN_LEAD_S="30"), tmp_path,
    )  # fmt: skip
    cancel_jobs.append(job)
    wait_for(lambda: "step 10" in _read(tmp_path / f"canc-{job}.out"), 60, "progress")
    subprocess.run(["scancel", job], check=True, timeout=30)  # SIGTERM to ckrun, then KILL
    rec = wait_for(lambda: job_done(job), 60, "the cancelled job to end")
    assert rec["JobState"] == "CANCELLED" and rec["Restarts"] == "0"
    assert len(_starts(tmp_path, "canc")) == 1
    text = _read(tmp_path / f"canc-{job}.out")
    assert "being cancelled" in text, text  # checkpointed, then refused to requeue
