"""A notice that reaches ``ckrun run`` while it starts is held, not fatal.

Slurm sends the ``--signal`` warning at its first check once a job is within
``lead + 30`` s of its end, which for a ``--time`` under ``lead + 30`` s is the moment
the step starts;
before the hold, the default action of USR1 killed the supervisor (the job ended FAILED,
never requeued).  Real processes and real signals; the wait for another owner's lease
is the deterministic window before the supervisor's inbox is installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ckrun.checkpoint.lease import Lease
from ckrun.notice_hold import is_supervisor_argv
from ckrun.storage.local import LocalStorage
from sv_helpers import Ckrun, events

Start = Callable[..., Ckrun]
PY = sys.executable


@pytest.mark.parametrize(
    ("argv", "held"),
    [
        ([PY, "/venv/bin/ckrun", "run", "--run", "r", "--", "python", "t.py"], True),
        ([PY, "-m", "ckrun", "run", "--run", "r"], True),
        ([PY, "-u", "-X", "importtime", "-m", "ckrun.cli", "run"], True),
        ([PY, "/venv/bin/ckrun", "status", "r"], False),
        ([PY, "/venv/bin/ckrun", "--help"], False),
        ([PY, "-m", "ckrun", "submit", "train.py"], False),
        ([PY, "train.py", "run"], False),  # a training script that imports ckrun
        ([PY, "-c", "import ckrun", "ckrun", "run"], False),
        ([PY, "-m", "pytest", "ckrun", "run"], False),
        ([PY], False),
    ],
)
def test_only_the_supervisor_command_holds(argv: list[str], held: bool) -> None:
    assert is_supervisor_argv(argv) is held


def test_a_notice_while_the_supervisor_starts_is_held_and_the_command_never_starts(
    tmp_path: Path, procs: Start
) -> None:
    rival = Lease(LocalStorage(str(tmp_path / "runs" / "r")), "r", ttl_s=60)
    rival.acquire()  # another owner: `ckrun run` waits before its inbox is installed
    sup = procs(["run", "--run", "r", "--storage", "runs", "--wait-for-lease", "60", "--",
                 PY, "-c", "print('trained', flush=True)"], tmp_path)  # fmt: skip
    evs = tmp_path / "runs" / "r"
    sup.wait_line(r"waiting up to 60 s for its lease")
    assert sup.proc is not None
    sup.proc.send_signal(signal.SIGUSR1)  # the notice signal (default CKRUN_NOTICE_SIGNAL)
    time.sleep(1.0)
    assert sup.proc.poll() is None, f"the supervisor died of the notice:\n{sup.text}"
    rival.release()
    assert sup.wait() == 0, sup.text
    kinds = [(e["kind"], e.get("source")) for e in events(evs) if e["kind"] != "supervisor_start"]
    # taken before the start decision: no command is started only to be stopped at once
    assert kinds[:3] == [("notice", "signal:SIGUSR1"), ("preempted", None), ("requeue", None)]
    assert "during preflight: the command will not start" in sup.text
    assert [k for k, _ in kinds].count("spawn") == 1 and kinds[-1] == ("supervisor_exit", None)
    assert "trained" in sup.text  # the run went on: requeued here, then completed


HELD = textwrap.dedent(
    """
    import os, signal, sys
    from ckrun import notice_hold
    assert notice_hold.hold_if_supervisor([sys.executable, "/venv/bin/ckrun", "run"])
    os.kill(os.getpid(), signal.SIGUSR1)  # arrives while ckrun run starts
    from ckrun.supervisor.signals import SignalInbox
    inbox = SignalInbox(getattr(signal, sys.argv[1]))
    restore = inbox.install(restore_signals=True)
    print([signal.Signals(s).name for s in inbox.take()], flush=True)
    restore()
    """
)


def test_the_inbox_takes_what_was_held_and_defaults_what_it_does_not_handle(
    tmp_path: Path,
) -> None:
    def run(notice: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "CKRUN_NOTICE_SIGNAL"}
        return subprocess.run([PY, "-c", HELD, notice], capture_output=True, text=True,
                              timeout=60, env=env, cwd=tmp_path)  # fmt: skip

    ours = run("SIGUSR1")
    assert ours.returncode == 0 and ours.stdout.strip() == "['SIGUSR1']", ours.stderr
    # the run's notice signal is USR2: a held USR1 does what it would have done unheld
    other = run("SIGUSR2")
    assert other.returncode == -signal.SIGUSR1, (other.returncode, other.stderr)
