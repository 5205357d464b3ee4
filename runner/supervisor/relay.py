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

* A console that is a terminal (or one that already hung up) is relayed through a
  pseudo-terminal (``openpty``, with the terminal's window size): the child still sees a
  tty (line-buffered Python output, colours, progress bars).  The supervisor opens the
  pty and the child only inherits it, so it is not the child's controlling terminal and
  terminal signals still reach only the supervisor (a child that makes it its
  controlling terminal on purpose, ``TIOCSCTTY``, is on its own).  The pty passes bytes
  unprocessed (``OPOST`` off): the console's own terminal does the output processing,
  once.
* A pipe is relayed through a pipe: the child sees a pipe, as before.
* Anything else (a regular file, ``/dev/null``, a socket — journald's stream, which
  outlives the service and which ``JOURNAL_STREAM`` names —, a closed descriptor) is
  passed to the child unchanged, with no copying.
* stdout and stderr on the same console (``2>&1``, one terminal) share one channel, so
  their lines keep the order the child wrote them in.

The relay confirms that it runs, with its signals ignored, before the child starts; a
relay that cannot start leaves the child on the consoles themselves, as before (logged).
A resized terminal sends SIGWINCH to its foreground process group, the supervisor's;
the supervisor passes it on to the relay (:meth:`OutputRelay.resize`), which copies the
console's new size to its pty, so the child's next ``TIOCGWINSZ`` (a progress bar's
redraw) sees it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import signal
import stat
import struct
import sys
import termios
import time

from ckrun import procs

__all__ = ["RELAYED", "OutputRelay", "start_relay"]

log = logging.getLogger(__name__)

#: The console streams relayed: stdout and stderr.
RELAYED = (1, 2)
#: Seconds :meth:`OutputRelay.start` waits for the relay's "running" byte.
START_TIMEOUT_S = 10.0


def _kind(fd: int) -> str | None:
    """``pty`` for a terminal (or a terminal that hung up: it answers ``EIO``), ``pipe``
    for a pipe, None for anything else (module docstring)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "pipe"
    if not stat.S_ISCHR(mode):
        return None
    if os.isatty(fd):
        return "pty"
    try:
        termios.tcgetattr(fd)
    except termios.error as e:
        if e.args and e.args[0] == errno.EIO:  # a terminal whose other side is gone
            return "pty"
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


#: The relay process: ``argv[1]`` = ``READ:CONSOLE,...`` descriptor pairs, ``argv[2]``
#: the descriptor that says "running" (one byte, once the signals are ignored) and
#: closes at its exit.  It ignores the signals that would end it before its writers are
#: gone (SIGTTOU too: a write to a terminal with ``tostop`` set would stop it); SIGPIPE
#: is ignored by Python already.  A console is dropped only when it is gone (EPIPE,
#: EIO, EBADF...); one that is merely full (EAGAIN, a non-blocking console) is waited for.
_RELAY = """
import fcntl, os, select, signal, sys, termios
for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGTTOU", "SIGUSR1", "SIGUSR2"):
    signal.signal(getattr(signal, s), signal.SIG_IGN)
pairs = dict(tuple(map(int, p.split(":"))) for p in sys.argv[1].split(","))
def resize(*_):  # the supervisor's console was resized: its size to each pty
    for r, console in list(pairs.items()):
        try:
            if os.isatty(r):
                size = fcntl.ioctl(console, termios.TIOCGWINSZ, bytes(8))
                fcntl.ioctl(r, termios.TIOCSWINSZ, size)
        except OSError:
            pass
signal.signal(signal.SIGWINCH, resize)
os.write(int(sys.argv[2]), b"r")
writing = set(pairs.values())
poll = select.poll()
for r in pairs:
    poll.register(r, select.POLLIN)
while pairs:
    for r, _ in poll.poll():
        try:
            data = os.read(r, 65536)
        except OSError:  # EIO: a pty whose last writer closed
            data = b""
        if not data:
            poll.unregister(r)
            os.close(r)
            del pairs[r]
            continue
        view, console = memoryview(data), pairs[r]
        while console in writing and view:
            try:
                view = view[os.write(console, view):]
            except BlockingIOError:
                out = select.poll()
                out.register(console, select.POLLOUT)
                out.poll()
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
        pid: the relay process, once started (reaped with the supervisor's children).
    """

    def __init__(self) -> None:
        self.child_fds: list[int | None] = []
        self._pairs: list[tuple[int, int]] = []  # (read end, console)
        self._done: int | None = None  # EOF once the relay process exited
        self.pid: int | None = None
        self._pty = False  # a stream is relayed through a pty (its size follows the console)
        same: dict[tuple[int, int], int] = {}  # console (dev, ino) -> child's end
        try:
            for console in RELAYED:
                kind = _kind(console)
                if kind is None:
                    self.child_fds.append(None)
                    continue
                st = os.fstat(console)
                shared = same.get((st.st_dev, st.st_ino))
                if shared is not None:  # 2>&1: one channel keeps the child's order
                    self.child_fds.append(shared)
                    continue
                read_end, child_end = _open(kind, console)
                self._pty = self._pty or kind == "pty"
                same[(st.st_dev, st.st_ino)] = child_end
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
        """Start the relay process and wait (at most :data:`START_TIMEOUT_S`) until it
        runs with its signals ignored; it then holds the read ends (closed here).

        Raises:
            OSError: it did not start; every descriptor is closed, the relay killed if
                it exists, and :attr:`child_fds` is all None (the child then inherits
                the consoles).
        """
        if not self._pairs:
            return
        done_r, done_w = os.pipe()
        passed = [r for r, _ in self._pairs] + [done_w]
        pid: int | None = None
        try:
            for fd in passed:
                os.set_inheritable(fd, True)
            argv = [sys.executable, "-I", "-S", "-c", _RELAY,
                    ",".join(f"{r}:{c}" for r, c in self._pairs), str(done_w)]  # fmt: skip
            pid = procs.spawn_session(argv, os.environ)  # a session of its own
            os.close(done_w)
            done_w = -1
            if not _readable(done_r, START_TIMEOUT_S) or os.read(done_r, 1) != b"r":
                raise OSError(errno.ECHILD, "the relay process did not start")
        except BaseException:
            if pid is not None:
                _kill(pid)
            os.close(done_r)
            self.release()
            raise
        finally:
            if done_w >= 0:
                os.close(done_w)
            self._close_read_ends()
        self.pid, self._done = pid, done_r

    def resize(self) -> None:
        """The console was resized (the supervisor got SIGWINCH): tell the relay, which
        copies the new size to its pty (nothing for pipes, or without a relay)."""
        if self.pid is not None and self._pty:
            try:
                os.kill(self.pid, signal.SIGWINCH)
            except ProcessLookupError:
                pass

    def release(self) -> None:
        """Close this process's copies of the child's ends (after the spawn)."""
        for fd in set(self.child_fds):
            if fd is not None:
                os.close(fd)
        self.child_fds = [None] * len(self.child_fds)

    def _close_read_ends(self) -> None:
        for read_end, _ in self._pairs:
            os.close(read_end)
        self._pairs = []

    def join(self, timeout_s: float = 1.0) -> None:
        """Wait at most ``timeout_s`` seconds for the relay to copy the child's last
        output and exit (every writer gone); a stray that keeps a descriptor open is not
        waited for longer (the relay goes on copying until it closes it).  The relay's
        exit status is collected by the supervisor's ``reap``."""
        if self._done is None:
            return
        deadline = time.monotonic() + timeout_s
        try:
            while _readable(self._done, deadline - time.monotonic()):
                if not os.read(self._done, 1):
                    return
        finally:
            os.close(self._done)
            self._done = None


def _readable(fd: int, timeout_s: float) -> bool:
    """True once ``fd`` is readable (data or EOF) within ``timeout_s`` seconds."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(max(0, int(timeout_s * 1000))))


def _kill(pid: int) -> None:
    """SIGKILL a relay that did not confirm its start, and reap it."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


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
