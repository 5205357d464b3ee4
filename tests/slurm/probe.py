"""A stand-in for ``ckrun run`` inside a real Slurm job: exercises the Slurm backend alone.

Invoked exactly as the rendered script / ckrun.sbatch invoke the supervisor
(``probe.py run --run NAME --storage DIR -- CMD...``), it records what
``SlurmScheduler.current()`` sees and, per ``PROBE_MODE``, waits for the time-limit
watcher and/or requeues the job, writing ``DIR/NAME/attempt-<n>.json`` (fsynced).

PROBE_MODE: ``record`` (just record), ``requeue`` (attempt 0 requeues itself),
``watch_requeue`` (attempt 0 waits for the watcher's notice, then requeues),
``requeue_task1`` (only array task 1 requeues, on attempt 0).
"""

from __future__ import annotations

import signal
import time

_signals: list[tuple[str, float]] = []


def _on_signal(signum: int, frame: object) -> None:
    _signals.append((signal.Signals(signum).name, time.monotonic()))


# First, as ckrun run does (ckrun.notice_hold): a signal during the imports is recorded.
for _sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_sig, _on_signal)

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from ckrun.errors import RequeueError  # noqa: E402
from ckrun.notices import iso_utc, utcnow  # noqa: E402
from ckrun.scheduler.slurm import SlurmScheduler  # noqa: E402


def _write(path: str, body: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    run = argv[argv.index("--run") + 1]
    root = os.path.join(argv[argv.index("--storage") + 1], run)
    os.makedirs(root, exist_ok=True)
    mode = os.environ.get("PROBE_MODE", "record")
    sched = SlurmScheduler()
    job = sched.current()
    assert job is not None, "probe must run inside a Slurm job"
    out: dict[str, Any] = {
        "job": {"job_id": job.job_id, "attempt": job.attempt, "rank": job.rank,
                "end": job.time_limit_end_utc, "detail": job.detail},
        "started_utc": iso_utc(utcnow()), "mode": mode, "lead_s": sched.lead_s,
        "command": argv[argv.index("--") + 1:],
    }  # fmt: skip
    print(f"probe attempt {job.attempt} of {job.job_id} rank {job.rank}", flush=True)
    path = os.path.join(root, f"attempt-{job.attempt}.json")
    requeue = job.attempt == 0 and (
        mode in ("requeue", "watch_requeue")
        or (mode == "requeue_task1" and job.detail.get("array_task_id") == "1")
    )
    if mode == "watch_requeue" and job.attempt == 0:
        (watcher,) = sched.notice_sources(job)
        t0 = time.monotonic()
        notice = None
        while notice is None and time.monotonic() - t0 < 90:
            notice = watcher.poll()
            time.sleep(0.1)
        watcher.close()
        out["notice"] = notice.to_json() if notice else None
    if requeue:
        try:
            t_call = time.monotonic()
            outcome = sched.requeue(job)
            t_ret = time.monotonic()
            out.update(requeue=outcome.value, requeue_call_s=t_ret - t_call)
            _write(path, out)  # durable before the SIGTERM that follows the requeue
            deadline = time.monotonic() + 20
            while not any(n == "SIGTERM" for n, _ in _signals) and time.monotonic() < deadline:
                time.sleep(0.001)
            term = [t for n, t in _signals if n == "SIGTERM"]
            out["sigterm_after_return_s"] = term[0] - t_ret if term else None
        except RequeueError as exc:
            out.update(requeue_error=str(exc), exit_code=int(exc.exit_code))
            _write(path, out)
            return int(exc.exit_code)
    out["signals"] = [n for n, _ in _signals]
    _write(path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
