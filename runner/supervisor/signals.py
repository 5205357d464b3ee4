"""The supervisor's signal inbox: handlers that only record, a self-pipe that wakes the loop.

The handlers record the signal number and nothing else (the loop decides, in its own
thread, what each one means: :mod:`ckrun.supervisor.intake`); ``signal.set_wakeup_fd``
writes a byte to a non-blocking pipe so the loop's ``select`` returns at once instead of
at the end of its tick (Python ``signal`` docs, "set_wakeup_fd").  SIGCHLD and USR2 only
wake; HUP and QUIT (:data:`FORWARD`) are forwarded to the child's group; WINCH (the
console was resized) goes to the output relay, which resizes the child's pty.

At install the inbox takes over what :mod:`ckrun.notice_hold` caught while the process
started (the notice signal, from the first ``import ckrun`` of ``ckrun run``), in arrival
order; the loop takes them before its start decision, so a notice that came while the
supervisor started keeps the command from starting.  A held signal the inbox does not
handle gets its default action, as if it had never been held.
"""

from __future__ import annotations

import collections
import os
import signal
from collections.abc import Callable

from ckrun import notice_hold

#: Signals forwarded to the child's process group (the machine's :class:`Forward`).
FORWARD = (signal.SIGHUP, signal.SIGQUIT)


class SignalInbox:
    """Signals recorded by the handlers, taken by the loop in arrival order.

    Args:
        notice_sig: the notice signal the scheduler sends (default USR1).
    """

    def __init__(self, notice_sig: int) -> None:
        self.notice_sig = notice_sig
        self._signals: collections.deque[int] = collections.deque()
        #: read end of the wake-up pipe while installed, else -1 (the clock waits on it)
        self.wake_fd = -1

    def record(self, signum: int) -> None:
        """Record signal ``signum`` (the handler; tests call it directly)."""
        self._signals.append(signum)

    def _handler(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def take(self) -> list[int]:
        """The signals recorded since the last call, oldest first; empties the wake pipe."""
        try:
            while self.wake_fd >= 0 and os.read(self.wake_fd, 512):
                pass
        except BlockingIOError:
            pass
        out = []
        while self._signals:
            out.append(self._signals.popleft())
        return out

    def install(self, *, restore_signals: bool) -> Callable[[], None]:
        """Install the handlers and the wake-up pipe; returns the function undoing it.

        Args:
            restore_signals: the undo puts the previous handlers back (in-process use);
                otherwise every signal but SIGCHLD is left ignored until the process
                exits: the run's outcome is decided, a late notice (e.g. Slurm's
                time-limit USR1 just after completion) changes nothing.
        """
        sigs = {signal.SIGTERM, self.notice_sig, signal.SIGUSR2, signal.SIGCHLD, signal.SIGINT,
                signal.SIGWINCH}  # fmt: skip
        sigs.update(FORWARD)
        old = {s: signal.signal(s, self._handler) for s in sigs}
        held = notice_hold.take()  # after our handlers: nothing falls in between
        self._signals.extendleft(reversed([s for s in held if s in sigs]))
        for s in dict.fromkeys(s for s in held if s not in sigs):
            signal.signal(s, signal.SIG_DFL)  # not ours: what it would have done
            os.kill(os.getpid(), s)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self.wake_fd = r

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                if restore_signals or s == signal.SIGCHLD:
                    signal.signal(s, h)
                else:
                    signal.signal(s, signal.SIG_IGN)
            os.close(r)
            os.close(w)
            self.wake_fd = -1

        return restore
