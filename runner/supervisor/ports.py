"""What the supervisor loop needs from the outside world: a clock and a process table.

:class:`ckrun.supervisor.loop.Supervisor` takes both as arguments, so tests run the whole
loop in process with a fake clock (time advances only when the loop waits) and a fake
process table (scripted children), while ``ckrun run`` uses :class:`MonotonicClock` and
:class:`OsProcessTable` (real processes, :mod:`ckrun.supervisor.process`).
"""

from __future__ import annotations

import select
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from ckrun import procs
from ckrun.supervisor import process
from ckrun.supervisor.process import Child


class Clock(Protocol):
    """Monotonic time and waiting."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (``time.monotonic()``)."""
        ...

    def wait(self, fd: int, timeout_s: float) -> None:
        """Return when ``fd`` is readable (a signal arrived) or ``timeout_s`` passed."""
        ...


class ProcessTable(Protocol):
    """Spawn, signal and reap the command's processes."""

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], *, track_tree: bool) -> Child:
        """Start ``argv`` as leader of a new session.

        Raises:
            OSError: the command cannot be executed.
        """
        ...

    def become_subreaper(self) -> bool:
        """Adopt orphaned descendants (``PR_SET_CHILD_SUBREAPER``); True when set."""
        ...

    def reap(self) -> dict[int, int]:
        """Exited children, pid -> shell-style status (never blocks)."""
        ...

    def track(self, child: Child, now: float) -> None:
        """Learn the sessions of a tracked tree's descendants (torchrun workers)."""
        ...

    def members(self, child: Child) -> list[int]:
        """Live processes of ``child``'s session (and tracked tree)."""
        ...

    def deliver(self, child: Child, sig: int) -> list[int]:
        """Send ``sig`` to the members that catch it; the pids signalled."""
        ...

    def signal_session(self, child: Child, sig: int) -> None:
        """Send ``sig`` to every member of ``child``'s session, once each."""
        ...

    def waits(self, child: Child) -> list[str]:
        """Where each member is: its threads' states and wait channels, one line each."""
        ...


class MonotonicClock:
    """``time.monotonic()`` and ``select``."""

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wait(self, fd: int, timeout_s: float) -> None:
        """``select`` on ``fd`` for at most ``timeout_s`` seconds."""
        select.select([fd], [], [], max(0.0, timeout_s))


class OsProcessTable:
    """Real processes (:mod:`ckrun.supervisor.process`)."""

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], *, track_tree: bool) -> Child:
        """:func:`ckrun.supervisor.process.spawn` (with the parent-death signal set)."""
        return process.spawn(argv, env, track_tree=track_tree)

    def become_subreaper(self) -> bool:
        """:func:`ckrun.procs.become_subreaper`."""
        return procs.become_subreaper()

    def reap(self) -> dict[int, int]:
        """:func:`ckrun.supervisor.process.reap`."""
        return process.reap()

    def track(self, child: Child, now: float) -> None:
        """:func:`ckrun.supervisor.torchrun.track` for a tracked tree."""
        if child.sids is not None:
            from ckrun.supervisor.torchrun import track

            track(child.pid, child.sids, now)

    def members(self, child: Child) -> list[int]:
        """:func:`ckrun.supervisor.process.members`."""
        return process.members(child)

    def deliver(self, child: Child, sig: int) -> list[int]:
        """:func:`ckrun.supervisor.process.deliver`."""
        return process.deliver(child, sig)

    def signal_session(self, child: Child, sig: int) -> None:
        """:func:`ckrun.supervisor.process.signal_session`."""
        process.signal_session(child, sig)

    def waits(self, child: Child) -> list[str]:
        """:func:`ckrun.supervisor.process.waits`."""
        return process.waits(child)
