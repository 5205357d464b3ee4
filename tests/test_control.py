"""The supervisor ↔ child control channel, with real processes and real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckrun import control
from ckrun.notices import DRILL, Notice
from ckrun.supervisor.rundir import RunDir

CHILD = r"""
import os, sys, time, ckrun
ckrun.install_signal_handlers()
print("ready", flush=True)
deadline = time.monotonic() + 20
n = 0
while time.monotonic() < deadline:
    n += 1
    if ckrun.preemption_requested():
        print("flag", n, ckrun.control.received_signals(), flush=True)
        sys.exit(75)
    time.sleep(0.005)
sys.exit(3)
"""


def _spawn(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    full = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path / "control"), **env)
    p = subprocess.Popen([sys.executable, "-c", CHILD], env=full, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_flag_instead_of_killing(tmp_path: Path, sig: signal.Signals) -> None:
    p = _spawn(tmp_path)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=20)
    assert p.returncode == 75
    assert out.startswith("flag") and str(int(sig)) in out


def test_configured_notice_signal(tmp_path: Path) -> None:
    p = _spawn(tmp_path, CKRUN_NOTICE_SIGNAL="USR2")
    p.send_signal(signal.SIGUSR2)
    p.communicate(timeout=20)
    assert p.returncode == 75


def test_notice_file_alone_sets_flag(tmp_path: Path) -> None:
    p = _spawn(tmp_path)
    control.write_notice(str(tmp_path / "control"), Notice.with_lead(DRILL, "test", 30))
    p.communicate(timeout=20)
    assert p.returncode == 75


def test_sigterm_after_escalation_is_fatal(tmp_path: Path) -> None:
    p = _spawn(tmp_path)
    control.write_escalation(str(tmp_path / "control"))
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=20)
    assert p.returncode == -signal.SIGTERM


STUCK = r"""
import os, sys, threading, time, ckrun
ckrun.install_signal_handlers()
def stuck_in_save():  # a save that never returns (a dead mount, a lost collective)
    threading.Event().wait()
if os.fork() == 0:  # a forked worker inherits the handlers: it must not dump too
    time.sleep(60)
    os._exit(0)
print("ready", flush=True)
while not ckrun.preemption_requested():
    time.sleep(0.005)
print("saving", flush=True)
stuck_in_save()
"""


def _wait_asleep(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid``'s main thread has slept (state S) on two reads 50 ms apart."""
    deadline, asleep = time.monotonic() + timeout_s, 0
    while asleep < 2 and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        asleep = asleep + 1 if state == b"S" else 0
        time.sleep(0.05)
    assert asleep >= 2, f"pid {pid} never slept"


def test_a_process_past_the_grace_period_says_where_it_hangs(tmp_path: Path) -> None:
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path / "control"))
    (tmp_path / "stuck.py").write_text(STUCK)
    p = subprocess.Popen([sys.executable, str(tmp_path / "stuck.py")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGUSR1)  # the notice: the flag is set, the "save" hangs
    assert p.stdout.readline().strip() == "saving"
    _wait_asleep(p.pid)  # in stuck_in_save's wait, not still between the print and it
    control.write_escalation(str(tmp_path / "control"))
    os.killpg(p.pid, signal.SIGTERM)  # the grace period is over: TERM to the group
    _, err = p.communicate(timeout=20)
    assert p.returncode == -signal.SIGTERM
    assert err.count("did not exit within the supervisor's grace period") == 1, err
    assert f"pid {p.pid} did not exit" in err
    assert f'File "{tmp_path / "stuck.py"}", line 5 in stuck_in_save' in err, err


DUMP_TO = r"""
import os, sys
from ckrun import control
fd = int(sys.argv[1])
control.dump_stacks(fd)
os.write(fd, b"<end>")
"""


def test_the_stack_dump_is_one_write_no_other_writer_can_split() -> None:
    # fd 2 is shared with the supervisor's lines and the job's other processes, which all
    # dump at the same TERM: a SOCK_SEQPACKET socket keeps each write(2) as one record,
    # so the records received are the writes made (faulthandler alone writes in pieces).
    # The dump runs in its own process: it holds its GIL while it writes, so a reader in
    # the same process could not drain the socket's buffer of small records.
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with reader, writer:
        p = subprocess.Popen([sys.executable, "-c", DUMP_TO, str(writer.fileno())],
                             pass_fds=(writer.fileno(),))  # fmt: skip
        reader.settimeout(20)
        records = list(iter(lambda: reader.recv(1 << 20), b"<end>"))  # b"": a write too
        assert p.wait(timeout=20) == 0
    assert len(records) == 1, records
    text = records[0].decode()
    assert text.startswith(f"ckrun: pid {p.pid} did not exit within"), text
    assert "most recent call first" in text and 'File "<string>", line 5' in text, text


def test_a_plain_sigterm_writes_no_stacks(tmp_path: Path) -> None:
    full = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path / "control"))
    p = subprocess.Popen([sys.executable, "-c", CHILD], env=full, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)  # no escalation mark: a notice, not the end
    out, err = p.communicate(timeout=20)
    assert p.returncode == 75 and out.startswith("flag")
    assert "grace period" not in err and "most recent call first" not in err, err


