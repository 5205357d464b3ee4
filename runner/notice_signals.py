"""The child's notice signals: the handler that only sets the preemption flag, its
installation, and what it does when the supervisor's time is up (DESIGN.md §3,
"Supervisor ↔ child"; the channel's files are :mod:`ckrun.control_files`, the flag's
readers :mod:`ckrun.control`, which re-exports the public names here).

* :func:`install_signal_handlers` makes SIGTERM, the notice signal
  (``CKRUN_NOTICE_SIGNAL``, default SIGUSR1) and SIGHUP set :data:`flag`, so the save
  runs at the next step boundary instead of inside a signal handler.  Under a
  supervisor, ``import ckrun`` already catches the notice signal (:func:`catch_notice_early`).
* The flag is a plain bool (:class:`NoticeFlag`): the handler may interrupt the main
  thread while it sets the flag itself.
* A notice also defers the writer's throughput probe in this process
  (:func:`ckrun.storage.probe.defer_probes`): the emergency save writes its checkpoint,
  not 144 MiB of probe first.
* A SIGTERM after :func:`ckrun.control_files.write_escalation` (the grace period is
  over) is not swallowed: the process writes where its threads are
  (:func:`dump_stacks`), restores the default action and re-raises the signal.
* :func:`follow_parent`: under a supervisor the process gets SIGTERM when its parent
  dies (``PR_SET_PDEATHSIG``), once per process.

Environment read here: ``CKRUN_CONTROL_DIR``, ``CKRUN_NOTICE_SIGNAL``,
``CKRUN_SUPERVISOR_PID``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import threading
from types import FrameType
from typing import BinaryIO

from ckrun.control_files import ESCALATE_FILE, control_dir
from ckrun.notice_hold import notice_signal
from ckrun.procs import set_parent_death_signal
from ckrun.storage import probe

__all__ = [
    "NoticeFlag", "catch_notice_early", "dump_stacks", "flag", "follow_parent",
    "install_signal_handlers", "notice_reached", "notice_signal", "received",
    "received_signals", "shield_from_dataloader_workers",
]  # fmt: skip


class NoticeFlag:
    """A set-once flag without a lock: set by the signal handler, which may interrupt the
    main thread anywhere, also inside a set of this very flag (when ``notice.json`` is
    seen as the signal lands).  A ``threading.Event`` there deadlocks: its set takes a
    lock the interrupted frame already holds, and the handler waits on it forever.  A
    bool's store and load are single operations under the GIL."""

    def __init__(self) -> None:
        self._on = False

    def set(self) -> None:
        """Raise the flag."""
        self._on = True

    def is_set(self) -> bool:
        """True once raised (and not cleared)."""
        return self._on

    def clear(self) -> None:
        """Lower it (tests)."""
        self._on = False


#: The preemption flag of this process.
flag = NoticeFlag()
#: Signal numbers the handler received, in order.
received: list[int] = []
_installed: set[int] = set()
_handlers_pid: list[int] = []  # the process that installed them (a fork inherits them)
_pdeath_set: list[int] = []


def follow_parent() -> None:
    """Under a supervisor, die (SIGTERM: a notice) with the parent, once per process."""
    pid = os.getpid()
    if control_dir() and os.environ.get("CKRUN_SUPERVISOR_PID") and pid not in _pdeath_set:
        _pdeath_set.append(pid)
        set_parent_death_signal(signal.SIGTERM)


def shield_from_dataloader_workers() -> None:
    """Keep DataLoader worker deaths from killing the process before its save.

    torch's DataLoader workers die on any SIGTERM that their parent did not send (a
    scheduler signalling the whole process group, ``kill -TERM -PGID``), and the SIGCHLD
    handler the DataLoader installs then raises in the training process at once.  Once a
    notice has arrived, the workers are expendable: restoring the default SIGCHLD action
    lets the process reach its emergency save (the iterator fails only if used again).
    """
    h = signal.getsignal(signal.SIGCHLD)
    if callable(h) and str(getattr(h, "__module__", "")).startswith("torch.utils.data"):
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        except ValueError:  # not the main thread
            pass


