"""The attempt's command on the process table: its start, the notice's delivery, signals
to its session, and reaping it (DESIGN.md §4.5).

Over a :class:`~ckrun.supervisor.ports.ProcessTable` (real processes or a test's fakes).
The supervisor alone waits: :meth:`AttemptChild.reap` reaps every exited child (orphans
adopted in subreaper mode too) and tells the loop how far the attempt's end has come:
still running, the command exited but its session has processes left (the machine's
stray timers decide), or the session is empty (the attempt is over).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from typing import Any

from ckrun.supervisor.messages import LeaderExited
from ckrun.supervisor.ports import Clock, ProcessTable
from ckrun.supervisor.process import Child
from ckrun.supervisor.watched import deliver_to_script


class AttemptChild:
    """The current attempt's child (at most one at a time).

    Attributes:
        current: the running (or exited, not yet ended) child; None between attempts.
        notified: pids that got the notice signal in this attempt (a notified process
            still alive after its leader's exit is saving, not a stray).
    """

    def __init__(self, procs: ProcessTable, clock: Clock) -> None:
        self.procs, self.clock = procs, clock
        self.current: Child | None = None
        self.notified: set[int] = set()
        self._delivered: list[int] | None = None
        self._waits: list[str] | None = None

    def start(self, argv: Sequence[str], env: Mapping[str, str], *, track_tree: bool) -> Child:
        """Start ``argv`` as leader of a new session (:meth:`ProcessTable.spawn`).

        Raises:
            OSError: the command cannot be executed.
        """
        self.notified = set()
        self.current = self.procs.spawn(argv, env, track_tree=track_tree)
        return self.current

    def deliver(self, sig: int, *, to_script: bool) -> int | None:
        """Deliver the notice signal ``sig`` to the processes that catch it (with
        ``to_script``, an own-checkpoint script: to the whole session when none does).

        Returns:
            How many processes were signalled; None without a child.
        """
        c = self.current
        if c is None:
            return None
        sent = deliver_to_script(c, sig) if to_script else self.procs.deliver(c, sig)
        self._delivered = sent
        self.notified.update(sent)
        return len(sent)

    def take_delivered(self) -> list[int] | None:
        """The pids of the last delivery not yet reported (once), else None."""
        sent, self._delivered = self._delivered, None
        return sent

    def escalate(self) -> None:
        """The grace period is over: note where the child's processes are
        (:meth:`ProcessTable.waits`, reported once by :meth:`take_waits`), then send
        SIGTERM to its session (nothing without a child)."""
        if self.current is not None:
            try:  # a diagnostic: it never delays or prevents the TERM
                self._waits = self.procs.waits(self.current)
            except Exception:  # noqa: BLE001
                self._waits = None
            self.procs.signal_session(self.current, signal.SIGTERM)

    def annotate(self, kind: str, msg: str, fields: dict[str, Any], notice_sig: str) -> str:
        """``msg`` of a ``notice`` or ``escalate`` log line with what the delivery or the
        escalation found (the pids signalled with ``notice_sig``; where the processes
        were), each reported once; the same go into ``fields``."""
        sent = self.take_delivered() if kind == "notice" else None
        if sent is not None:
            fields["signalled_pids"] = sent
            msg += f", {notice_sig} to {len(sent)} process(es)"
        waits = self.take_waits() if kind == "escalate" else None
        if waits:  # a thread in D: a storage stall; all in S futex: a lock or a thread
            fields["waits"] = waits
            msg += "; where its processes were: " + " | ".join(waits)
        return msg

    def take_waits(self) -> list[str] | None:
        """Where the processes were at the last escalation, not yet reported (once)."""
        waits, self._waits = self._waits, None
        return waits

    def resize(self) -> None:
        """The console was resized: the child's relayed pty takes its size."""
        c = self.current
        if c is not None and c.relay is not None:
            c.relay.resize()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's session (nothing without a child)."""
        if self.current is not None:
            self.procs.signal_session(self.current, sig)

    def reap(self, now: float) -> Child | LeaderExited | None:
        """Reap every exited child; ``now`` in monotonic seconds.

        Returns:
            None while the child runs (or there is none); :class:`LeaderExited` while
            the command has exited but its session has processes left; the ended child
            (``status`` set) once its session is empty, which is then forgotten.
        """
        reaped = self.procs.reap()
        c = self.current
        if c is None:
            return None
        if c.pid in reaped:
            c.status, c.exited = reaped[c.pid], now
        if c.status is None:
            self.procs.track(c, now)
            return None
        left = self.procs.members(c)
        if left:
            return LeaderExited(c.status, now, bool(self.notified & set(left)))
        self.current = None
        if c.relay is not None:  # its last lines reach the console before the verdict
            c.relay.join()
        return c

    def abandon(self, wake_fd: int, timeout_s: float = 5.0) -> None:
        """On an unexpected exit of the loop, do not leave the child running: KILL its
        session and reap it for up to ``timeout_s`` seconds."""
        c = self.current
        if c is None or c.status is not None:
            return
        self.procs.signal_session(c, signal.SIGKILL)
        deadline = self.clock.monotonic() + timeout_s
        while self.clock.monotonic() < deadline and c.pid not in self.procs.reap():
            self.clock.wait(wake_fd, 0.01)
