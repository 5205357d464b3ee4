"""``ckrun status``: the story of a run, from ``events.jsonl`` and the manifests.

Definitions (all durations in seconds, wall clock from the UTC stamps of the events):

* **wall**: from the first attempt's spawn to the end of the last attempt (now, while a
  child runs).  Restart gaps, backoff and queueing between attempts are included.
* **saving**: the save durations (``save_duration_s`` of the manifests) of every
  checkpoint the attempts committed, as recorded when each attempt ended.
* **useful** training time of an attempt: from its spawn to the commit of the last
  checkpoint it wrote, minus its saving time.  Work after an attempt's last commit is
  lost; an attempt that committed nothing contributes nothing.  Start-up and restore
  inside an attempt cannot be told apart from training and count as useful.
* **goodput** = useful / wall, in [0, 1] (the fraction of wall time that produced
  training progress that survived).
* **lost** per interruption (preemption or failure): seconds from the attempt's last
  commit (or its spawn) to its end; lost steps are 0 when the notice's checkpoint was
  committed, otherwise estimated from the attempt's step rate (None when unknown).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ckrun.checkpoint.interval import status_line
from ckrun.notices import parse_utc, utcnow
from ckrun.runlog import read_events
from ckrun.supervisor.rundir import RunDir, read_json


def locate(name: str, storage: str | None) -> RunDir:
    """The state directory of run ``name`` (see :func:`ckrun.cli.commands.locate`)."""
    from ckrun.cli.commands import locate as _locate

    return _locate(name, storage)


def _t(ev: dict[str, Any]) -> dt.datetime:
    t: dt.datetime = parse_utc(str(ev["utc"]))
    return t


def _attempts(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per spawned attempt: spawn/end times, commits, status, resume step."""
    out: dict[int, dict[str, Any]] = {}
    for ev in evs:
        a, kind = int(ev.get("attempt", 0)), ev.get("kind")
        if kind == "spawn":
            out[a] = {
                "attempt": a,
                "spawn": _t(ev),
                "end": None,
                "commits": [],
                "status": None,
                "resume": None,
                "interruption": None,
            }
        elif a not in out:
            continue
        elif kind == "attempt_start":
            out[a]["resume"] = ev.get("step")
        elif kind == "attempt_end":
            out[a].update(end=_t(ev), status=ev.get("status"), commits=ev.get("commits") or [])
        elif kind in ("preempted", "backoff", "failed") and out[a]["interruption"] is None:
            out[a]["interruption"] = "preemption" if kind == "preempted" else "failure"
            out[a]["new_checkpoint"] = bool(ev.get("new_checkpoint"))
    return [out[k] for k in sorted(out)]


