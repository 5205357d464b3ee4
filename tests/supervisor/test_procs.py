"""One owner for starting processes (ckrun.procs), real processes and signals: the local
backend's detached supervisor outlives the process that started it (the supervisor's
child, which follows its dead parent: test_lifecycle_units.py); and no other module
forks or execs."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckrun import procs
from sv_helpers import gone

PY = sys.executable
RUNNER = Path(__file__).resolve().parents[2] / "runner"


def test_the_detached_supervisor_outlives_its_starter(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    prog = (
        "import os, sys, time\n"
        "from ckrun.scheduler.local import spawn_detached\n"
        f"fd = os.open({str(log)!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)\n"
        "d = spawn_detached(['sh', '-c', 'echo detached; exec sleep 60'], dict(os.environ),"
        " output_fd=fd)\n"
        "print(d, flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen([PY, "-c", prog], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    detached = int(parent.stdout.readline())
    try:
        # it leads a session of its own (no controlling terminal, own process group)
        assert os.getsid(detached) == detached and os.getpgid(detached) == detached
        parent.kill()
        parent.wait()
        assert not gone(detached, 0.5), "the detached supervisor died with its starter"
        end = time.monotonic() + 5
        while time.monotonic() < end and "detached" not in log.read_text():
            time.sleep(0.02)
        assert log.read_text() == "detached\n"  # stdout went to output_fd
    finally:
        try:
            os.kill(detached, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_started_command_has_default_dispositions_and_no_blocked_signals(
    tmp_path: Path,
) -> None:
    out = tmp_path / "status"
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            pid = procs.spawn_session(["cat", "/proc/self/status"], os.environ, output_fd=fd)
        finally:
            os.close(fd)
    finally:
        signal.signal(signal.SIGUSR1, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    fields = dict(ln.split(":", 1) for ln in out.read_text().splitlines() if ":" in ln)
    assert int(fields["SigIgn"], 16) >> (signal.SIGUSR1 - 1) & 1 == 0
    assert int(fields["SigBlk"], 16) == 0


def test_a_missing_command_raises_in_the_parent_with_its_errno() -> None:
    with pytest.raises(OSError, match="cannot run 'no-such-command-ckrun'") as e:
        procs.spawn_session(["no-such-command-ckrun"], os.environ)
    assert e.value.errno == 2  # ENOENT, from the exec in the child


# Calls that start a process in a new session: only ckrun.procs makes them.
SPAWN_CALLS = {"fork", "forkpty", "posix_spawn", "posix_spawnp", "setsid", "execv", "execve"}
SPAWN_CALLS |= {"execvp", "execvpe", "execl", "execle", "execlp", "execlpe"}


def test_only_procs_forks_or_execs() -> None:
    found = []
    for path in sorted(RUNNER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in SPAWN_CALLS
            ):
                found.append(f"{path.relative_to(RUNNER)}:{node.lineno}: os.{node.attr}")
    assert found and all(f.startswith("procs.py:") for f in found), found