def test_a_notice_defers_the_writer_probe(tmp_path: Path) -> None:
    """The first save of a fresh machine is often the emergency one: it must not first
    write the probe's 144 MiB (a slow volume: longer than the save itself)."""
    code = (
        "import os, signal, time, ckrun\n"
        "from ckrun.storage.local import LocalStorage\n"
        "ckrun.install_signal_handlers()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "while not ckrun.preemption_requested(): time.sleep(0.01)\n"
        "print(LocalStorage(os.environ['RUN_ROOT']).writer_choice().source)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CKRUN_WRITER"}
    env.update(CKRUN_CONTROL_DIR=str(tmp_path / "control"), RUN_ROOT=str(tmp_path / "run"),
               CKRUN_CACHE_DIR=str(tmp_path / "cache"))  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "deferred" and not (tmp_path / "cache").exists()


def test_no_handlers_outside_supervisor() -> None:
    code = (
        "import ckrun, signal; ckrun.preemption_requested(); "
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    )
    env = {k: v for k, v in os.environ.items() if k != "CKRUN_CONTROL_DIR"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "True"


def test_drill_at_checks_per_attempt(tmp_path: Path) -> None:
    for attempt, count in [(0, 7), (1, 3)]:
        start = time.monotonic()
        p = _spawn(tmp_path, CKRUN_DRILL_AT_CHECKS="7,3", CKRUN_ATTEMPT=str(attempt))
        out, _ = p.communicate(timeout=20)
        assert p.returncode == 75, out
        assert out.split()[1] == str(count)
        assert time.monotonic() - start < 15
        body = json.loads((tmp_path / "control" / "notice.json").read_text())
        assert body["kind"] == DRILL and body["source"] == "check-resume"
        control.clear(str(tmp_path / "control"))


REENTRANT = r"""
import os, signal, sys, threading
from ckrun import control
control.install_signal_handlers(force=True)
fired = []
def tracer(frame, event, arg):  # the notice signal lands while the flag is being set
    name, me = frame.f_code.co_name, frame.f_locals.get("self")
    if event == "call" and not fired and (
        name == "notify_all"  # a threading.Event's set, holding its lock
        or (name == "set" and me is control._flag and not isinstance(me, threading.Event))
    ):
        fired.append(name)
        os.kill(os.getpid(), signal.SIGUSR1)
sys.settrace(tracer)
control._notice_reached()  # the main thread saw notice.json
sys.settrace(None)
print(fired, control.notice_pending(), control.received_signals(), flush=True)
"""


def test_the_notice_signal_during_the_flag_set_does_not_deadlock(tmp_path: Path) -> None:
    """The supervisor writes notice.json and then signals: the main thread can be inside
    the flag's set when the handler runs and sets it again (a threading.Event's lock
    deadlocked there: no emergency save, the KILL at the deadline)."""
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", REENTRANT], capture_output=True, text=True,
                       timeout=20, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("]", 1)[1].strip() == f"True [{int(signal.SIGUSR1)}]", r.stdout


def test_the_control_channel_never_waits_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush of notice.json would first wait for every other writer's dirty data (an
    async persist in flight: seconds), and the notice signal is sent after it."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    control.write_notice(str(tmp_path), Notice.with_lead("preemption", "gcp", 30))
    control.write_escalation(str(tmp_path))
    rd = RunDir(str(tmp_path / "state"))  # `ckrun preempt` asks the live supervisor
    rd.request("preempt.json", {"reason": "test"})
    assert synced == []
    assert rd.take_request("preempt.json") == {"reason": "test"}
    assert control.read_notice(str(tmp_path)) is not None
    assert (tmp_path / control.ESCALATE_FILE).exists()


def test_notice_round_trip(tmp_path: Path) -> None:
    n = Notice.with_lead("preemption", "aws", 120, {"action": "terminate"})
    control.write_notice(str(tmp_path), n)
    back = control.read_notice(str(tmp_path))
    assert back is not None and back.kind == n.kind and back.detail == n.detail
    assert abs((back.deadline_utc - n.deadline_utc).total_seconds()) < 0.002
    (tmp_path / control.NOTICE_FILE).write_text("{not json")
    assert control.read_notice(str(tmp_path)) is None