def _account(rec: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    end = rec["end"] or now
    commits = rec["commits"]
    saving = sum(float(c.get("save_s") or 0.0) for c in commits)
    if commits:
        last = max(commits, key=lambda c: c["step"])
        t_last = parse_utc(str(last["committed_utc"]))
        useful = max(0.0, (t_last - rec["spawn"]).total_seconds() - saving)
        gained = int(last["step"]) - int(rec["resume"] or 0)
    else:
        t_last, useful, gained = rec["spawn"], 0.0, 0
    lost_s = max(0.0, (end - t_last).total_seconds())
    lost_steps: float | None = None
    if rec["interruption"] == "preemption" and rec.get("new_checkpoint"):
        lost_steps = 0
    elif useful > 0 and gained > 0:
        lost_steps = round(lost_s * gained / useful, 1)
    return {
        "attempt": rec["attempt"],
        "status": rec["status"],
        "saving_s": saving,
        "useful_s": useful,
        "lost_s": lost_s,
        "lost_steps": lost_steps,
        "interruption": rec["interruption"],
        "wall_s": (end - rec["spawn"]).total_seconds(),
    }


def _newest(rd: RunDir, default: int | None) -> int | None:
    from ckrun.supervisor.preflight import newest_step, open_run_storage

    cfg = rd.load_config()
    if cfg is None:
        return default
    known = [x for x in (newest_step(open_run_storage(cfg)), default) if x is not None]
    return max(known) if known else None


def _complete(rd: RunDir) -> bool:
    from ckrun.supervisor.preflight import is_complete, open_run_storage

    cfg = rd.load_config()
    return cfg is not None and is_complete(open_run_storage(cfg))


def _owner(rd: RunDir) -> dict[str, Any] | None:
    """The run's lease holder from its storage (any machine), or None when not held."""
    from ckrun.checkpoint.lease import read_lease
    from ckrun.errors import CkrunError
    from ckrun.supervisor.preflight import open_run_storage

    cfg = rd.load_config()
    if cfg is None:
        return None
    try:
        cur = read_lease(open_run_storage(cfg))
    except CkrunError as e:
        return {"error": str(e)}
    if cur is None or cur[0].holder is None:
        return None
    rec = cur[0]
    assert rec.holder is not None
    return {
        "holder": rec.holder.describe(),
        "epoch": rec.epoch,
        "renewed_utc": rec.renewed_utc,
        "expires_utc": rec.expires_utc,
    }


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


def summarize(rd: RunDir) -> dict[str, Any]:
    """The run's state and accounting (see the module docstring for the definitions)."""
    evs = read_events(rd.events_path)
    cfg = read_json(rd.run_json) or {}
    holder = rd.live_holder()
    now = utcnow()
    recs = _attempts(evs)
    acc = [_account(r, now) for r in recs]
    last_exit = next((e for e in reversed(evs) if e.get("kind") == "supervisor_exit"), None)
    if holder is not None:
        spawns = [i for i, e in enumerate(evs) if e.get("kind") == "spawn"]
        draining = any(e.get("kind") == "notice" for e in evs[spawns[-1] :]) if spawns else False
        state = "DRAINING" if draining else "RUNNING"
    elif last_exit is not None:
        state = str(last_exit.get("state"))
    else:
        state = "SUBMITTED" if any(e.get("kind") == "submitted" for e in evs) else "NEW"
    steps = [c["step"] for r in recs for c in r["commits"]]
    wall = ((recs[-1]["end"] or now) - recs[0]["spawn"]).total_seconds() if recs else 0.0
    useful = sum(a["useful_s"] for a in acc)
    return {
        "run": cfg.get("run", ""),
        "state": state,
        "live": holder is not None,
        "supervisor": holder,
        "exit_code": last_exit.get("exit_code") if last_exit else None,
        "command": cfg.get("command"),
        "attempts": len(recs),
        "preemptions": sum(a["interruption"] == "preemption" for a in acc),
        "failures": sum(a["interruption"] == "failure" for a in acc),
        "last_committed_step": _newest(rd, max(steps) if steps else None),
        "complete": _complete(rd),
        "wall_s": round(wall, 3),
        "useful_s": round(useful, 3),
        "saving_s": round(sum(a["saving_s"] for a in acc), 3),
        "goodput": round(useful / wall, 4) if wall > 0 else None,
        "interruptions": [
            {k: a[k] for k in ("attempt", "interruption", "status", "lost_s", "lost_steps")}
            for a in acc
            if a["interruption"]
        ],
        "scheduler": scheduler_view(rd),
        "owner": _owner(rd),
        "interval": status_line(rd.root),
    }


def render(s: dict[str, Any]) -> str:
    """Human-readable form of :func:`summarize`."""
    sup = s.get("supervisor") or {}
    live = f" (supervisor pid {sup.get('pid')} on {sup.get('host')})" if s["live"] else ""
    gp = f"{100 * s['goodput']:.1f}%" if s["goodput"] is not None else "n/a"
    marker = ", COMPLETE.json present" if s["complete"] else ""
    lines = [
        f"run {s['run']}: {s['state']}{live}{marker}",
        f"  attempts {s['attempts']}, preemptions {s['preemptions']}, "
        f"failures {s['failures']}, last committed step {s['last_committed_step']}",
        f"  wall {s['wall_s']:.1f} s, useful {s['useful_s']:.1f} s, "
        f"saving {s['saving_s']:.2f} s, goodput {gp}",
    ]
    owner = s.get("owner")
    if owner:
        lines.append(
            f"  owner: {owner['holder']} (lease epoch {owner['epoch']}, renewed "
            f"{owner['renewed_utc']}, expires ~{owner['expires_utc']} by its clock)"
            if "holder" in owner
            else f"  owner: unknown ({owner['error']})"
        )
    if s.get("interval"):
        lines.append("  " + s["interval"])
    job = s.get("scheduler")
    if job:
        extra = job.get("error") or ", ".join(
            f"{k} {v}"
            for k, v in job.items()
            if k not in ("backend", "job_id")
            and v not in (None, "", [], {})
            and not isinstance(v, (dict, list))
        )
        lines.append(f"  {job['backend']} job {job['job_id']}: {extra}")
    for i in s["interruptions"]:
        steps = "?" if i["lost_steps"] is None else f"{i['lost_steps']:g}"
        lines.append(
            f"  attempt {i['attempt']}: {i['interruption']} (status {i['status']}), "
            f"lost {i['lost_s']:.1f} s / {steps} steps"
        )
    return "\n".join(lines)
