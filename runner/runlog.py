"""The run's event log, ``<state root>/events.jsonl``: one JSON object per line.

Every line has ``utc`` (ISO-8601, ms, ``Z``), ``run``, ``attempt`` and ``kind``; most
also have ``step`` (the checkpoint step the event concerns) and ``seconds`` (a duration).
Kinds written by the supervisor: ``attempt_start``, ``child_exit``, ``notice``,
``forward``, ``escalate``, ``kill``, ``preempted``, ``requeue``, ``failure``, ``backoff``,
``completed``, ``already_complete``, ``incompatible``, ``failed``, ``cancelled``,
``submitted``, ``supervisor_start``, ``supervisor_exit``.

Appends are one ``write(2)`` of a whole line on an ``O_APPEND`` descriptor, so
concurrent writers never interleave within a line; :func:`read_events` skips a torn
last line.  Lines survive a crash of the process at once (page cache); the outcome
kinds in :data:`DURABLE` are also ``fsync``-ed so they survive the loss of the machine
(a spot VM), while routine lines are not, to keep the supervisor's start-up and notice
path free of disk flushes (about 6 ms each here).
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from ckrun.notices import iso_utc, utcnow

#: Event kinds flushed to disk (fsync) when appended.
DURABLE = frozenset(
    {
        "attempt_end",
        "preempted",
        "requeue",
        "completed",
        "failed",
        "cancelled",
        "incompatible",
        "already_complete",
        "requeue_failed",
        "submitted",
        "supervisor_exit",
    }
)


class EventLog:
    """Appends events of one run.

    Args:
        path: the ``events.jsonl`` file (its directory is created).
        run: run name stamped on every line.
        attempt: initial attempt number stamped on lines (update :attr:`attempt`).
        fallback: when given, a line that cannot be written (full disk, read-only or
            lost state directory) goes to this stream instead of raising, with one
            warning (the supervisor's bookkeeping never crashes the supervisor).
    """

    def __init__(
        self, path: str, run: str, attempt: int = 0, *, fallback: IO[str] | None = None
    ) -> None:
        self.path = path
        self.run = run
        self.attempt = attempt
        self.fallback = fallback
        self.failed: OSError | None = None
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        except OSError:
            if fallback is None:
                raise

    def append(
        self,
        kind: str,
        *,
        step: int | None = None,
        seconds: float | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Append one event (fsync-ed when its kind is in :data:`DURABLE`) and return it.

        Raises:
            OSError: when the state directory cannot be written.
        """
        body: dict[str, Any] = {
            "utc": iso_utc(utcnow()),
            "run": self.run,
            "attempt": self.attempt,
            "kind": kind,
        }
        if step is not None:
            body["step"] = step
        if seconds is not None:
            body["seconds"] = round(seconds, 6)
        body.update(fields)
        line = (json.dumps(body, sort_keys=False, default=str) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                if kind in DURABLE:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            if self.fallback is None:
                raise
            if self.failed is None:
                print(
                    f"[ckrun] warning: cannot append to {self.path} ({e.strerror}); "
                    "events go to stderr until it is writable again",
                    file=self.fallback,
                    flush=True,
                )
            self.failed = e
            self.fallback.write("[ckrun] event " + line.decode())
            self.fallback.flush()
        return body


def read_events(path: str) -> list[dict[str, Any]]:
    """All events of ``path`` in order; [] when absent; a torn or bad line is skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out
