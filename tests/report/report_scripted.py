"""Scripted event logs with known answers, for the report tests (real files, fixed stamps).

:class:`Script` writes the events the supervisor and the training process would write
(``spawn``, ``attempt_start``, ``restore``, ``save``, ``notice``, ``attempt_end``, ...)
at chosen offsets from :data:`T0`, into a real run directory.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from ckrun.config import resolve
from ckrun.supervisor.rundir import RunDir

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def at(s: float) -> str:
    return (T0 + dt.timedelta(seconds=s)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Script:
    """Events of one run, appended in order."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def ev(self, t: float, attempt: int, kind: str, **f: Any) -> Script:
        self.events.append({"utc": at(t), "run": "r", "attempt": attempt, "kind": kind, **f})
        return self

    def attempt(
        self,
        n: int,
        spawn: float,
        *,
        resume: int | None,
        startup: float,
        restore: float,
        saves: list[tuple[int, float, float]],
        end: float,
        status: int,
        outcome: str,
        notice: tuple[float, str, float] | None = None,
        commits: list[int] | None = None,
    ) -> Script:
        """One attempt: ``saves`` are ``(step, stall end, stall seconds)``; ``commits``
        the saved steps that committed (default: all); ``notice`` ``(t, source, lead)``."""
        self.ev(spawn, n, "spawn", pid=1000 + n)
        self.ev(spawn, n, "attempt_start", step=resume)
        self.ev(spawn + startup + restore, n, "restore", step=resume, seconds=restore)
        done = set(commits if commits is not None else [s[0] for s in saves])
        for step, t_end, stall in saves:
            if notice is not None and notice[0] <= t_end - stall:
                self.ev(
                    notice[0],
                    n,
                    "notice",
                    source=notice[1],
                    notice_kind="drill",
                    seconds_left=notice[2],
                )
                notice = None
            self.ev(t_end, n, "save", step=step, seconds=stall, mode="sync")
        self.ev(
            end,
            n,
            "attempt_end",
            status=status,
            commits=[
                {"step": s, "committed_utc": at(t), "save_s": st, "kind": "recovery"}
                for s, t, st in saves
                if s in done
            ],
        )
        if outcome == "preempted":
            self.ev(end, n, "preempted", new_checkpoint=bool(done), step=max(done, default=None))
        elif outcome == "failure":
            self.ev(end, n, "backoff", seconds=1)
        elif outcome == "completed":
            self.ev(end, n, "completed")
        return self

    def write(self, tmp: Path, state: str | None = None, exit_code: int = 0) -> RunDir:
        cfg = resolve("local", {"storage": str(tmp)}, {}, run="r", command=("true",))
        rd = RunDir(cfg.state_root)
        rd.freeze(cfg)
        evs = list(self.events)
        if state is not None:
            last = max(json.loads(json.dumps(e))["utc"] for e in evs)
            evs.append(
                {
                    "utc": last,
                    "run": "r",
                    "attempt": 0,
                    "kind": "supervisor_exit",
                    "state": state,
                    "exit_code": exit_code,
                }
            )
        Path(rd.events_path).write_text("".join(json.dumps(e) + "\n" for e in evs))
        return rd


def five_of_three_hundred() -> Script:
    """5 attempts of 2 s, each: 1.45 s start-up, 0.05 s restore, one 0.2 s step, a chaos
    notice, a 0.2 s save of that step, 0.1 s to exit; 0.5 s between attempts.

    Known answers: wall 12 s, productive 5 × 0.2 = 1 s (goodput 1/12), start-up 7.25 s,
    restore 0.25 s, saving 1 s, shutdown 0.5 s, waiting 2 s, 5 productive steps."""
    s = Script()
    for k in range(5):
        t = 2.5 * k
        s.attempt(
            k,
            t,
            resume=k - 1 if k else None,
            startup=1.45,
            restore=0.05,
            saves=[(k, t + 1.9, 0.2)],
            end=t + 2.0,
            status=75,
            outcome="preempted",
            notice=(t + 1.65, "chaos", 60.0),
        )
    return s


def stormy() -> Script:
    """Three preemptions, one failure and a refused requeue (the timeline page's case).

    0: fresh, saves 10 @ 5 (0.5 s), 20 @ 10 (0.5 s), preempted: save 25 @ 12.4 (0.4 s).
    1: resumes 25, saves 40 @ 20 (0.5), crashes at 24 (failure; 40 kept).
    2: resumes 40, preempted at 30.5 with save 50 @ 30.4 (0.4).
    3: resumes 50, preempted: save 60 @ 38.4; the requeue is refused.
    """
    s = Script()
    s.attempt(
        0,
        0.0,
        resume=None,
        startup=1.5,
        restore=0.0,
        saves=[(10, 5.0, 0.5), (20, 10.0, 0.5), (25, 12.4, 0.4)],
        end=12.5,
        status=75,
        outcome="preempted",
        notice=(11.9, "chaos", 60.0),
    )
    s.attempt(
        1,
        13.5,
        resume=25,
        startup=1.5,
        restore=0.5,
        saves=[(40, 20.0, 0.5)],
        end=24.0,
        status=1,
        outcome="failure",
    )
    s.attempt(
        2,
        25.0,
        resume=40,
        startup=1.5,
        restore=0.5,
        saves=[(50, 30.4, 0.4)],
        end=30.5,
        status=75,
        outcome="preempted",
        notice=(29.9, "aws", 120.0),
    )
    s.attempt(
        3,
        31.5,
        resume=50,
        startup=1.5,
        restore=0.5,
        saves=[(60, 38.4, 0.4)],
        end=38.5,
        status=75,
        outcome="preempted",
        notice=(37.9, "signal:SIGUSR1", 30.0),
    )
    s.ev(38.5, 3, "requeue_failed", message="requeue failed: scontrol refused")
    return s
