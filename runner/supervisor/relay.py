"""The child's output, relayed by the supervisor to a console that may go away.

A foreground ``ckrun submit train.py | tee log`` followed by Ctrl-C: the terminal's
SIGINT reaches ``tee`` too, and ``tee`` dies.  The supervisor survives it
(:mod:`ckrun.supervisor.console`) and turns the SIGINT into a notice, but a training
process that inherited the pipe would write its next ``print`` into a pipe with no
reader: ``BrokenPipeError`` (Python ignores SIGPIPE), and the script dies before the
emergency checkpoint it was told to make.  A terminal that hung up (an SSH session that
dropped) answers ``EIO`` the same way.

So the supervisor gives the child its own descriptors for stdout and stderr, and a small
relay process copies what arrives to the supervisor's console.  A failed write to a lost
console only stops the copying: the relay keeps reading, so the child never blocks on a
full pipe nor sees an error.  The relay is a process of its own, not a thread of the
supervisor, because the child must also outlive a *supervisor* that dies (SIGKILL, the
OOM killer: the child gets its parent-death SIGTERM and saves, and would then print into
a pipe that nobody reads).  The relay runs in a session of its own (no terminal signal
reaches it: Ctrl-C, a hang-up), ignores the termination signals a batch system sends to
every process of a job, holds no descriptor but its pipes and the consoles, and exits
when the last writer (the child's whole tree) closed them.

* A console that is a terminal is relayed through a pseudo-terminal (``openpty``, with
  the terminal's window size): the child still sees a tty (line-buffered Python output,
  colours, progress bars).  The pty is not the child's controlling terminal (it is
  opened by the supervisor and only inherited), so terminal signals still reach only the
  supervisor.  The pty passes bytes unprocessed (``OPOST`` off): the console's own
  terminal does the output processing, once.
* A pipe or socket is relayed through a pipe: the child sees a pipe, as before.
* Anything else (a regular file, ``/dev/null``, a closed descriptor) cannot go away and
  is passed to the child unchanged, with no copying.

Window-size changes after the start are not forwarded (``SIGWINCH``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import stat
import struct
import subprocess
import sys
import termios
import time

__all__ = ["RELAYED", "OutputRelay", "start_relay"]

log = logging.getLogger(__name__)

#: The console streams relayed: stdout and stderr.
RELAYED = (1, 2)
_CHUNK = 1 << 16


def _kind(fd: int) -> str | None:
    """``pty`` for a terminal, ``pipe`` for a pipe or socket, None for anything else."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    if os.isatty(fd):
        return "pty"
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return "pipe"
    return None


def _open(kind: str, console: int) -> tuple[int, int]:
    """``(read end, child's end)`` for one stream; both close-on-exec (PEP 446; the
    child gets its end through ``dup2``)."""
    if kind == "pipe":
        return os.pipe()
    master, slave = os.openpty()
    os.set_inheritable(master, False)
    os.set_inheritable(slave, False)
    try:
        # bytes pass unprocessed: the console's own terminal turns "\n" into "\r\n"
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        # the child sees the console's width and height
        size = fcntl.ioctl(console, termios.TIOCGWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    except (OSError, termios.error):
        pass
    return master, slave


#: The relay process: ``argv[1]`` = ``READ:CONSOLE,...`` descriptor pairs.  It ignores
#: the signals that would end it before its writers are gone (SIGTTOU too: a write to a
#: terminal with ``tostop`` set would stop it); SIGPIPE is ignored by Python already.
_RELAY = """
import os, select, signal, sys
for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGTTOU", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, s), signal.SIG_IGN)
pairs = dict(tuple(map(int, p.split(":"))) for p in sys.argv[1].split(","))
writing = set(pairs.values())
while pairs:
    for r in select.select(list(pairs), [], [])[0]:
        try:
            data = os.read(r, 65536)
        except OSError:  # EIO: a pty whose last writer closed
            data = b""
        if not data:
            os.close(r)
            del pairs[r]
            continue
        view, console = memoryview(data), pairs[r]
        while console in writing and view:
            try:
                view = view[os.write(console, view):]
            except OSError:  # the console went away: keep reading, stop writing
                writing.discard(console)
"""


class OutputRelay:
    """Relays a child's stdout and stderr to this process's (module docstring).

    Use: :meth:`start` (the relay process runs and holds the read ends), pass
    :attr:`child_fds` to the spawn, :meth:`release` (whether the spawn worked or not:
    a relay whose writers never existed sees EOF and exits), and :meth:`join` once the
    child's session is empty.

    Attributes:
        child_fds: per stream in :data:`RELAYED`, the descriptor the child gets (None:
            it inherits the console, which is not relayed).
        pid: the relay process, once started.
    """

    def __init__(self) -> None:
        self.child_fds: list[int | None] = []
        self._pairs: list[tuple[int, int]] = []  # (read end, console)
        self._done: int | None = None  # EOF once the relay process exited
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        try:
            for console in RELAYED:
                kind = _kind(console)
                if kind is None:
                    self.child_fds.append(None)
                    continue
                read_end, child_end = _open(kind, console)
                self.child_fds.append(child_end)
                self._pairs.append((read_end, console))
        except OSError:
            self.release()
            self._close_read_ends()
            raise

    @property
    def active(self) -> bool:
        """True when at least one stream is relayed."""
        return self.pid is not None or bool(self._pairs)

    def start(self) -> None:
        """Start the relay process, which takes the read ends over (closed here).

        Raises:
            OSError: it cannot start; every descriptor is closed and :attr:`child_fds`
                is all None (the child then inherits the consoles).
        """
        if not self._pairs:
            return
        done_r, done_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    _RELAY,
                    ",".join(f"{r}:{c}" for r, c in self._pairs),
                ],  # fmt: skip
                stdin=subprocess.DEVNULL,
                pass_fds=[r for r, _ in self._pairs] + [done_w],
                start_new_session=True,
            )
        except BaseException:
            os.close(done_r)
            self.release()
            raise
        finally:
            os.close(done_w)
            self._close_read_ends()
        self._proc, self.pid, self._done = proc, proc.pid, done_r

    def release(self) -> None:
        """Close this process's copies of the child's ends (after the spawn)."""
        for fd in self.child_fds:
            if fd is not None:
                os.close(fd)
        self.child_fds = [None] * len(self.child_fds)

    def _close_read_ends(self) -> None:
        for read_end, _ in self._pairs:
            os.close(read_end)
        self._pairs = []

    def join(self, timeout_s: float = 2.0) -> None:
        """Wait at most ``timeout_s`` seconds for the relay to copy the child's last
        output and exit (every writer gone); a stray that keeps a descriptor open is not
        waited for (the relay goes on copying until it closes it)."""
        if self._done is None:
            return
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                if select.select([self._done], [], [], left)[0]:
                    if not os.read(self._done, 1):
                        break
            else:
                return
            if self._proc is not None:  # exited (or exiting): collect its status
                self._proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            os.close(self._done)
            self._done = None


def start_relay() -> OutputRelay | None:
    """A started relay of this process's consoles, or None when none needs one or the
    relay cannot start (logged: the child then writes to the consoles directly, as
    before; a run is never refused for it)."""
    try:
        relay = OutputRelay()
        if not relay.active:
            return None
        relay.start()
    except OSError as e:
        log.warning("the command's output is not relayed (%s): it writes to the console", e)
        return None
    return relay
