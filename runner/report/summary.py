"""The ``ckrun status`` record of a run directory: state, attempts, accounting (numbers).

Every quantity in the record is a number (seconds, steps, ratios, epoch-relative
offsets) or a name (state, outcome, source); sentences are made by the renderers
(:mod:`.terminal`, :mod:`.timeline_html`).  Offsets (``*_at_s``) are seconds from the
run's start (:attr:`ckrun.report.goodput.Accounting.start`, given as ``start_utc``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ckrun.notices import iso_utc, utcnow
from ckrun.report import goodput
from ckrun.report.history import Commit, History, parse
from ckrun.report.lease_view import lease_view
from ckrun.report.stored import StoredRunDir, merge_events, run_storage, stored_events
from ckrun.runlog import read_events
from ckrun.supervisor.rundir import RunDir, read_json


def newest_step(rd: RunDir, default: int | None) -> int | None:
    """The newest committed step in the run's storage (``default`` when unreadable)."""
    from ckrun.errors import CkrunError
    from ckrun.supervisor.preflight import newest_step as newest

    try:
        st = run_storage(rd)
        if st is None:
            return default
        known = [x for x in (newest(st), default) if x is not None]
    except (CkrunError, OSError):
        return default
    return max(known) if known else None


def is_complete(rd: RunDir) -> bool:
    """True when the run's storage holds a valid ``COMPLETE.json``."""
    from ckrun.errors import CkrunError
    from ckrun.supervisor.preflight import is_complete as complete

    try:
        st = run_storage(rd)
        return st is not None and complete(st)
    except (CkrunError, OSError):
        return False


def scheduler_view(rd: RunDir) -> dict[str, Any] | None:
    """The scheduler's own record of a submitted job (Slurm: squeue/sacct state with
    PREEMPTED kept apart from FAILED, restarts, reason; Kubernetes: Job conditions and
    each pod's phase and exit code), or None for a local run.  A scheduler that cannot
    be asked (no ``squeue``, no API server) gives ``{"backend", "job_id", "error"}``:
    ``ckrun status`` never fails on it."""
    from ckrun.errors import CkrunError
    from ckrun.scheduler.base import get_scheduler

    job = read_json(rd.job_json)
    if not job or job.get("backend") in (None, "local") or not job.get("job_id"):
        return None
    backend, job_id = str(job["backend"]), str(job["job_id"])
    try:
        sched: Any = get_scheduler(backend)
        view = (
            sched.describe(job_id)
            if hasattr(sched, "describe")
            else {"state": sched.status(job_id).value}
        )
    except (CkrunError, OSError, ImportError, RuntimeError, ValueError) as e:
        return {"backend": backend, "job_id": job_id, "error": str(e)}
    return {"backend": backend, "job_id": job_id, **dict(view)}


def interval_numbers(state_root: str) -> dict[str, Any]:
    """The interval ``checkpoint_every="auto"`` would pick, as numbers
    (:class:`ckrun.checkpoint.interval.IntervalEstimate`'s fields); ``{"error": ...}``
    when ``CKRUN_MTBI_S`` is invalid."""
    from ckrun.checkpoint.interval import from_history
    from ckrun.errors import ConfigError

    try:
        est = from_history(state_root)
    except ConfigError as e:
        return {"error": str(e)}
    return {
        "interval_s": round(est.interval_s, 3),
        "save_cost_s": est.save_cost_s,
        "mtbi_s": round(est.mtbi_s, 3),
        "mtbi_source": est.mtbi_source,
        "interruptions": est.interruptions,
        "exposure_s": round(est.exposure_s, 3),
        "expected_goodput": None if est.goodput is None else round(est.goodput, 4),
    }


def supervisor_died(events: list[dict[str, Any]]) -> bool:
    """True when the last supervisor left no ``supervisor_exit`` record (killed: SIGKILL,
    OOM killer, lost node); only meaningful when no live supervisor holds the run."""
    starts = [i for i, e in enumerate(events) if e.get("kind") == "supervisor_start"]
    return bool(starts) and not any(
        e.get("kind") == "supervisor_exit" for e in events[starts[-1] :]
    )


def _state(rd: RunDir, h: History, events: list[dict[str, Any]], live: bool) -> str:
    if live:
        spawns = [i for i, e in enumerate(events) if e.get("kind") == "spawn"]
        tail = events[spawns[-1] :] if spawns else []
        return "DRAINING" if any(e.get("kind") == "notice" for e in tail) else "RUNNING"
    if supervisor_died(events):
        return "SUPERVISOR_DIED"
    if h.final_state == "ALREADY_COMPLETE":  # a re-submit found it done: still done
        return "COMPLETED"
    if h.final_state is not None:
        return str(h.final_state)
    return "SUBMITTED" if h.submitted is not None else "NEW"


def _r(x: float) -> float:
    return round(x, 3)


