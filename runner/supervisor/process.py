"""Child processes of the supervisor: spawn, signal, reap (DESIGN.md §3, §4.5).

* :func:`spawn` starts the command in its own session (``setsid``: the child is leader of
  a new session and process group whose id is its pid), with default signal dispositions
  and an empty signal mask, so terminal signals reach only the supervisor, which decides;
  ``PR_SET_PDEATHSIG`` makes it follow a supervisor that dies (the mechanism is
  :func:`ckrun.procs.spawn_session`, shared with the local backend's detached start).
* :func:`deliver` sends the notice signal to every process of the child's session that
  *catches* it (``SigCgt`` in ``/proc/PID/status``): the training process gets it even
  when it is a grandchild (``bash -c 'python train.py; ...'``) while a shell wrapper or a
  DataLoader worker with the default action (terminate) is spared.  Processes that do not
  catch it still see ``notice.json`` (written first).  A child spawned with
  ``track_tree`` (a torchrun launch) also counts its descendants in other sessions and
  their sessions (:func:`members`): torchrun starts every worker with ``setsid``.
* :func:`signal_session` sends TERM / KILL to the child's process group and any other
  process left in its session, once per process.
* :func:`reap` collects every exited child with ``waitpid(-1, WNOHANG)``; the supervisor
  alone waits.  In subreaper mode (:func:`ckrun.procs.become_subreaper`, ``prctl(2)``
  ``PR_SET_CHILD_SUBREAPER``) and as PID 1 orphaned descendants are re-parented to the
  supervisor and reaped here too, so no zombie outlives an attempt.

Exit statuses follow the shell convention: ``0..255`` for a normal exit, ``128 + N`` for
death by signal ``N`` (``os.waitstatus_to_exitcode`` gives ``-N``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckrun import procs
from ckrun.supervisor.relay import OutputRelay, start_relay


@dataclass
class Child:
    """One spawned child (session and process-group leader).

    Attributes:
        pid: its pid; also its session id and process-group id.
        argv: the command it runs.
        started: ``time.monotonic()`` at spawn, seconds.
        status: exit status once reaped (``128 + N`` when killed by signal N).
        exited: ``time.monotonic()`` when reaped.
    """

    pid: int
    argv: tuple[str, ...]
    started: float
    status: int | None = None
    exited: float | None = None
    signalled: list[int] = field(default_factory=list)
    #: Sessions of descendants, tracked when not None (torchrun starts each worker in a
    #: session of its own): see :func:`members`.
    sids: set[int] | None = None
    #: The relay of its stdout and stderr to the supervisor's console, if any
    #: (:mod:`ckrun.supervisor.relay`); joined when the child's session is empty.
    relay: OutputRelay | None = None

    @property
    def pgid(self) -> int:
        """Process-group (and session) id: the child's pid."""
        return self.pid


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    output_fd: int | None = None,
    track_tree: bool = False,
    death_signal: int = signal.SIGTERM,
) -> Child:
    """Start ``argv`` in a new session with environment ``env``.

    :func:`ckrun.procs.spawn_session` with ``PR_SET_PDEATHSIG`` set before the exec: when
    the supervisor dies (SIGKILL, the OOM killer) the child gets ``death_signal``
    (SIGTERM: the library saves and stops; a plain script stops) instead of running on
    as an orphan.  A missing command raises here, in the parent.

    Args:
        argv: the command; ``argv[0]`` is looked up on ``PATH`` of ``env``.
        env: the complete environment of the child.
        output_fd: when given, the child's stdout and stderr go to this descriptor
            (detached mode); otherwise they stream through the supervisor's: relayed
            where that console may go away (a terminal, a pipe), else inherited
            (:mod:`ckrun.supervisor.relay`).
        track_tree: also signal and wait for descendants that left the session
            (torchrun's workers; :func:`members`).
        death_signal: signal sent to the child when the supervisor dies (0: none).

    Raises:
        OSError: the command cannot be executed (``ENOENT``, ``EACCES``); the message
            names the command.
    """
    relay = start_relay() if output_fd is None else None
    try:
        pid = procs.spawn_session(
            argv,
            env,
            output_fd=output_fd,
            stdio=relay.child_fds if relay is not None else (),
            death_signal=death_signal,
        )
    except BaseException:
        if relay is not None:  # no writer ever: the relay sees EOF and exits
            relay.release()
            relay.join()
        raise
    if relay is not None:
        relay.release()  # the child holds its ends now
    return Child(
        pid=pid,
        argv=tuple(argv),
        started=time.monotonic(),
        sids=set() if track_tree else None,
        relay=relay,
    )


def exit_status(wait_status: int) -> int:
    """Shell-style status from a raw ``waitpid`` status: code, or 128+N for signal N."""
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def reap() -> dict[int, int]:
    """Reap every exited child without blocking: pid -> shell-style status."""
    out: dict[int, int] = {}
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        except InterruptedError:  # pragma: no cover - PEP 475 retries; defensive
            continue
        if pid == 0:
            return out
        if os.WIFSTOPPED(st) or os.WIFCONTINUED(st):
            continue
        out[pid] = exit_status(st)


