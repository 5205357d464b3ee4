"""Slurm backend: render and submit through submitit, know the current job, requeue it.

Each task of the job runs the ckrun supervisor (``ckrun run --run NAME --storage BASE
-- CMD``), never submitit's pickled-function runner, so submitit's in-job signal handling
(its USR2 handler, its own ``scontrol requeue`` and ``max_num_timeout``) never runs: the
supervisor decides checkpoint and requeue.  submitit renders the sbatch script (the same
text ``--dry-run`` prints and ``submit`` hands to ``sbatch``) and parses the job id.

Signals (DESIGN.md §6, measured on Slurm 22.05): with ``use_srun`` (default) the
supervisor runs as an ``srun`` step, one task per node, and ``--signal=SIG@lead`` (no
``B:``) reaches every node's supervisor; a preemption sends SIGTERM to steps at once,
so the checkpoint happens within ``GraceTime``.  With ``use_srun: false`` (one node) the
script ``exec``s the supervisor as the batch shell and uses ``--signal=B:SIG@lead``; a
preemption then reaches it only when ``GraceTime`` ends (``KillWait`` before SIGKILL)
unless the site sets ``SlurmctldParameters=preempt_send_user_signal``.  Either way the
time-limit watcher (:meth:`SlurmScheduler.notice_sources`) fires ``lead_s`` before the
end time read from Slurm, signal or not.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from ckrun.errors import ConfigError, RequeueError, SchedulerError
from ckrun.notices import NoticeSource
from ckrun.scheduler.base import JobInfo, JobSpec, JobState, RequeueOutcome
from ckrun.scheduler.slurm_jobs import (
    TimeLimitWatcher,
    check_lead_time,
    map_state,
    parse_job_record,
    parse_slurm_time,
    parse_time_limit_s,
    validate_job_id,
)
from ckrun.scheduler.slurm_options import Options, options_from_mapping
from ckrun.scheduler.slurm_requeue import (
    CMD_TIMEOUT_S,
    int_or,
    requeue_fix,
    requeue_verdict,
    scontrol_requeue,
)
from ckrun.scheduler.slurm_script import LEAD_ENV, render_script, submit_script, supervisor_command

log = logging.getLogger(__name__)

__all__ = ["Options", "SlurmScheduler", "options_from_mapping"]


class SlurmScheduler:
    """The Slurm backend of the :class:`~ckrun.scheduler.base.Scheduler` protocol."""

    name = "slurm"

    def __init__(self, options: Options | None = None, *, env: Mapping[str, str] | None = None):
        """Create the backend.

        Args:
            options: the profile's Slurm options (``spec.options`` wins in :meth:`render`
                and :meth:`submit`).  None builds defaults; the watcher's lead time then
                comes from ``CKRUN_LEAD_S`` when set (the rendered script exports it).
            env: environment to read the job from (default ``os.environ``; tests).

        Raises:
            ConfigError: ``CKRUN_LEAD_S`` is not a non-negative whole number.
        """
        self._env: Mapping[str, str] = os.environ if env is None else env
        self.options = options if options is not None else Options()
        self.lead_s = self.options.lead_s
        lead = self._env.get(LEAD_ENV, "").strip()
        if options is None and lead:
            if not lead.isdigit():
                raise ConfigError(f"{LEAD_ENV}={lead!r}: give the lead time in whole seconds")
            self.lead_s = int(lead)
        self._requeued: set[str] = set()

    # -- rendering and submission ------------------------------------------------------

    def _opts(self, spec: JobSpec) -> Options:
        return spec.options if isinstance(spec.options, Options) else self.options

    def supervisor_command(self, spec: JobSpec) -> str:
        """The shell-quoted ``ckrun run --run NAME --storage BASE [ARGS] -- CMD`` line
        (:func:`ckrun.scheduler.slurm_script.supervisor_command`)."""
        return supervisor_command(spec, self._opts(spec))

    def render(self, spec: JobSpec) -> str:
        """The exact sbatch script :meth:`submit` hands to ``sbatch`` (no side effects):
        :func:`ckrun.scheduler.slurm_script.render_script`.

        Raises:
            ConfigError: no command, a bad environment name, ``spec.env`` setting a
                different ``CKRUN_NOTICE_SIGNAL`` than the one Slurm will send.
        """
        return render_script(spec, self._opts(spec))

    def submit(self, spec: JobSpec) -> str:
        """Submit through submitit's executor; returns the Slurm job id.

        Raises:
            SchedulerError: ``sbatch``/``srun`` missing, or ``sbatch`` refused the job
                (its message is included).
        """
        return submit_script(spec, self._opts(spec), self._env.get("PATH", os.defpath))

    def log_files(self, spec: JobSpec, job_id: str) -> list[str]:
        """Where the job's output goes: submitit's ``<log_dir>/<job>_0_log.out`` and
        ``.err`` (task 0: the node-rank-0 supervisor and its training process)."""
        folder = os.path.abspath(self._opts(spec).log_dir)
        return [os.path.join(folder, f"{job_id}_0_log.{x}") for x in ("out", "err")]

    # -- queries -----------------------------------------------------------------------

    def _run(
        self, argv: list[str], timeout_s: float = CMD_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        exe = shutil.which(argv[0], path=self._env.get("PATH", os.defpath))
        if exe is None:
            raise FileNotFoundError(argv[0])
        return subprocess.run(
            [exe, *argv[1:]],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=dict(self._env),
        )

    def job_record(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict; empty when unknown or unreachable."""
        jid = validate_job_id(job_id)
        try:
            proc = self._run(["scontrol", "show", "job", "-o", jid])
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("scontrol show job %s failed: %s", jid, exc)
            return {}
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        return parse_job_record(lines[0]) if proc.returncode == 0 and lines else {}

    def end_time(self, job_id: str) -> dt.datetime | None:
        """The job's end time (aware UTC) from ``squeue -o %e``, else ``scontrol show job``."""
        jid = validate_job_id(job_id)
        try:
            proc = self._run(["squeue", "-h", "-t", "all", "-j", jid, "-o", "%e"])
            if proc.returncode == 0 and proc.stdout.strip():
                end: dt.datetime | None = parse_slurm_time(proc.stdout.splitlines()[0])
                return end
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("squeue for %s failed (%s); trying scontrol", jid, exc)
        fallback: dt.datetime | None = parse_slurm_time(self.job_record(jid).get("EndTime", ""))
        return fallback

    def status(self, job_id: str) -> JobState:
        """Slurm's state of ``job_id``: squeue (recent jobs), then sacct (accounting).

        ``PREEMPTED`` is kept; UNKNOWN when neither knows the job (squeue forgets a job
        ``MinJobAge`` seconds after it ends; sacct needs slurmdbd).
        """
        jid = validate_job_id(job_id)
        for argv in (
            ["squeue", "-h", "-t", "all", "-j", jid, "-o", "%T"],
            ["sacct", "-n", "-X", "-P", "-j", jid, "-o", "State"],
        ):
            try:
                proc = self._run(argv)
            except (OSError, subprocess.TimeoutExpired):
                continue
            words = proc.stdout.split()
            if proc.returncode == 0 and words:
                return map_state(words[0])
        return JobState.UNKNOWN

    def describe(self, job_id: str) -> dict[str, Any]:
        """What ``ckrun status`` shows next to ckrun's own record of the run.

        Returns:
            ``job_id``; ``state`` (a :class:`JobState` value, PREEMPTED kept apart from
            FAILED); and, while Slurm remembers the job (``MinJobAge``), ``slurm_state``,
            ``restarts``, ``reason``, ``time_limit`` and ``end_utc`` (else None).
        """
        jid = validate_job_id(job_id)
        rec = self.job_record(jid)
        return {
            "job_id": jid,
            "state": self.status(jid).value,
            "slurm_state": rec.get("JobState"),
            "restarts": int_or(rec.get("Restarts"), 0) if rec else None,
            "reason": rec.get("Reason"),
            "time_limit": rec.get("TimeLimit"),
            "end_utc": _iso(parse_slurm_time(rec.get("EndTime", ""))),
        }

    def cancel(self, job_id: str) -> None:
        """``scancel JOB``; idempotent (a finished or unknown job is not an error).

        Raises:
            SchedulerError: scancel is missing or failed for another reason.
        """
        jid = validate_job_id(job_id)
        try:
            proc = self._run(["scancel", jid])
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SchedulerError(
                f"scancel {jid} failed: {exc}; is this a Slurm login node?"
            ) from exc
        err = (proc.stderr or "").lower()
        if proc.returncode != 0 and not ("invalid job id" in err or "already" in err):
            raise SchedulerError(f"scancel {jid} failed: {proc.stderr.strip()}")

    # -- inside the job ----------------------------------------------------------------

    def current(self) -> JobInfo | None:
        """The job this process runs in (from ``SLURM_*``), or None outside Slurm.

        ``job_id`` is ``ARRAYJOB_TASK`` for array tasks; ``attempt`` is
        ``SLURM_RESTART_COUNT`` (unset on the first run -> 0); ``rank`` is
        ``SLURM_PROCID`` (the node index with one task per node); the end time is read
        with :meth:`end_time` (None when Slurm cannot be asked).

        Raises:
            ConfigError: an odd job id, or :attr:`lead_s` not shorter than the job's
                time limit (:meth:`check_lead_time`).
        """
        env = self._env
        raw = env.get("SLURM_JOB_ID", "").strip()
        if not raw:
            return None
        array_job, array_task = (
            env.get("SLURM_ARRAY_JOB_ID", ""),
            env.get("SLURM_ARRAY_TASK_ID", ""),
        )
        job_id = f"{array_job}_{array_task}" if array_job and array_task else raw
        job_id = validate_job_id(job_id)
        self.check_lead_time(job_id)
        end = self.end_time(job_id)
        detail = {
            "slurm_job_id": raw, "array_job_id": array_job or None,
            "array_task_id": array_task or None, "node": env.get("SLURMD_NODENAME"),
            "nnodes": int_or(env.get("SLURM_NNODES"), 1),
            "partition": env.get("SLURM_JOB_PARTITION"),
            "in_step": "SLURM_STEP_ID" in env, "lead_s": self.lead_s,
        }  # fmt: skip
        return JobInfo(
            backend="slurm",
            job_id=job_id,
            attempt=int_or(env.get("SLURM_RESTART_COUNT"), 0),
            rank=int_or(env.get("SLURM_PROCID"), 0),
            time_limit_end_utc=_iso(end),
            detail=detail,
        )

    def check_lead_time(self, job_id: str) -> None:
        """Refuse to supervise a job whose time limit is not longer than :attr:`lead_s`
        (:func:`~ckrun.scheduler.slurm_jobs.check_lead_time`): the job's ``TimeLimit``
        from ``scontrol show job``; no check when Slurm cannot be asked or the job has
        no limit (``UNLIMITED``).

        Raises:
            ConfigError: ``lead_s`` >= the time limit; names both values and the fix.
        """
        text = self.job_record(job_id).get("TimeLimit", "")
        try:
            limit_s = parse_time_limit_s(text)
        except ConfigError:  # "", UNLIMITED, Partition_Limit: nothing to compare with
            return
        check_lead_time(
            self.lead_s, limit_s, f"the job's TimeLimit={text}",
            f"submit with a --time longer than the lead, or a shorter lead: "
            f"sbatch --signal=B:USR1@LEAD together with {LEAD_ENV}=LEAD (slurm/ckrun.sbatch), "
            "or the slurm profile's lead_s (ckrun submit)",
        )  # fmt: skip

    def notice_sources(self, job: JobInfo | None) -> list[NoticeSource]:
        """The time-limit watcher for ``job`` (fires ``lead_s`` before its end time)."""
        if job is None or job.backend != "slurm":
            return []
        return [TimeLimitWatcher(validate_job_id(job.job_id), self.lead_s, self.end_time)]

    def requeue(self, job: JobInfo) -> RequeueOutcome:
        """``scontrol requeue JOB`` once, from rank 0; other ranks only return REQUEUED.

        Call it only when everything is durable: Slurm sends SIGTERM to the caller about
        13 ms after the command returns (DESIGN.md §6).  The job's record is read first
        (measured on Slurm 22.05): a job Slurm already requeued (a ``PreemptMode=REQUEUE``
        preemption seen after ``GraceTime``: COMPLETING with ``Restarts`` above this
        attempt) counts as requeued without a call; a job being cancelled (``scancel``:
        COMPLETING, ``Reason`` not ``TimeLimit``, or CANCELLED) is *not* requeued,
        because ``scontrol requeue`` would silently undo the user's cancel.

        Raises:
            RequeueError: (exit 6) ``scontrol`` is missing, the job is being cancelled,
                or Slurm refused (e.g. ``--no-requeue``); the message names the fix.
        """
        if job.rank != 0:
            return RequeueOutcome.REQUEUED
        jid = validate_job_id(job.job_id)
        if jid in self._requeued:
            return RequeueOutcome.REQUEUED
        verdict = requeue_verdict(self.job_record(jid), job.attempt)
        if verdict == "cancelled":
            raise RequeueError(
                f"job {jid} is being cancelled (scancel), so ckrun does not requeue it; the "
                "checkpoint is committed: resubmit the same job to resume"
            )
        if verdict != "already":
            msg = scontrol_requeue(self._run, jid)
            if msg is not None and requeue_verdict(self.job_record(jid), job.attempt) != "already":
                raise RequeueError(requeue_fix(jid, msg))
        self._requeued.add(jid)
        return RequeueOutcome.REQUEUED


def _iso(t: dt.datetime | None) -> str | None:
    from ckrun.notices import iso_utc

    return iso_utc(t) if t is not None else None