def summarize(rd: RunDir, now: dt.datetime | None = None) -> dict[str, Any]:
    """The run's state and accounting (see :mod:`ckrun.report.goodput` for the
    definitions); ``useful_s`` is the productive time (its former name).  The history is
    this machine's events merged with those the run's storage keeps
    (:mod:`ckrun.report.stored`); ``lease`` is :func:`ckrun.report.lease_view.lease_view`
    (None when the run has no lease or its storage is unknown)."""
    storage = run_storage(rd)
    events = merge_events(read_events(rd.events_path), stored_events(storage))
    located = rd.load_config() if isinstance(rd, StoredRunDir) else None
    cfg = read_json(rd.run_json) or (located.to_json() if located else {})
    holder = rd.live_holder()
    t_now = (now or utcnow()).timestamp()
    h = parse(events)
    live = holder is not None
    if not live:  # a dead supervisor's running attempt ended when its events stopped
        for a in h.attempts:
            if a.end is None:
                a.end = max([a.spawn, *(s.end for s in a.saves), *(a.train_start or a.spawn,)])
                a.outcome = "lost" if a.outcome == "running" else a.outcome
                if not a.commits:  # no attempt_end: a synchronous save that returned
                    # committed (its child may outlive a SIGKILLed supervisor and save)
                    a.commits = [
                        Commit(s.step, s.end, s.stall_s) for s in a.saves if s.mode == "sync"
                    ]
    state = _state(rd, h, events, live)
    steps = [c.step for a in h.attempts for c in a.commits]
    newest = newest_step(rd, max(steps) if steps else None)
    acc = goodput.account(h, t_now, newest)
    tot = acc.totals
    attempts: list[dict[str, Any]] = []
    for a, aa in zip(h.attempts, acc.attempts, strict=True):
        attempts.append(
            {
                "attempt": a.attempt,
                "outcome": a.outcome,
                "status": a.status,
                "start_at_s": _r(a.spawn - acc.start),
                "end_at_s": _r((a.end if a.end is not None else t_now) - acc.start),
                "resume_step": a.resume,
                "kept_step": aa.kept if aa.kept >= 0 else None,
                "saved_step": aa.reached,
                "lost_steps": aa.lost_steps,
                "lost_steps_estimated": aa.lost_estimated,
                "measured": aa.measured,
                **{f"{c}_s": _r(aa.seconds(c)) for c in goodput.CATEGORIES if c != "waiting"},
                "segments": [
                    [s.category, _r(s.start - acc.start), _r(s.end - acc.start)]
                    for s in aa.segments
                ],
                "commits": [
                    {"step": c.step, "at_s": _r(c.committed - acc.start), "save_s": c.save_s}
                    for c in a.commits
                ],
            }
        )
    interruptions = [
        {
            "attempt": x["attempt"],
            "interruption": "preemption" if x["outcome"] == "preempted" else "failure",
            "status": x["status"],
            "lost_s": _r(x["lost_s"] + x["shutdown_s"]),
            "lost_training_s": x["lost_s"],
            "lost_steps": x["lost_steps"],
        }
        for x in attempts
        if x["outcome"] in ("preempted", "failure", "failed", "lost")
    ]
    return {
        "run": cfg.get("run", ""),
        "state": state,
        "live": live,
        "supervisor": holder,
        "exit_code": None if state == "SUPERVISOR_DIED" else h.exit_code,
        "command": cfg.get("command"),
        "start_utc": iso_utc(dt.datetime.fromtimestamp(acc.start, dt.timezone.utc)),
        "attempts": len(h.attempts),
        "preemptions": sum(x["outcome"] == "preempted" for x in attempts),
        "failures": sum(x["outcome"] in ("failure", "failed") for x in attempts),
        "last_committed_step": newest,
        "complete": is_complete(rd),
        "wall_s": _r(acc.wall_s),
        "productive_s": _r(tot["productive"]),
        "useful_s": _r(tot["productive"]),
        "saving_s": _r(tot["saving"]),
        "goodput": round(acc.goodput, 4) if acc.goodput is not None else None,
        "overheads_s": {c: _r(tot[c]) for c in goodput.CATEGORIES if c != "productive"},
        "productive_steps": acc.productive_steps,
        "lost_steps": acc.lost_steps,
        "attempt_detail": attempts,
        "interruptions": interruptions,
        "notices": [
            {
                "attempt": n.attempt,
                "at_s": _r(n.at - acc.start),
                "source": n.source,
                "kind": n.kind,
                "lead_s": n.lead_s,
            }
            for n in h.notices
        ],
        "requeue_refusals": [
            {"attempt": a, "at_s": _r(t - acc.start)} for t, a, _m in h.requeue_refusals
        ],
        "lease": None if storage is None else lease_view(storage),
        "scheduler": scheduler_view(rd),
        "interval": interval_numbers(rd.root),
    }
