"""How an attempt ends, as the machine's events: the child's exit with what storage says,
and the scheduler's answer to a requeue (DESIGN.md §4.5).

When the child's session is empty the supervisor reads the newest commit in the run's
storage and the library's exit-reason record (:func:`ckrun.control_files.read_exit_reason`): it
checks the checkpoint itself instead of taking the child's word.
"""

from __future__ import annotations

from collections.abc import Callable

from ckrun import control_files
from ckrun.errors import CkrunError
from ckrun.runlog import EventLog
from ckrun.scheduler.base import JobInfo, RequeueOutcome, Scheduler
from ckrun.storage.base import Storage
from ckrun.supervisor.messages import ChildExited, Requeued, RequeueResult
from ckrun.supervisor.process import Child
from ckrun.supervisor.rundir import RunDir


def attempt_end(
    child: Child,
    status: int,
    storage: Storage,
    rundir: RunDir,
    events: EventLog,
    now: float,
    monotonic: Callable[[], float],
) -> ChildExited:
    """The :class:`ChildExited` of ``child`` (reaped, its session empty), after the
    ``attempt_end`` event is logged.

    Args:
        child: the reaped child.
        status: its exit status (shell style: ``128 + N`` for signal N).
        storage: the run root's storage (newest commit, completion, this attempt's commits).
        rundir: the run's state directory (the exit-reason record in its control dir).
        events: the run log (its ``attempt`` is the attempt that ended).
        now: monotonic seconds when the end was seen (the attempt's length).
        monotonic: the clock; the event's time is read after the storage reads.
    """
    from ckrun.supervisor.preflight import attempt_commits, is_complete, newest

    step, save_s = newest(storage)
    why = control_files.read_exit_reason(rundir.control_dir) or {}
    events.append(
        "attempt_end",
        status=status,
        seconds=now - child.started,
        commits=attempt_commits(storage, events.attempt),
        reason=why.get("reason"),
    )
    return ChildExited(
        status,
        step,
        is_complete(storage),
        monotonic(),
        save_s,
        reason=str(why["reason"]) if why.get("reason") else None,
        detail=str(why.get("message") or ""),
    )


def requeue(scheduler: Scheduler, job: JobInfo | None, now: float) -> Requeued:
    """Ask ``scheduler`` to requeue ``job``; its answer as :class:`Requeued` at ``now``
    (FAILED with the reason outside a job or when the scheduler refuses)."""
    if job is None:
        return Requeued(RequeueResult.FAILED, "not inside a job of this scheduler", now)
    try:
        out = scheduler.requeue(job)
    except CkrunError as e:
        return Requeued(RequeueResult.FAILED, str(e), now)
    restart = out == RequeueOutcome.RESTART_HERE
    return Requeued(RequeueResult.RESTART_HERE if restart else RequeueResult.REQUEUED, "", now)