def _read_stat(path: str) -> tuple[bytes, list[bytes]] | None:
    """A ``/proc`` ``stat`` file (proc(5)): the command name and the fields after it
    (state first), undecoded (the loop scans every process each tick), or None when it
    cannot be read (the process or thread is gone)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    end = raw.rfind(b")")  # the name may itself contain ")" or spaces
    return raw[raw.find(b"(") + 1 : end], raw[end + 2 :].split()


def _stat_fields(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgrp, session) of ``pid`` from ``/proc/PID/stat``, or None if gone."""
    st = _read_stat(f"/proc/{pid}/stat")
    rest = st[1] if st is not None else []
    if len(rest) < 4 or rest[0] == b"Z":
        return None  # zombies are not signalled; they are reaped
    return int(rest[1]), int(rest[2]), int(rest[3])


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid`` (scans ``/proc``).

    Returns [] when ``/proc`` is unavailable; callers fall back to ``killpg``.
    """
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for name in names:
        if name.isdigit():
            st = _stat_fields(int(name))
            if st is not None and st[2] == sid:
                out.append(int(name))
    return sorted(out)


def members(child: Child) -> list[int]:
    """Live processes of ``child``'s launch: its session; with ``child.sids`` tracked also
    its descendants and their sessions (:func:`ckrun.supervisor.torchrun.family`, which updates
    ``child.sids``)."""
    if child.sids is None:
        return session_pids(child.pid)
    from ckrun.supervisor.torchrun import family

    return family(child.pid, child.sids)


def catches(pid: int, sig: int) -> bool:
    """True when ``pid`` has a handler installed for ``sig`` (``SigCgt`` mask)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def deliver(child: Child, sig: int) -> list[int]:
    """Send the notice signal ``sig`` to the processes of ``child``'s session that catch it.

    Returns:
        The pids signalled (possibly empty: then only ``notice.json`` informs the child).
    """
    sent = [p for p in members(child) if catches(p, sig) and _kill(p, sig)]
    child.signalled.append(sig)
    return sent


def signal_session(child: Child, sig: int) -> int:
    """Send ``sig`` to ``child``'s process group and every other process in its session.

    Returns:
        How many processes were signalled individually (the group send is not counted).
    """
    try:
        os.killpg(child.pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    child.signalled.append(sig)
    # killpg reached the group; the rest (other groups of the session, a tracked
    # tree's sessions) individually: every process gets the signal once
    return sum(_kill(p, sig) for p in members(child) if _pgrp(p) != child.pgid)


def _pgrp(pid: int) -> int | None:
    st = _stat_fields(pid)
    return st[1] if st is not None else None


def _task_wait(pid: int, tid: str) -> tuple[str, str, str] | None:
    """(comm, state letter, kernel wait channel or "") of thread ``tid`` of ``pid``, or
    None when it is gone.  The wait channel is left out where the kernel does not show
    it (no ``wchan`` file, or ``0``)."""
    st = _read_stat(f"/proc/{pid}/task/{tid}/stat")
    if st is None or not st[1]:
        return None
    try:
        with open(f"/proc/{pid}/task/{tid}/wchan", "rb") as f:
            wchan = f.read().decode(errors="replace").strip()
    except OSError:
        wchan = ""
    comm = "".join(c if c.isprintable() else "?" for c in st[0].decode(errors="replace"))
    return comm, st[1][0].decode(errors="replace"), "" if wchan == "0" else wchan


#: Processes named by :func:`waits` (the rest are counted).
WAITS_SHOWN = 8


def waits(child: Child) -> list[str]:
    """Where each live process of ``child``'s launch is, from ``/proc`` (proc(5)): its
    threads grouped by state and kernel wait channel, e.g. ``"pid 812 (python3):
    1 thread D jbd2_log_wait_commit, 2 threads S futex_do_wait"``.  A thread in ``D``
    (uninterruptible: disk or network file system I/O) names a storage stall; a process
    whose threads all sleep in ``S futex`` waits on a lock or another thread.

    Returns:
        One line per process, at most :data:`WAITS_SHOWN` and then ``"+N more"``
        (empty without ``/proc``).
    """
    out = []
    pids = members(child)
    for pid in pids[:WAITS_SHOWN]:
        try:
            tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
        except OSError:
            continue
        comm, groups = "?", dict[tuple[str, str], int]()
        for tid in tids:
            w = _task_wait(pid, tid)
            if w is None:
                continue
            if tid == str(pid):
                comm = w[0]
            groups[w[1:]] = groups.get(w[1:], 0) + 1
        parts = [
            f"{n} thread{'s' if n > 1 else ''} {st}{' ' + wc if wc else ''}"
            for (st, wc), n in sorted(groups.items(), key=lambda kv: (kv[0][0] != "D", kv[0]))
        ]
        if parts:
            out.append(f"pid {pid} ({comm}): {', '.join(parts)}")
    if len(pids) > WAITS_SHOWN:
        out.append(f"+{len(pids) - WAITS_SHOWN} more")
    return out


def session_alive(child: Child) -> bool:
    """True while any non-zombie process of ``child``'s session exists."""
    if os.path.isdir("/proc/self"):
        return bool(members(child))
    try:
        os.killpg(child.pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
