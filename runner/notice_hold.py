"""The notice signal held from the supervisor's first import until its inbox takes it.

A notice can reach ``ckrun run`` before the supervisor's signal inbox
(:class:`ckrun.supervisor.signals.SignalInbox`) is installed: while the interpreter
imports ckrun, resolves the configuration, or waits for another owner's lease.  Slurm
sends the ``--signal`` warning at its first periodic check once a job is within
``lead + 30`` s of its end time (sbatch(1) ``--signal``: "up to 60 seconds earlier"),
which for a ``--time`` under ``lead + 30`` s is the moment the step starts; a preemption with
``SlurmctldParameters=preempt_send_user_signal`` can come at any time.  The notice
signal's default action (USR1, USR2: terminate) then killed the supervisor before it
had heard anything: the job ended FAILED, was never requeued, and the notice was lost.

:func:`hold_if_supervisor` runs first in ``ckrun/__init__.py`` (this module imports
nothing but the standard library, so the window left is the interpreter's own start,
tens of milliseconds).  Only when the process is the supervisor (``ckrun run`` or
``python -m ckrun[.cli] run``, read from :data:`sys.orig_argv`) does it catch the notice
signal with a handler that records the signal number; the inbox takes those records at
install (:func:`take`) and the supervisor's loop takes them before it decides to start
the command: a notice that came while the supervisor started keeps the command from
starting, and the attempt is requeued (the state machine's "notice during preflight").
SIGTERM keeps its default, as in the child before
:func:`ckrun.control.install_signal_handlers`: a supervisor that is still starting has
no child yet (at most a lease, which lapses after its TTL), and ``kill`` must still stop
one that waits for a lease.

Environment read here: ``CKRUN_NOTICE_SIGNAL`` (the notice signal's name; default
SIGUSR1, the same default as the run's ``notice_signal``).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

__all__ = ["hold_if_supervisor", "is_supervisor_argv", "notice_signal", "take"]

#: signal numbers caught since :func:`hold_if_supervisor`, oldest first
_held: list[int] = []
#: signals this module's handler is installed for
_holding: set[int] = set()


def _record(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


def is_supervisor_argv(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (an interpreter's :data:`sys.orig_argv`) starts ``ckrun run``.

    Matches ``python .../bin/ckrun run ...`` (the console script) and
    ``python [FLAGS] -m ckrun[.cli] run ...``; ``ckrun --help``, ``ckrun status`` and
    any other program that imports ckrun do not match.
    """
    args, i = list(argv[1:]), 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            module, command = args[i + 1 : i + 2], args[i + 2 : i + 3]
            return module in (["ckrun"], ["ckrun.cli"]) and command == ["run"]
        if arg in ("-c", "-"):  # a program given inline or on stdin
            return False
        if not arg.startswith("-"):  # the script path
            return os.path.basename(arg) == "ckrun" and args[i + 1 : i + 2] == ["run"]
        i += 2 if arg in ("-X", "-W") else 1  # the interpreter options with an argument
    return False


def notice_signal() -> signal.Signals:
    """The notice signal configured for this run (``CKRUN_NOTICE_SIGNAL``, default USR1;
    an unknown name reads as USR1: the run's config names the bad value when it loads).
    The one reader of the variable, for the supervisor's hold and the child's handlers
    (:mod:`ckrun.notice_signals`)."""
    name = os.environ.get("CKRUN_NOTICE_SIGNAL", "SIGUSR1").upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        return signal.SIGUSR1


def hold_if_supervisor(argv: Sequence[str] | None = None) -> bool:
    """In the supervisor's process, catch the notice signal until the inbox takes it.

    Args:
        argv: the command line to test (default :data:`sys.orig_argv`).

    Returns:
        True when the notice signal is now held (or already was).  Nothing changes in
        any other process, off the main thread, or where a handler is already set.
    """
    if not is_supervisor_argv(sys.orig_argv if argv is None else argv):
        return False
    sig = notice_signal()
    if sig in _holding:
        return True
    try:
        if signal.getsignal(sig) is not signal.SIG_DFL:
            return False
        signal.signal(sig, _record)
    except (ValueError, OSError):  # not the main thread; not a catchable signal
        return False
    _holding.add(sig)
    return True


def take() -> list[int]:
    """The held signal numbers, oldest first; empties the record.  The caller installs
    its own handlers *before* taking, so no signal falls between the two."""
    out = list(_held)
    del _held[: len(out)]
    return out
