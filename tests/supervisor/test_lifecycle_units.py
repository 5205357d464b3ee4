"""Issue 11, the pieces below the loop: library-side liveness (items 2, 8, 10), notice
plausibility (item 5) and once-per-process signalling (item 9); real processes and
signals where a process is involved."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckrun import control
from ckrun.notices import PREEMPTION, Notice, believed_lead
from ckrun.supervisor import process
from sv_helpers import gone

PY = sys.executable


# ------------------------------------------------------------------- item 2
def test_a_worker_importing_ckrun_follows_its_dead_parent(tmp_path: Path) -> None:
    # torchrun-style: the worker's parent is not the supervisor; `import ckrun` under a
    # supervisor sets PR_SET_PDEATHSIG, so the worker dies with its parent
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path), CKRUN_SUPERVISOR_PID=str(os.getpid()))
    parent = subprocess.Popen(
        [PY, "-c",
         "import subprocess, sys, time\n"
         "w = subprocess.Popen([sys.executable, '-c', 'import ckrun, time; print(1, flush=True); "
         "time.sleep(60)'], stdout=subprocess.PIPE)\n"
         "w.stdout.readline(); print(w.pid, flush=True); time.sleep(60)\n"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    worker = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert gone(worker, 5.0), "the worker outlived its parent"


def test_spawned_child_gets_term_when_the_supervisor_dies(tmp_path: Path) -> None:
    # process.spawn sets PR_SET_PDEATHSIG (SIGTERM) before the exec
    prog = (
        "import os, sys, time\n"
        "from ckrun.supervisor import process\n"
        "c = process.spawn(['sleep', '60'], dict(os.environ))\n"
        "print(c.pid, flush=True); time.sleep(60)\n"
    )
    sup = subprocess.Popen([PY, "-c", prog], stdout=subprocess.PIPE, text=True)
    assert sup.stdout is not None
    child = int(sup.stdout.readline())
    sup.kill()
    sup.wait()
    assert gone(child, 5.0)


def test_spawn_of_a_missing_command_raises_in_the_parent() -> None:
    with pytest.raises(OSError, match="cannot run 'no-such-command-ckrun'"):
        process.spawn(["no-such-command-ckrun"], dict(os.environ))


def test_the_library_saves_when_its_supervisor_is_gone(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists
    prog = "import ckrun\nprint(ckrun.preemption_requested(), flush=True)\n"
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path), CKRUN_SUPERVISOR_PID=str(dead.pid))
    r = subprocess.run([PY, "-c", prog], env=env, capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "True", r.stderr
    assert "supervisor (pid" in r.stderr
    env["CKRUN_SUPERVISOR_PID"] = str(os.getpid())  # alive: no notice
    r = subprocess.run([PY, "-c", prog], env=env, capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "False", r.stderr


# ------------------------------------------------------------------- item 8 / 10
def test_excepthook_records_why_it_exits(tmp_path: Path) -> None:
    prog = (
        "from ckrun.checkpoint.env import install_excepthook\n"
        "from ckrun.errors import IncompatibleCheckpoint\n"
        "install_excepthook()\n"
        "raise IncompatibleCheckpoint('config.lr: 1 -> 2')\n"
    )
    control.reserve_exit_reason(str(tmp_path))
    assert control.read_exit_reason(str(tmp_path)) is None  # reserved, blank
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path))
    r = subprocess.run([PY, "-c", prog], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 4
    rec = control.read_exit_reason(str(tmp_path))
    assert rec is not None and rec["reason"] == "incompatible" and "config.lr" in rec["message"]


def test_a_plain_exit_4_leaves_no_record(tmp_path: Path) -> None:
    control.reserve_exit_reason(str(tmp_path))
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(tmp_path))
    r = subprocess.run([PY, "-c", "import ckrun, sys; sys.exit(4)"], env=env, timeout=30)
    assert r.returncode == 4 and control.read_exit_reason(str(tmp_path)) is None


def test_the_reserved_record_is_written_in_place(tmp_path: Path) -> None:
    # overwriting the reserved bytes needs no new blocks (a full disk still gets it)
    control.reserve_exit_reason(str(tmp_path))
    path = tmp_path / control.EXIT_REASON_FILE
    ino = path.stat().st_ino
    control.write_exit_reason("storage_full", 5, "no space left", cdir=str(tmp_path))
    assert path.stat().st_ino == ino and path.stat().st_size == control.EXIT_REASON_BYTES
    rec = control.read_exit_reason(str(tmp_path))
    assert rec is not None and rec["reason"] == "storage_full"


# ------------------------------------------------------------------- item 5
T = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize(
    "stated_s,window_s,lead_s,skewed",
    [
        (110.0, 120.0, 110.0, False),  # AWS, detected 10 s late: believed
        (-300.0, 120.0, 120.0, True),  # 5 minutes in the past: the window from detection
        (2.0, 120.0, 120.0, True),  # implausibly close
        (3600.0, 30.0, 30.0, True),  # beyond GCP's 30 s
        (25.0, 30.0, 25.0, False),
        (-5.0, None, 0.0, False),  # local sources (signals) are believed as they are
    ],
)
def test_believed_lead(
    stated_s: float, window_s: float | None, lead_s: float, skewed: bool
) -> None:
    n = Notice(PREEMPTION, "aws", T, T + dt.timedelta(seconds=stated_s))
    lead, msg = believed_lead(n, window_s)
    assert lead == lead_s and (msg is not None) == skewed


# ------------------------------------------------------------------- item 9
COUNTER = r"""
import os, signal, sys, time
n = [0]
signal.signal(signal.SIGRTMIN, lambda *a: n.__setitem__(0, n[0] + 1))
if os.fork() == 0:  # a second process in the same group and session
    n[0] = 0
open(sys.argv[1] + "." + str(os.getpid()), "w").close()
deadline = time.monotonic() + 10
while time.monotonic() < deadline and n[0] == 0:
    time.sleep(0.01)
time.sleep(0.3)  # a second (queued, real-time) delivery would arrive by now
os.write(1, f"{os.getpid()} {n[0]}\n".encode())  # one write: lines never interleave
"""


def test_a_session_signal_reaches_each_process_once(tmp_path: Path) -> None:
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    child = process.spawn(
        [PY, "-c", COUNTER, str(tmp_path / "ready")], dict(os.environ), output_fd=out
    )
    os.close(out)
    end = time.monotonic() + 20
    while len(list(tmp_path.glob("ready.*"))) < 2 and time.monotonic() < end:
        time.sleep(0.02)
    process.signal_session(child, signal.SIGRTMIN)  # real-time: two sends, two deliveries
    end = time.monotonic() + 20
    while time.monotonic() < end and process.session_pids(child.pid):
        process.reap()
        time.sleep(0.02)
    process.reap()
    text = (tmp_path / "out").read_text()
    rows = [line.split() for line in text.splitlines()]
    counts = [int(r[1]) for r in rows if len(r) == 2 and r[0].isdigit() and r[1].isdigit()]
    assert counts == [1, 1], f"each process's 'pid deliveries' line expected; output:\n{text}"
