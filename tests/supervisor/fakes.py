"""A fake clock and a fake process table for running the supervisor loop in process.

The clock advances only when the loop waits (``tick_s`` per round), so a test of a 60 s
grace period runs in milliseconds and every time it checks is exact.  The process
table scripts the command's behaviour (when it exits, whether it catches the notice
signal, what is left in its session) and records every signal with its time.
These stand in for real processes only in the loop's timing tests; the same items are
also tested end to end with real processes and signals.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckrun.supervisor.process import Child


class FakeClock:
    """Monotonic time that moves only when the loop waits."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def monotonic(self) -> float:
        return self.t

    def wait(self, fd: int, timeout_s: float) -> None:
        self.t += max(timeout_s, 0.0)


@dataclass
class Script:
    """What one attempt's command does.

    Attributes:
        exit_after: the command exits by itself this long after its start (None: never).
        status: its status then.
        catches_notice: it handles the notice signal (the library is in use).
        notice_exit_after / notice_status: after the notice signal (when caught), it
            exits this long after with this status (a save takes time).
        dies_on_term: SIGTERM ends it (143); otherwise only KILL does.
        strays: processes left in its session when it exits.
        strays_die_on_term: those die on SIGTERM (else only on KILL).
    """

    exit_after: float | None = None
    status: int = 0
    catches_notice: bool = True
    notice_exit_after: float | None = 0.5
    notice_status: int = 75
    dies_on_term: bool = True
    strays: int = 0
    strays_die_on_term: bool = True


@dataclass
class FakeChild:
    script: Script
    child: Child
    started: float
    leader_exit_at: float | None
    leader_status: int = 0
    reaped: bool = False
    strays_made: bool = False
    strays_alive: list[int] = field(default_factory=list)
    signals: list[tuple[float, int]] = field(default_factory=list)


class FakeProcesses:
    """Scripted children; ``scripts`` are used in order, the last one repeats."""

    def __init__(self, clock: FakeClock, scripts: Sequence[Script]) -> None:
        self.clock = clock
        self.scripts = list(scripts)
        self.children: list[FakeChild] = []
        self._next = 5000

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], *, track_tree: bool) -> Child:
        sc = self.scripts[min(len(self.children), len(self.scripts) - 1)]
        self._next += 10
        now = self.clock.t
        c = Child(pid=self._next, argv=tuple(argv), started=now)
        at = None if sc.exit_after is None else now + sc.exit_after
        self.children.append(FakeChild(sc, c, now, at, sc.status))
        return c

    def _get(self, child: Child) -> FakeChild:
        return next(f for f in self.children if f.child.pid == child.pid)

    def _exit_leader(self, f: FakeChild, status: int, at: float) -> None:
        if f.leader_exit_at is None or f.leader_exit_at > at:
            f.leader_exit_at, f.leader_status = at, status

    def become_subreaper(self) -> bool:
        return True

    def reap(self) -> dict[int, int]:
        out = {}
        for f in self.children:
            if f.leader_exit_at is not None and f.leader_exit_at <= self.clock.t and not f.reaped:
                f.reaped = True
                if not f.strays_made:  # what the command left behind in its session
                    f.strays_made = True
                    f.strays_alive = [f.child.pid + 1 + i for i in range(f.script.strays)]
                out[f.child.pid] = f.leader_status
        return out

    def track(self, child: Child, now: float) -> None:
        pass

    def members(self, child: Child) -> list[int]:
        f = self._get(child)
        alive = [] if f.reaped else [child.pid]
        return alive + list(f.strays_alive)

    def deliver(self, child: Child, sig: int) -> list[int]:
        f = self._get(child)
        if f.reaped or not f.script.catches_notice:
            return []
        f.signals.append((self.clock.t, sig))
        if f.script.notice_exit_after is not None:
            self._exit_leader(f, f.script.notice_status, self.clock.t + f.script.notice_exit_after)
        return [child.pid]

    def signal_session(self, child: Child, sig: int) -> None:
        f = self._get(child)
        f.signals.append((self.clock.t, sig))
        if sig == signal.SIGKILL:
            self._exit_leader(f, 128 + sig, self.clock.t)
            f.strays_made, f.strays_alive = True, []
        elif sig == signal.SIGTERM:
            if not f.reaped and f.script.dies_on_term:
                self._exit_leader(f, 128 + sig, self.clock.t)
            if f.script.strays_die_on_term:
                f.strays_made, f.strays_alive = True, []

    def waits(self, child: Child) -> list[str]:
        return []  # a fake process has no threads to describe

    def sent(self, n: int = -1) -> list[tuple[float, str]]:
        """``(time since the start of child n, signal name)`` of child n's signals."""
        f = self.children[n]
        return [(round(t - f.started, 3), signal.Signals(s).name) for t, s in f.signals]
