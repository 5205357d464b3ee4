"""Starting a command in a session of its own, and the ``prctl(2)`` calls around it.

The one place ckrun forks and execs.  Two callers, one mechanism:

* the local backend's detached supervisor (:func:`ckrun.scheduler.local.spawn_detached`):
  ``death_signal=0``, nothing ties its life to the process that submitted it;
* the supervisor's training child (:func:`ckrun.supervisor.process.spawn`):
  ``death_signal=SIGTERM``, it follows a supervisor that dies (``PR_SET_PDEATHSIG``).

Both start the command as leader of a new session and process group (``setsid``: no
controlling terminal, so terminal signals reach only the parent), with the dispositions
of :data:`RESET_SIGNALS` back to their defaults and an empty signal mask, and optionally
stdout and stderr on one descriptor.  ``fork`` + ``execvpe`` (not ``posix_spawn``) so the
child can call ``prctl`` between the two; an exec failure comes back through a
close-on-exec pipe and raises in the parent (Linux ``prctl(2)``, ``setsid(2)``,
``execve(2)``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import warnings
from collections.abc import Mapping, Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37

#: Signals reset to their default action in a started command (Python ignores SIGPIPE
#: and SIGXFSZ; the parent may have handlers or ignores for the rest).
RESET_SIGNALS = tuple(
    getattr(signal, n)
    for n in (
        "SIGPIPE",
        "SIGXFSZ",
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGCHLD",
        "SIGALRM",
    )
    if hasattr(signal, n)
)


def prctl(option: int, arg: object = 0) -> bool:
    """``prctl(option, arg, 0, 0, 0)`` through libc.

    Args:
        option: a ``PR_*`` constant of ``<linux/prctl.h>``.
        arg: its integer argument, or a pointer (``ctypes.byref``) for a ``PR_GET_*``.

    Returns:
        True when the call returned 0; False when it failed or there is no ``prctl``
        (not Linux).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return bool(libc.prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``: this process gets ``sig`` when its parent dies.

    Returns:
        True when set (Linux); False elsewhere.
    """
    return prctl(PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ≥ 3.4,
    ``PR_SET_CHILD_SUBREAPER``).

    Returns:
        True when set (or when this process is PID 1, which reaps orphans anyway);
        False on other systems.
    """
    if os.getpid() == 1:
        return True
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def is_subreaper() -> bool:
    """True when ``PR_GET_CHILD_SUBREAPER`` reports this process is a subreaper."""
    out = ctypes.c_int(0)
    return prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(out)) and bool(out.value)


def spawn_session(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    output_fd: int | None = None,
    stdio: Sequence[int | None] = (),
    death_signal: int = 0,
) -> int:
    """Start ``argv`` as leader of a new session with environment ``env``; its pid.

    Args:
        argv: the command; ``argv[0]`` is looked up on ``PATH`` of ``env``.
        env: the complete environment of the command.
        output_fd: when given, the command's stdout and stderr go to this descriptor;
            otherwise they are inherited.
        stdio: descriptors for the command's stdout and stderr, in that order (None:
            inherited), e.g. an output relay's (:mod:`ckrun.supervisor.relay`).
        death_signal: signal the command gets when this process dies
            (``PR_SET_PDEATHSIG``, set before the exec; a parent that died before it was
            set makes the command exit ``128 + death_signal`` without running); 0: none,
            the command outlives this process.

    Raises:
        OSError: the command cannot be executed (``ENOENT``, ``EACCES``); the message
            names the command.  Its errno is the exec's.
    """
    argv = list(argv)
    env = dict(env)
    parent = os.getpid()
    r, w = os.pipe()  # both close-on-exec (PEP 446)
    with warnings.catch_warnings():  # 3.12+ warns about fork() with threads; we exec at once
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, replaced by the exec
        code = 0
        try:
            os.close(r)
            os.setsid()
            if death_signal:
                set_parent_death_signal(death_signal)
                if os.getppid() != parent:  # the parent died before the prctl
                    os._exit(128 + int(death_signal))
            for sig in RESET_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            if output_fd is not None:
                os.dup2(output_fd, 1)
                os.dup2(output_fd, 2)
            for target, fd in zip((1, 2), stdio, strict=False):
                if fd is not None:
                    os.dup2(fd, target)
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            code = e.errno or 1
        except BaseException:
            code = 1
        try:
            os.write(w, str(code).encode())
        finally:
            os._exit(127)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        failed = f.read()
    if failed:
        os.waitpid(pid, 0)
        err = int(failed or b"1")
        raise OSError(err, f"cannot run {argv[0]!r}: {os.strerror(err)}")
    return pid
