"""The attempts of a run, as the event log (:mod:`ckrun.runlog`) tells them.

All times are epoch seconds (UTC stamps of the events), all durations seconds.  The
supervisor writes ``spawn``, ``attempt_start``, ``notice``, ``attempt_end`` (with the
checkpoints the attempt committed), ``preempted``, ``backoff``, ``failed``, ``requeue``,
``requeue_failed``, ``completed``, ``cancelled``, ``submitted`` and ``supervisor_exit``;
the training process writes ``restore``, ``train_start`` and ``save``.  A log written
before the training process reported anything (or by a child that does not use ckrun's
library) simply lacks those: :attr:`Attempt.measured` is then False.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckrun.notices import parse_utc


def stamp(ev: dict[str, Any]) -> float | None:
    """The event's ``utc`` as epoch seconds, or None when absent or malformed."""
    try:
        return float(parse_utc(str(ev["utc"])).timestamp())
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Save:
    """A save as the training loop saw it: it was blocked ``stall_s`` seconds, ending
    at ``end``; the state saved is the one at ``end - stall_s``."""

    step: int
    end: float
    stall_s: float
    mode: str = "sync"

    @property
    def start(self) -> float:
        """When the loop stopped for the save (epoch seconds)."""
        return self.end - self.stall_s


@dataclass(frozen=True)
class Commit:
    """A checkpoint committed by an attempt (from its ``attempt_end`` record)."""

    step: int
    committed: float
    save_s: float
    kind: str = "recovery"


@dataclass(frozen=True)
class NoticeMark:
    """A notice the supervisor received: when, from where, of what kind, with how many
    seconds until its deadline (the lead time it granted)."""

    at: float
    attempt: int
    source: str
    kind: str
    lead_s: float | None


@dataclass
class Attempt:
    """One spawned attempt.

    Attributes:
        attempt: its number.
        spawn: when the supervisor started the child.
        end: when the child (and its session) was gone; None while it runs.
        status: the child's exit status.
        resume: the checkpoint step it resumed from (None: fresh start).
        train_start: when it started training (``restore`` or ``train_start`` event).
        restore_s: how long ``Checkpointer.load`` took.
        saves: what the training loop reported of its saves.
        commits: checkpoints it committed.
        outcome: ``running``, ``preempted``, ``failure``, ``completed``, ``cancelled``,
            ``requeue_failed``, ``failed`` (gave up) or ``ended``.
        new_checkpoint: for a preemption, whether its notice checkpoint committed.
    """

    attempt: int
    spawn: float
    end: float | None = None
    status: int | None = None
    resume: int | None = None
    train_start: float | None = None
    restore_s: float | None = None
    saves: list[Save] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    outcome: str = "running"
    new_checkpoint: bool | None = None

    @property
    def measured(self) -> bool:
        """True when the training process reported its training start."""
        return self.train_start is not None


@dataclass
class History:
    """A run's attempts, notices and the supervisor's last word.

    Attributes:
        attempts: in order of their numbers.
        notices: every notice received.
        submitted: when the run was handed to a scheduler (None: run in the foreground).
        final_state: the ``state`` of the last ``supervisor_exit`` (None: none yet).
        exit_code: its exit code.
        requeue_refusals: ``(time, attempt, message)`` of each refused requeue.
    """

    attempts: list[Attempt] = field(default_factory=list)
    notices: list[NoticeMark] = field(default_factory=list)
    submitted: float | None = None
    final_state: str | None = None
    exit_code: int | None = None
    requeue_refusals: list[tuple[float, int, str]] = field(default_factory=list)


_OUTCOME = {
    "preempted": "preempted",
    "backoff": "failure",
    "failed": "failed",
    "completed": "completed",
    "already_complete": "completed",
    "cancelled": "cancelled",
    "requeue_failed": "requeue_failed",
}


def _commits(raw: Any) -> list[Commit]:
    out = []
    for c in raw or []:
        t = stamp({"utc": c.get("committed_utc")}) if isinstance(c, dict) else None
        if t is None or not isinstance(c.get("step"), int):
            continue
        out.append(Commit(int(c["step"]), t, float(c.get("save_s") or 0.0), str(c.get("kind"))))
    return sorted(out, key=lambda c: c.step)


def parse(events: list[dict[str, Any]]) -> History:
    """Build the :class:`History` of a run from its events (see the module docstring);
    events with a bad stamp are ignored."""
    h = History()
    by: dict[int, Attempt] = {}
    for ev in events:
        t = stamp(ev)
        if t is None:
            continue
        kind = ev.get("kind")
        try:
            n = int(ev.get("attempt", 0))
        except (TypeError, ValueError):
            continue
        if kind == "submitted":
            h.submitted = t if h.submitted is None else h.submitted
        elif kind == "supervisor_exit":
            h.final_state, h.exit_code = ev.get("state"), ev.get("exit_code")
        if kind == "spawn":
            by[n] = Attempt(n, t)
            continue
        a = by.get(n)
        if kind == "notice":
            lead = ev.get("seconds_left")
            h.notices.append(
                NoticeMark(
                    t,
                    n,
                    str(ev.get("source") or "?"),
                    str(ev.get("notice_kind") or "notice"),
                    float(lead) if isinstance(lead, (int, float)) else None,
                )
            )
        if kind == "requeue_failed":
            h.requeue_refusals.append((t, n, str(ev.get("message") or "")))
        if a is None:
            continue
        if kind == "attempt_start" and isinstance(ev.get("step"), int):
            a.resume = int(ev["step"])
        elif kind == "restore":
            a.train_start = t if a.train_start is None else a.train_start
            if isinstance(ev.get("seconds"), (int, float)):
                a.restore_s = float(ev["seconds"])
            if isinstance(ev.get("step"), int):
                a.resume = int(ev["step"])
        elif kind == "train_start":
            a.train_start = t if a.train_start is None else a.train_start
        elif kind == "save" and isinstance(ev.get("step"), int):
            stall = ev.get("seconds")
            a.saves.append(
                Save(
                    int(ev["step"]),
                    t,
                    float(stall) if isinstance(stall, (int, float)) else 0.0,
                    str(ev.get("mode") or "sync"),
                )
            )
        elif kind == "attempt_end":
            a.end, a.commits = t, _commits(ev.get("commits"))
            a.status = ev.get("status") if isinstance(ev.get("status"), int) else None
            a.outcome = "ended"
        elif kind in _OUTCOME and a.outcome in ("running", "ended"):
            a.outcome = _OUTCOME[str(kind)]
            if kind == "preempted":
                a.new_checkpoint = bool(ev.get("new_checkpoint"))
    h.attempts = [by[k] for k in sorted(by)]
    return h
