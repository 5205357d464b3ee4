"""End to end: a real ``ckrun`` supervisor, real children, real signals, real files.

Tests whose child imports torch (child_train.py, ~2 s per attempt on 2 cores) are marked
``slow``; the rest use plain commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ckrun.notices import parse_utc
from sv_helpers import CHILD, Ckrun, events, expected_w, poll

Start = Callable[..., Ckrun]
PY = sys.executable


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "ckrun.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def kinds(root: Path) -> list[str]:
    return [str(e["kind"]) for e in events(root)]


@pytest.mark.slow
def test_preempt_drill_saves_restarts_and_completes_exactly(tmp_path: Path, procs: Start) -> None:
    sup = procs(
        ["submit", "--run", "d", "--storage", "runs", CHILD, "--steps", "60", "--step-s", "0.04",
         "--hold-at", "10"],
        tmp_path,
    )  # fmt: skip
    sup.wait_line(r"^step 10$")
    r = cli(["preempt", "d", "--storage", "runs"], tmp_path)
    assert r.returncode == 0, r.stderr
    saved = int(sup.wait_line(r"^saved (\d+) on notice").group(1))
    assert sup.wait() == 0, sup.text
    assert f"resumed {saved} attempt 1" in sup.text
    done = float(sup.wait_line(r"^done (\S+)").group(1))
    assert done == expected_w(60)  # the interrupted run equals an uninterrupted one
    root = tmp_path / "runs" / "d"
    evs = events(root)
    pre = [e for e in evs if e["kind"] == "preempted"]
    assert len(pre) == 1 and pre[0]["new_checkpoint"] and pre[0]["step"] == saved
    assert [e["attempt"] for e in evs if e["kind"] == "spawn"] == [0, 1]
    st = json.loads(cli(["status", "d", "--storage", "runs", "--json"], tmp_path).stdout)
    assert st["state"] == "COMPLETED" and st["preemptions"] == 1 and st["complete"]
    assert st["interruptions"][0]["lost_steps"] == 0 and 0 < st["goodput"] <= 1
    # Relaunch after completion: exit 0, the child never starts.
    again = cli(["run", "--run", "d", "--storage", "runs"], tmp_path)
    assert again.returncode == 0 and "already complete" in again.stderr
    assert kinds(root).count("spawn") == 2


@pytest.mark.slow
def test_bash_wrapper_still_checkpoints(tmp_path: Path, procs: Start) -> None:
    cmd = f"{PY} {CHILD} --steps 50 --step-s 0.04 --hold-at 5; echo wrapper-done"
    sup = procs(["submit", "--run", "b", "--storage", "runs", "--", "bash", "-c", cmd], tmp_path)
    sup.wait_line(r"^step 5$")
    assert cli(["preempt", "b", "--storage", "runs"], tmp_path).returncode == 0
    sup.wait_line(r"saved \d+ on notice")
    assert sup.wait() == 0, sup.text
    assert "USR1 to 1 process(es)" in sup.text  # the python grandchild, not bash
    pre = [e for e in events(tmp_path / "runs" / "b") if e["kind"] == "preempted"]
    assert pre and pre[0]["new_checkpoint"]
    assert float(sup.wait_line(r"^done (\S+)").group(1)) == expected_w(50)


@pytest.mark.slow
def test_dataloader_workers_survive_sigterm_to_the_group(tmp_path: Path, procs: Start) -> None:
    sup = procs(
        [
            "submit",
            "--run",
            "w",
            "--storage",
            "runs",
            CHILD,
            "--steps",
            "40",
            "--step-s",
            "0.04",
            "--workers",
            "2",
        ],
        tmp_path,
    )
    sup.wait_line(r"^step 5$")
    root = tmp_path / "runs" / "w"
    pid = int(next(e["pid"] for e in events(root) if e["kind"] == "spawn"))
    os.killpg(pid, signal.SIGTERM)  # as Slurm and `kill -TERM -PGID` do
    saved = int(sup.wait_line(r"^saved (\d+) on notice").group(1))
    assert sup.wait() == 0, sup.text
    assert f"resumed {saved} attempt 1" in sup.text
    pre = [e for e in events(root) if e["kind"] == "preempted"]
    assert pre and pre[0]["new_checkpoint"] and pre[0]["step"] == saved


@pytest.mark.slow
def test_failure_after_progress_restarts_and_completes(tmp_path: Path, procs: Start) -> None:
    sup = procs(
        [
            "submit",
            "--run",
            "f",
            "--storage",
            "runs",
            CHILD,
            "--steps",
            "20",
            "--step-s",
            "0.01",
            "--save-every",
            "2",
            "--crash-at",
            "7",
        ],
        tmp_path,
    )
    assert sup.wait() == 0, sup.text
    assert "resumed 6 attempt 1" in sup.text
    assert kinds(tmp_path / "runs" / "f").count("backoff") == 1


IGNORER = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring', flush=True)\n"
    "time.sleep(120)\n"
)


def test_child_ignoring_the_notice_is_killed_within_grace(tmp_path: Path, procs: Start) -> None:
    grace, kill_delay = 3.0, 1.0
    sup = procs(
        [
            "submit",
            "--run",
            "i",
            "--storage",
            "runs",
            "--grace",
            str(grace),
            "--",
            PY,
            "-c",
            IGNORER,
        ],
        tmp_path,
    )
    sup.wait_line("^ignoring$")
    t0 = time.monotonic()
    sup.proc.send_signal(signal.SIGTERM)  # the supervisor itself is told to stop
    assert sup.wait() == 76, sup.text  # preempted, no new checkpoint
    took = time.monotonic() - t0
    assert took < 30, took  # a safety net: the property is the events' timing below
    ks = kinds(tmp_path / "runs" / "i")
    assert ks.index("notice") < ks.index("escalate") < ks.index("kill")
    at = {e["kind"]: parse_utc(e["utc"]).timestamp() for e in events(tmp_path / "runs" / "i")}
    assert at["kill"] - at["notice"] <= grace + kill_delay + 0.5, at  # killed within grace
    ends = [e for e in events(tmp_path / "runs" / "i") if e["kind"] == "attempt_end"]
    assert ends[-1]["status"] == 128 + signal.SIGKILL


STUCK_SAVE = (
    "import os, threading, time, ckrun\n"
    "def stuck_in_save():  # a save that never returns (a dead mount, a lost peer)\n"
    "    threading.Event().wait()\n"
    "print('training', os.getpid(), flush=True)\n"
    "while not ckrun.preemption_requested():\n"
    "    time.sleep(0.01)\n"
    "stuck_in_save()\n"
)


def test_a_child_past_the_grace_period_is_reported_where_it_hangs(
    tmp_path: Path, procs: Start
) -> None:
    (tmp_path / "stuck.py").write_text(STUCK_SAVE)
    sup = procs(["submit", "--run", "h", "--storage", "runs", "--grace", "3", "--",
                 PY, str(tmp_path / "stuck.py")], tmp_path)  # fmt: skip
    pid = int(sup.wait_line(r"^training (\d+)$").group(1))
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.wait() == 76, sup.text  # preempted without a new checkpoint
    assert "no checkpoint yet" in sup.text
    # the supervisor: where the child's one thread was (asleep: S, whatever the channel)
    line = sup.wait_line(r"no exit .* after the notice: .*; where its processes were: (.*)")
    assert line.group(1).startswith(f"pid {pid} (python"), sup.text
    assert "): 1 thread S" in line.group(1), sup.text
    esc = [e for e in events(tmp_path / "runs" / "h") if e["kind"] == "escalate"][-1]
    assert esc["waits"] == [line.group(1)]
    # the child: its Python stack at the TERM, down to the line it hangs on
    assert f"pid {pid} did not exit within the supervisor's grace period" in sup.text
    assert f'File "{tmp_path / "stuck.py"}", line 3 in stuck_in_save' in sup.text, sup.text


def test_lines_before_the_run_record_is_read_carry_no_attempt_number(tmp_path: Path) -> None:
    for attempt in (0, 1):  # the lease is taken before the run's attempts are known
        r = cli(["run", "--run", "n", "--storage", "runs", "--", PY, "-c", "pass"], tmp_path)
        assert r.returncode == 0, r.stderr
        lines = r.stderr.splitlines()
        assert lines[0].startswith("[ckrun] n: holding the run's lease"), r.stderr
        assert f"[ckrun] n attempt {attempt}: started" in r.stderr


def test_crash_loop_stops_and_says_so(tmp_path: Path, procs: Start) -> None:
    sup = procs(
        [
            "submit",
            "--run",
            "c",
            "--storage",
            "runs",
            "--",
            PY,
            "-c",
            "import sys; print('boom', flush=True); sys.exit(1)",
        ],
        tmp_path,
    )
    assert sup.wait() == 1
    assert "crash loop: 2 failures in a row with no checkpoint progress" in sup.text
    assert kinds(tmp_path / "runs" / "c").count("spawn") == 2


def test_failure_budget_is_enforced(tmp_path: Path, procs: Start) -> None:
    sup = procs(
        [
            "submit",
            "--run",
            "c",
            "--storage",
            "runs",
            "--max-failures",
            "0",
            "--",
            PY,
            "-c",
            "import sys; sys.exit(9)",
        ],
        tmp_path,
    )
    assert sup.wait() == 1
    assert "failure budget spent: 1 failures > max_failures 0" in sup.text


def test_second_supervisor_is_refused_naming_the_holder(tmp_path: Path, procs: Start) -> None:
    first = procs(
        ["submit", "--run", "two", "--storage", "runs", "--grace", "3", "--", "sleep", "60"],
        tmp_path,
    )
    holder_path = tmp_path / "runs" / "two" / "locks" / "supervisor.json"
    poll(holder_path.exists)
    poll(lambda: "spawn" in kinds(tmp_path / "runs" / "two"))
    holder = json.loads(holder_path.read_text())
    second = cli(["run", "--run", "two", "--storage", "runs"], tmp_path)
    assert second.returncode == 2
    assert f"supervisor pid {holder['pid']}" in second.stderr
    resub = cli(["submit", "--run", "two", "--storage", "runs", "--", "sleep", "60"], tmp_path)
    assert resub.returncode == 2 and "is alive" in resub.stderr
    st = cli(["status", "two", "--storage", "runs"], tmp_path)
    assert "RUNNING" in st.stdout and str(holder["pid"]) in st.stdout
    # cancel: the child (no handler) gets TERM at the deadline; the run stops with 0
    assert cli(["cancel", "two", "--storage", "runs"], tmp_path).returncode == 0
    assert first.wait(timeout=30) == 0, first.text
    assert "cancelled" in kinds(tmp_path / "runs" / "two")
    again = cli(["run", "--run", "two", "--storage", "runs"], tmp_path)
    assert again.returncode == 0 and "cancelled" in again.stderr


def test_changed_launch_of_a_frozen_run_is_refused(tmp_path: Path) -> None:
    assert (
        cli(["submit", "--run", "x", "--storage", "runs", "--", "true"], tmp_path).returncode == 0
    )
    r = cli(["submit", "--run", "x", "--storage", "runs", "--", "true", "--extra"], tmp_path)
    assert r.returncode == 4
    assert "command: true → true --extra" in r.stderr
    ok = cli(
        [
            "submit",
            "--run",
            "x",
            "--storage",
            "runs",
            "--allow-change",
            "launch_hash",
            "--",
            "true",
            "--extra",
        ],
        tmp_path,
    )
    assert ok.returncode == 0, ok.stderr


def test_hup_is_forwarded_and_stops_the_run(tmp_path: Path, procs: Start) -> None:
    # SIGINT is Ctrl-C now (save and stop, issue 11 item 1: tests/supervisor/test_lifecycle.py);
    # HUP and QUIT are still forwarded and stop the run without a restart.
    sup = procs(
        [
            "submit",
            "--run",
            "int",
            "--storage",
            "runs",
            "--",
            PY,
            "-c",
            "import time; print('up', flush=True); time.sleep(60)",
        ],
        tmp_path,
    )
    sup.wait_line("^up$")
    sup.proc.send_signal(signal.SIGHUP)
    assert sup.wait(timeout=30) == 1
    assert "forwarded SIGHUP" in sup.text and "not restarting" in sup.text


@pytest.mark.slow
def test_chaos_preempt_every_demo_survives_and_completes(tmp_path: Path, procs: Start) -> None:
    # The period counts from the child's first training step (issue 16): start-up (the
    # torch import, seconds here) is not part of it, so a period shorter than the
    # start-up still lets every attempt train.
    sup = procs(
        [
            "submit",
            "--run",
            "chaos",
            "--storage",
            "runs",
            "--chaos-preempt-every",
            "1s",
            CHILD,
            "--steps",
            "120",
            "--step-s",
            "0.03",
        ],
        tmp_path,
    )
    assert sup.wait(timeout=300) == 0, sup.text
    evs = events(tmp_path / "runs" / "chaos")
    notices = [e for e in evs if e["kind"] == "notice"]
    assert notices and all(e["source"] == "chaos" for e in notices)
    pre = [e for e in evs if e["kind"] == "preempted"]
    assert any(e["new_checkpoint"] for e in pre)
    steps = [int(e["step"]) for e in pre]
    assert steps == sorted(steps)
    assert float(sup.wait_line(r"^done (\S+)").group(1)) == expected_w(120)


def test_orphans_of_the_command_are_waited_for_and_reaped(tmp_path: Path, procs: Start) -> None:
    # The shell exits at once; its background child is adopted by the supervisor
    # (subreaper) and the attempt ends only when it is gone too.
    sup = procs(
        [
            "submit",
            "--run",
            "orph",
            "--storage",
            "runs",
            "--",
            "sh",
            "-c",
            "(sleep 1; echo orphan-done) & exit 0",
        ],
        tmp_path,
    )
    assert sup.wait(timeout=60) == 0, sup.text
    assert "orphan-done" in sup.text
    evs = events(tmp_path / "runs" / "orph")
    assert next(e for e in evs if e["kind"] == "supervisor_start")["subreaper"] is True
    end = next(e for e in evs if e["kind"] == "attempt_end")
    assert end["status"] == 0 and end["seconds"] >= 0.9
