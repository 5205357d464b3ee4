"""The process layer with real processes and real signals: sessions, 128+N, reaping."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
from ckrun.supervisor import process

ENV = dict(os.environ)


def wait_for(cond: Callable[[], object], timeout: float = 10.0) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.01)
    raise AssertionError("condition not met within the timeout")


def reap_pid(pid: int, timeout: float = 10.0) -> int:
    got: dict[int, int] = {}

    def done() -> bool:
        got.update(process.reap())
        return pid in got

    wait_for(done, timeout)
    return got[pid]


def test_child_gets_its_own_session_and_status() -> None:
    c = process.spawn([sys.executable, "-c", "import os,sys; sys.exit(3)"], ENV)
    assert reap_pid(c.pid) == 3
    c = process.spawn(["sleep", "30"], ENV)
    wait_for(lambda: process.session_pids(c.pid))
    with open(f"/proc/{c.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    assert int(fields[2]) == c.pid and int(fields[3]) == c.pid  # pgrp, session
    assert os.getsid(c.pid) != os.getsid(0)
    process.signal_session(c, signal.SIGKILL)
    assert reap_pid(c.pid) == 128 + signal.SIGKILL


def test_exit_status_convention() -> None:
    assert process.exit_status(3 << 8) == 3
    assert process.exit_status(int(signal.SIGTERM)) == 128 + signal.SIGTERM


def test_group_signal_reaches_grandchildren() -> None:
    c = process.spawn(["bash", "-c", "sleep 60 & sleep 60 & wait"], ENV)
    wait_for(lambda: len(process.session_pids(c.pid)) == 3)
    process.signal_session(c, signal.SIGTERM)
    assert reap_pid(c.pid) in (0, 128 + signal.SIGTERM)
    wait_for(lambda: not process.session_alive(c))


CATCHER = textwrap.dedent("""
    import signal, sys, time
    got = []
    signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    print("ready", flush=True)
    end = time.monotonic() + 20
    while not got and time.monotonic() < end:
        time.sleep(0.005)
    print("caught" if got else "timeout", flush=True)
""")


def test_notice_goes_to_catching_grandchild_not_to_the_shell(tmp_path: object) -> None:
    r, w = os.pipe()
    script = f"{sys.executable} -c '{CATCHER}'; echo shell-alive"
    c = process.spawn(["bash", "-c", script], ENV, output_fd=w)
    os.close(w)
    with os.fdopen(r) as out:
        assert out.readline().strip() == "ready"
        sent = process.deliver(c, signal.SIGUSR1)
        assert len(sent) == 1 and sent[0] != c.pid  # the python grandchild, not bash
        assert out.readline().strip() == "caught"
        assert out.readline().strip() == "shell-alive"
    assert reap_pid(c.pid) == 0


def test_deliver_spares_processes_without_a_handler() -> None:
    c = process.spawn(["sleep", "30"], ENV)
    wait_for(lambda: process.session_pids(c.pid))
    assert process.deliver(c, signal.SIGUSR1) == []
    time.sleep(0.1)
    assert process.session_alive(c)
    process.signal_session(c, signal.SIGKILL)
    reap_pid(c.pid)


SUBREAPER = textwrap.dedent("""
    import json, os, sys, time
    from ckrun import procs
    from ckrun.supervisor import process
    ok = procs.become_subreaper()
    c = process.spawn(["sh", "-c", "sleep 0.3 & sleep 0.3 & exit 0"], os.environ)
    relay = c.relay.pid if c.relay is not None else None  # stdout is a pipe: relayed
    reaped = {}
    end = time.monotonic() + 10
    while len(reaped) < 3 + (relay is not None) and time.monotonic() < end:
        reaped.update(process.reap())
        time.sleep(0.01)
    reaped.pop(relay, None)
    print(json.dumps({"ok": ok, "sub": procs.is_subreaper(), "child": c.pid,
                      "reaped": reaped, "alive": process.session_alive(c), "relay": relay}))
