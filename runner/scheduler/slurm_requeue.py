"""Requeueing a Slurm job from inside it: when ``scontrol requeue`` is called, what a job
record says about a requeue already done or a cancel under way, and the message naming
the fix when Slurm refuses (measured on Slurm 22.05, DESIGN.md §6).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping

from ckrun.errors import RequeueError

#: seconds a Slurm client command may take before ckrun gives up on it.
CMD_TIMEOUT_S = 60.0

#: runs a Slurm client command (argv) and returns its completed process.
Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def int_or(value: str | None, default: int) -> int:
    """``int(value)``, or ``default`` when ``value`` is empty or not a whole number."""
    try:
        return int(value) if value else default
    except ValueError:
        return default


def requeue_verdict(rec: Mapping[str, str], attempt: int) -> str:
    """What ``scontrol show job`` record ``rec`` says for a requeue from ``attempt``:
    ``already`` (Slurm requeued it: a ``PreemptMode=REQUEUE`` preemption seen after
    ``GraceTime`` is COMPLETING with ``Restarts`` above this attempt), ``cancelled``
    (``scancel``: COMPLETING with a ``Reason`` other than ``TimeLimit``, or CANCELLED;
    ``scontrol requeue`` would silently undo the user's cancel), else ``requeue``."""
    state, restarts = rec.get("JobState", ""), int_or(rec.get("Restarts"), 0)
    if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        return "already"
    if state == "COMPLETING" and restarts > attempt:
        return "already"
    if state == "CANCELLED" or (state == "COMPLETING" and rec.get("Reason") != "TimeLimit"):
        return "cancelled"
    return "requeue"


def scontrol_requeue(run: Runner, jid: str) -> str | None:
    """Run ``scontrol requeue JID`` through ``run``; None on success, else Slurm's message.

    Raises:
        RequeueError: ``scontrol`` is missing or does not answer in ``CMD_TIMEOUT_S``.
    """
    try:
        proc = run(["scontrol", "requeue", jid])
    except FileNotFoundError as exc:
        raise RequeueError(
            f"scontrol not found on PATH, so job {jid} cannot requeue itself (a "
            "container without Slurm's client tools?): bind-mount scontrol, slurm.conf "
            "and the munge socket into the container, or run `ckrun run` outside it; "
            f"the checkpoint is committed, `scontrol requeue {jid}` resumes it"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise RequeueError(
            f"scontrol requeue {jid} did not answer in {CMD_TIMEOUT_S:.0f} s (slurmctld "
            f"down?); the checkpoint is committed, run `scontrol requeue {jid}` later"
        ) from exc
    if proc.returncode == 0:
        return None
    return (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}"


def requeue_fix(jid: str, msg: str) -> str:
    """The RequeueError message for Slurm's refusal ``msg``: the problem and the fix."""
    low = msg.lower()
    if "disabled" in low:
        fix = (
            "the job is not requeueable (--no-requeue, or JobRequeue=0 without --requeue): "
            "submit with `#SBATCH --requeue` (ckrun's profile sets requeue: true)"
        )
    elif "access" in low or "permission" in low:
        fix = "this user may not requeue the job; ask the site to allow it or run as its owner"
    elif "finished" in low or "invalid job id" in low or "completed" in low:
        fix = "the job already ended (cancelled?); resubmit the same script to resume"
    else:
        fix = "check `scontrol show job` and the slurmctld log"
    return (
        f"scontrol requeue {jid} refused: {msg or 'no message'}; {fix}. The checkpoint is "
        "committed: resubmitting the same job resumes from it"
    )
