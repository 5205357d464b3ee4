"""``ckrun cancel`` and ``ckrun preempt``: requests to a run's live supervisor (a file in
its state directory, plus SIGUSR2 when it runs on this host), or, without one, the
scheduler's cancel of the run's job.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

from ckrun.cli.locate import locate, scheduler_for
from ckrun.config import is_local_storage
from ckrun.errors import ConfigError, UsageError
from ckrun.notices import iso_utc, utcnow
from ckrun.storage.fsutil import write_json_atomic
from ckrun.supervisor.rundir import CANCEL_REQUEST, PREEMPT_REQUEST, RunDir, read_json


def signal_holder(holder: dict[str, Any]) -> str:
    pid, host = holder.get("pid"), holder.get("host")
    if host == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, signal.SIGUSR2)
            return f"supervisor pid {pid}"
        except ProcessLookupError:
            pass
    return f"supervisor pid {pid} on {host} (it polls the request)"


def cancel(name: str, storage: str | None) -> str:
    """``ckrun cancel``: mark the run cancelled and stop its supervisor or job.

    A run that is complete (``COMPLETE.json``) is left as it is and the message says so.
    """
    rd = locate(name, storage)
    done = final_step(rd)
    if done is not None and rd.live_holder() is None:
        return f"run {name} is complete (final step {done}): nothing to cancel"
    write_json_atomic(
        rd.cancelled_path,
        {"cancelled_utc": iso_utc(utcnow()), "by": f"{socket.gethostname()}:{os.getpid()}"},
    )
    holder = rd.live_holder()
    if holder is not None:
        rd.request(CANCEL_REQUEST, {"requested_utc": iso_utc(utcnow())})
        return f"run {name}: cancel sent to {signal_holder(holder)}; it checkpoints and stops"
    job = read_json(rd.job_json)
    if job and job.get("backend") not in (None, "local"):
        # the profile's options as at submit (e.g. the Kubernetes namespace, Slurm cluster)
        scheduler_for(str(job["backend"]), rd.load_config()).cancel(str(job["job_id"]))
        return f"run {name}: {job['backend']} job {job['job_id']} cancelled"
    return f"run {name}: no live supervisor; marked cancelled (a resubmit clears it)"


def final_step(rd: RunDir) -> int | None:
    """The final step of a complete run (valid ``COMPLETE.json``), else None."""
    from ckrun.checkpoint.discovery import completion
    from ckrun.supervisor.preflight import open_run_storage

    cfg = rd.load_config()
    if cfg is None or not (is_local_storage(cfg.storage) or cfg.storage.startswith("s3://")):
        return None  # pvc:CLAIM is mounted in the pods only: nothing to open here
    marker, _problem = completion(open_run_storage(cfg))
    return None if marker is None else int(marker.final_step)


def preempt(name: str, storage: str | None, lead_s: float | None = None) -> str:
    """``ckrun preempt``: ask the live supervisor for a drill notice.

    Raises:
        UsageError: the run has no live supervisor.
    """
    rd = locate(name, storage)
    holder = rd.live_holder()
    if holder is None:
        raise UsageError(f"run {name!r} has no live supervisor: nothing to preempt")
    body: dict[str, Any] = {"requested_utc": iso_utc(utcnow())}
    if lead_s is not None:
        if lead_s <= 0:
            raise ConfigError("--lead must be > 0 seconds")
        body["lead_s"] = lead_s
    rd.request(PREEMPT_REQUEST, body)
    return f"run {name}: drill notice sent to {signal_holder(holder)}"