def dump_stacks(fd: int = 2) -> None:
    """Write where every thread of this process is to ``fd``: a header naming the pid,
    then :func:`faulthandler.dump_traceback` (file, line and function of each frame,
    most recent first; at most 100 threads of 100 frames).  Used when the supervisor's
    grace period is over and the process has not exited.

    The text goes out in one ``write(2)``: ``fd`` is shared with the supervisor's own
    lines and with the other processes of the job, which dump at the same TERM, and
    ``faulthandler`` writes piece by piece, so written directly a dump came out split by
    their lines.  One write to a pipe is never interleaved up to ``PIPE_BUF`` (4096
    bytes, POSIX ``write(2)``); a longer dump can still be split, at most where the
    kernel splits it.  The dump is first written to an anonymous in-memory file
    (``memfd_create(2)``; elsewhere, an unnamed temporary file); where none can be
    made (no descriptor left), it is written straight to ``fd``, piece by piece.

    Safe inside a signal handler: no lock is taken and no source file is read (a file
    on the hung mount would hang the dump), and the text goes straight to ``fd``, not
    through ``sys.stderr`` (whose buffer the interrupted code may hold).  It runs where
    Python runs the handler: a main thread blocked in uninterruptible I/O or in C code
    that never checks for signals prints nothing and is ended by the KILL that follows.
    Best effort: an error writing it is ignored.
    """
    header = (
        f"ckrun: pid {os.getpid()} did not exit within the supervisor's grace period; "
        "where its threads were (most recent call first):\n"
    ).encode()
    try:
        try:
            with _scratch_file() as scratch:
                faulthandler.dump_traceback(scratch, all_threads=True)
                scratch.seek(0)
                text = memoryview(header + scratch.read())
        except OSError:  # no file to collect it in (out of descriptors): piece by piece
            os.write(fd, header)
            faulthandler.dump_traceback(fd, all_threads=True)
            return
        while text:  # a pipe or a tty may take less than all of it
            text = text[os.write(fd, text) :]
    except (OSError, ValueError, RuntimeError):
        pass


def _scratch_file() -> BinaryIO:
    """An unnamed file for :func:`dump_stacks` to collect the dump in: in memory where
    the platform has ``memfd_create(2)`` (Linux), else an unlinked temporary file.

    Raises:
        OSError: neither can be created.
    """
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        return open(memfd("ckrun-stacks", os.MFD_CLOEXEC), "w+b", buffering=0)
    return tempfile.TemporaryFile("w+b", buffering=0)


def notice_reached() -> None:
    """Set the preemption flag; from now on no writer probe runs in this process (its
    144 MiB of writes would come out of the emergency save's deadline,
    :func:`ckrun.storage.probe.defer_probes`).  Safe in a signal handler."""
    flag.set()
    probe.defer_probes("a preemption notice is pending")


def _handler(signum: int, frame: FrameType | None) -> None:
    cdir = control_dir()
    if signum == signal.SIGTERM and cdir and os.path.exists(os.path.join(cdir, ESCALATE_FILE)):
        if _handlers_pid and _handlers_pid[0] == os.getpid():  # not a forked worker
            dump_stacks()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    received.append(signum)
    notice_reached()
    shield_from_dataloader_workers()


def install_signal_handlers(force: bool = False) -> bool:
    """Make SIGTERM, the notice signal and SIGHUP set the preemption flag.

    SIGHUP is what the supervisor forwards when its terminal hangs up (an SSH session
    that drops under a foreground ``ckrun submit``); by default it would end the process
    at once and lose the work since the last checkpoint, so it is a notice here too.

    Installed only in the main thread, and only when running under the supervisor
    (``CKRUN_CONTROL_DIR`` set) unless ``force``: outside the supervisor nobody would
    escalate, and a swallowed SIGTERM would keep the process alive.

    Returns:
        True when the handlers are installed (now or earlier).
    """
    if not (force or control_dir()):
        return False
    follow_parent()
    if threading.current_thread() is not threading.main_thread():
        return bool(_installed)
    for sig in (signal.SIGTERM, notice_signal(), signal.SIGHUP):
        if sig not in _installed:
            signal.signal(sig, _handler)
            _installed.add(sig)
    _handlers_pid[:] = [os.getpid()]  # a process that checks the flag itself
    return True


def catch_notice_early() -> None:
    """Under a supervisor, catch the notice signal from ``import ckrun`` on.

    The supervisor delivers a notice as SIGTERM when no process catches the notice
    signal (a script without the library); a library user that is still importing
    torch when the notice comes must not be taken for one.  Only the notice signal:
    SIGTERM keeps its default until :func:`install_signal_handlers`, so a script that
    imports ckrun but never checks the flag still stops on TERM.
    """
    if not (control_dir() and os.environ.get("CKRUN_SUPERVISOR_PID")):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    sig = notice_signal()
    if sig not in _installed and signal.getsignal(sig) is signal.SIG_DFL:
        signal.signal(sig, _handler)
        _installed.add(sig)


def received_signals() -> list[int]:
    """Signal numbers received by the handler so far (for logs and tests)."""
    return list(received)
