"""The run's event log, ``<state root>/events.jsonl``: one JSON object per line.

Every line has ``utc`` (ISO-8601, ms, ``Z``), ``run``, ``attempt`` and ``kind``; most
also have ``step`` (the checkpoint step the event concerns) and ``seconds`` (a duration).
Kinds written by the supervisor: ``attempt_start``, ``child_exit``, ``notice``,
``forward``, ``escalate``, ``kill``, ``preempted``, ``requeue``, ``failure``, ``backoff``,
``completed``, ``already_complete``, ``incompatible``, ``failed``, ``cancelled``,
``submitted``, ``supervisor_start``, ``supervisor_exit``.

Kinds written by the training process itself (:func:`child_event`, global rank 0 only,
through the library; they let ``ckrun status`` split an attempt into start-up, restore,
training and saving):

* ``restore``: ``Checkpointer.load`` returned; ``step`` restored (absent: nothing to
  resume), ``seconds`` it took.  Its ``utc`` is the start of training.
* ``train_start``: the first step boundary (:func:`ckrun.preemption_requested`) of a
  process that never called ``load``; its ``utc`` is the start of training.
* ``save``: a checkpoint of ``step`` left the training loop's way: ``seconds`` is the
  stall (the time the loop was blocked: the whole save, or an ``async_save``'s snapshot),
  ``mode`` ``sync``/``async``, ``ckpt_kind`` recovery/milestone/final.  Its ``utc`` is the
  end of the stall; the state saved is the one at ``utc - seconds``.

Appends are one ``write(2)`` of a whole line on an ``O_APPEND`` descriptor, so
concurrent writers never interleave within a line; :func:`read_events` skips a torn
last line.  Lines survive a crash of the process at once (page cache); the outcome
kinds in :data:`DURABLE` are also ``fsync``-ed so they survive the loss of the machine
(a spot VM), while routine lines are not, to keep the supervisor's start-up and notice
path free of disk flushes (about 6 ms each here).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
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
        self,
        path: str,
        run: str,
        attempt: int = 0,
        *,
        fallback: IO[str] | io.TextIOBase | None = None,
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


def child_events_path(env: Mapping[str, str] | None = None) -> str | None:
    """The run's ``events.jsonl`` as seen from the training process: the state root is
    the parent of ``CKRUN_CONTROL_DIR`` (``<state root>/control[/rankN]``, see
    :class:`ckrun.supervisor.rundir.RunDir`); None outside the supervisor."""
    env = os.environ if env is None else env
    cdir = env.get("CKRUN_CONTROL_DIR")
    if not cdir:
        return None
    cdir = os.path.normpath(cdir)
    if os.path.basename(cdir).startswith("rank"):
        cdir = os.path.dirname(cdir)
    return os.path.join(os.path.dirname(cdir), "events.jsonl")


def child_event(
    kind: str, *, step: int | None = None, seconds: float | None = None, **fields: Any
) -> dict[str, Any] | None:
    """Append one event of the training process (see the module docstring) to the run's
    log, stamped with ``CKRUN_RUN`` and ``CKRUN_ATTEMPT``.

    Only the global rank 0 process (``RANK`` unset or 0) under the supervisor writes; a
    log that cannot be written is ignored (the report loses a detail, training goes on).

    Returns:
        The event written, or None when nothing was written.
    """
    path = child_events_path()
    if path is None or os.environ.get("RANK", "0") not in ("", "0"):
        return None
    try:
        attempt = int(os.environ.get("CKRUN_ATTEMPT", "0"))
    except ValueError:
        attempt = 0
    try:
        log = EventLog(path, os.environ.get("CKRUN_RUN", ""), attempt)
        return log.append(kind, step=step, seconds=seconds, pid=os.getpid(), **fields)
    except OSError:
        return None


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