""")


def test_subreaper_reaps_orphaned_grandchildren() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SUBREAPER], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    res = json.loads(out)
    assert res["ok"] and res["sub"]
    assert res["reaped"][str(res["child"])] == 0
    assert len(res["reaped"]) == 3  # the child and its two orphaned sleepers
    assert res["alive"] is False
    assert res["relay"] is not None  # the relay of the piped output, reaped too


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_as_pid1_in_a_pid_namespace() -> None:
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip("cannot create a PID namespace here: " + probe.stderr.decode()[:200])
    code = SUBREAPER.replace("print(json.dumps({", "print(json.dumps({'pid': os.getpid(), ")
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    res = json.loads(out)
    assert res["pid"] == 1 and res["ok"]
    assert len(res["reaped"]) == 3


RELAY_EDGES = textwrap.dedent("""
    import json, os, sys, time
    from ckrun.supervisor import process, relay
    def open_fds():
        out = set()
        for f in os.listdir("/proc/self/fd"):  # (the listing's own descriptor is gone)
            try:
                out.add((f, os.readlink(f"/proc/self/fd/{f}")))
            except OSError:
                pass
        return out
    fds = open_fds()
    try:  # a command that cannot start: the relay started first sees EOF and exits
        process.spawn(["/nonexistent/cmd"], os.environ)
    except OSError:
        pass
    reaped, end = {}, time.monotonic() + 10
    while not reaped and time.monotonic() < end:
        reaped = process.reap()
        time.sleep(0.01)
    try:
        os.waitpid(-1, os.WNOHANG)
        no_child_left = False
    except ChildProcessError:
        no_child_left = True
    leaked = open_fds() != fds
    sys.executable = "/bin/false"  # a relay that exits before it runs: no handshake
    c = process.spawn(["sh", "-c", "echo straight to the console"], os.environ)
    while c.pid not in process.reap():
        time.sleep(0.01)
    print(json.dumps({"relay_exited": len(reaped) == 1 and no_child_left,
                      "leaked": leaked, "unrelayed": c.relay is None,
                      "fds_after": open_fds() == fds}))
""")


def test_the_relay_never_blocks_a_start() -> None:
    """A command that cannot start leaves no relay process and no descriptor behind; a
    relay that does not confirm it runs (here its interpreter exits at once) leaves the
    command writing to the console itself, as before the relay existed: its first
    print would otherwise have hit a pipe nobody reads."""
    out = subprocess.run(
        [sys.executable, "-c", RELAY_EDGES], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "straight to the console" in lines, out.stdout
    res = json.loads(lines[-1])
    assert res == {"relay_exited": True, "leaked": False, "unrelayed": True, "fds_after": True}
    assert "output is not relayed (" in out.stderr, out.stderr  # said, with the reason


def test_a_terminal_that_hung_up_is_still_relayed() -> None:
    """After an SSH session drops, the supervisor's terminal answers EIO and isatty() is
    False; a later attempt given that terminal would die on its first print.  It is
    still relayed (and so are pipes); files and sockets are not."""
    import pty
    import socket

    from ckrun.supervisor.relay import _kind

    master, slave = pty.openpty()
    assert _kind(slave) == "pty"
    os.close(master)  # the other side hangs up
    try:
        assert _kind(slave) == "pty"
    finally:
        os.close(slave)
    r, w = os.pipe()
    a, b = socket.socketpair()
    try:
        assert _kind(w) == "pipe" and _kind(a.fileno()) is None
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()
    with open(os.devnull, "wb") as f:
        assert _kind(f.fileno()) is None


WAITERS = r"""
import os, sys, threading, time
for _ in range(int(sys.argv[1])):  # more processes in the session
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
for _ in range(2):  # two threads asleep beside the main thread
    threading.Thread(target=threading.Event().wait, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("forks", [0, process.WAITS_SHOWN + 2])
def test_waits_groups_each_process_threads_by_state(forks: int) -> None:
    p = subprocess.Popen([sys.executable, "-c", WAITERS, str(forks)], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        child = process.Child(pid=p.pid, argv=(), started=0.0)
        deadline = time.monotonic() + 10
        while True:  # until every process sleeps (the main thread has just printed)
            lines = process.waits(child)
            if " R" not in "".join(lines) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        mine = [x for x in lines if x.startswith(f"pid {p.pid} (python")]
        # the two Event waits (and the main thread's sleep: one group without wait channels)
        assert len(mine) == 1 and ("2 threads S" in mine[0] or "3 threads S" in mine[0]), lines
        counts = [int(g.split()[0]) for g in mine[0].split(": ", 1)[1].split(", ")]
        assert sum(counts) == 3, lines
        assert len(lines) == min(forks + 1, process.WAITS_SHOWN + 1)
        if forks > process.WAITS_SHOWN:
            assert lines[-1] == f"+{forks + 1 - process.WAITS_SHOWN} more"
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
