"""Issue 11 end to end: the supervisor under field failures, with real processes, real
signals, a real pty, real mounts and the loopback AWS metadata server."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pty
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sv_helpers import CHILD, FAST_ENV, Ckrun, expected_w

Start = Callable[..., Ckrun]
PY = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cloud"))


def events(root: Path) -> list[dict[str, Any]]:
    path = root / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def kinds(root: Path) -> list[str]:
    return [e["kind"] for e in events(root)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def ckrun(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120):
    full = dict(os.environ, **FAST_ENV, **(env or {}))
    full.pop("CKRUN_CONTROL_DIR", None)
    return subprocess.run(
        [PY, "-m", "ckrun.cli", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------- item 1
@pytest.mark.slow
def test_ctrl_c_through_a_real_pty_saves_cancels_and_resubmit_resumes(tmp_path: Path) -> None:
    env = dict(os.environ, **FAST_ENV)
    env.pop("CKRUN_CONTROL_DIR", None)
    args = ["submit", "--run", "cc", "--storage", "runs", CHILD, "--steps", "120",
            "--step-s", "0.03"]  # fmt: skip
    argv = [PY, "-m", "ckrun.cli", *args]
    pid, fd = pty.fork()
    if pid == 0:  # the foreground process of a new terminal, as in an interactive shell
        os.chdir(tmp_path)
        os.execve(PY, argv, env)
    out = b""
    sent = False
    end = time.monotonic() + 120
    while time.monotonic() < end:
        r, _, _ = select.select([fd], [], [], 0.1)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError as e:  # EIO: the terminal's last process closed it
                assert e.errno == errno.EIO
                break
            if not chunk:
                break
            out += chunk
        if not sent and b"step 5\r\n" in out:
            os.write(fd, b"\x03")  # Ctrl-C: the kernel sends SIGINT to the foreground group
            sent = True
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    text = out.decode(errors="replace")
    assert sent, text
    assert os.waitstatus_to_exitcode(status) == 130, text
    assert "on notice" in text and "Ctrl-C" in text, text
    root = tmp_path / "runs" / "cc"
    assert "cancelled" in kinds(root)
    pre = [e for e in events(root) if e["kind"] == "cancelled"][-1]
    assert pre["new_checkpoint"] is True and pre["step"] >= 5
    again = ckrun(args, tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resumed {pre['step']} " in again.stdout
    assert f"done {expected_w(120)}" in again.stdout


# ------------------------------------------------------------------- item 2
@pytest.mark.slow
def test_sigkill_of_the_supervisor_takes_the_tree_down_and_resubmit_resumes(
    tmp_path: Path, procs: Start
) -> None:
    args = ["submit", "--run", "k", "--storage", "runs", CHILD, "--steps", "100",
            "--step-s", "0.03", "--save-every", "10"]  # fmt: skip
    sup = procs(args, tmp_path)
    sup.wait_line(r"^step 15$")
    root = tmp_path / "runs" / "k"
    child = next(e["pid"] for e in events(root) if e["kind"] == "spawn")
    sup.proc.kill()  # SIGKILL: no handler runs in the supervisor
    sup.wait()
    assert wait_until(lambda: not alive(child), 5.0), "the child outlived its supervisor"
    assert "on notice" in sup.text  # PR_SET_PDEATHSIG: SIGTERM, a notice to the library
    again = ckrun(args, tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "being written by another process" not in again.stdout + again.stderr
    assert "resumed None" not in again.stdout
    assert f"done {expected_w(100)}" in again.stdout


def test_dead_holder_of_the_writer_lock_is_taken_over(tmp_path: Path) -> None:
    # A writer recorded itself as holder and died; the lock is still held by a process
    # that does not write (here flock(1), as a descriptor inherited outside Python's fork
    # hooks would): the next writer takes the stale lock over, with a log line.
    prog = (
        "import os, ckrun\n"
        "from ckrun.checkpoint.lock import WriterLock\n"
        "from ckrun.storage import open_storage\n"
        f"lk = WriterLock(open_storage({str(tmp_path)!r}), run='r', attempt=0)\n"
        "lk.acquire(); print(lk._storage.local_path('locks/writer.lock'), flush=True)\n"
        "os._exit(0)\n"
    )
    first = subprocess.run([PY, "-c", prog], capture_output=True, text=True, timeout=30)
    path = first.stdout.strip()
    assert os.path.exists(path), first.stderr
    holder = subprocess.Popen(["flock", path, "sleep", "30"])  # waits out the probes below
    take = (
        "import logging, ckrun\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from ckrun.checkpoint.lock import WriterLock\n"
        "from ckrun.storage import open_storage\n"
        f"lk = WriterLock(open_storage({str(tmp_path)!r}), run='r', attempt=1)\n"
        "lk.acquire(); print('took', lk.held, flush=True)\n"
    )
    try:
        held = ["flock", "-n", path, "true"]  # exits 1 while another holds the lock
        assert wait_until(lambda: subprocess.run(held).returncode == 1, 10.0)
        r = subprocess.run([PY, "-c", take], capture_output=True, text=True, timeout=30)
    finally:
        holder.kill()
        holder.wait()
    assert r.stdout.strip() == "took True", r.stderr
    assert "taking it over" in r.stderr


# ------------------------------------------------------------------- item 3
def test_a_stray_sleep_does_not_delay_the_exit(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = ckrun(
        ["submit", "--run", "s", "--storage", "runs", "--grace", "60", "--",
         "sh", "-c", "sleep 1000 & echo stray $!; exit 0"],
        tmp_path,
        timeout=40,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    stray = int(r.stdout.split("stray ")[1].split()[0])
    assert not alive(stray)
    assert took < 30.0, f"took {took:.1f} s"  # the defect waits out the 60 s grace


# ------------------------------------------------------------------- item 5
@pytest.mark.slow
def test_a_notice_stamped_5_minutes_in_the_past_still_yields_a_checkpoint(
    tmp_path: Path, procs: Start
) -> None:
    from metaservers import AwsImds

    srv = AwsImds()
    try:
        env = {
            "CKRUN_NOTICE_SOURCES": "aws",
            "CKRUN_AWS_POLL_INTERVAL_S": "5",
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": srv.url,
        }
        sup = procs(["run", "--run", "sk", "--storage", "runs", "--", PY, CHILD,
                     "--steps", "500", "--step-s", "0.03"], tmp_path, env)  # fmt: skip
        sup.wait_line(r"^step 5$")
        srv.arm(deadline_s=-300)  # the stated time is 5 minutes ago by this clock
        assert sup.wait(timeout=60) == 75, sup.text
    finally:
        srv.close()
    root = tmp_path / "runs" / "sk"
    assert "notice_skew" in kinds(root)
    pre = next(e for e in events(root) if e["kind"] == "preempted")
    assert pre["new_checkpoint"] is True, sup.text
    assert "on notice" in sup.text


# ------------------------------------------------------------------- item 6
def test_a_notice_signal_after_the_end_does_not_change_the_outcome(tmp_path: Path) -> None:
    # The command leaves a process in its own session (not a stray) that waits for the
    # run's "completed" event and then sends the notice signal to the supervisor as fast
    # as it can until the supervisor is gone (Slurm's time-limit USR1 just after the end).
    spam = (
        'sup=$PPID; ev="$CKRUN_CONTROL_DIR/../events.jsonl"; setsid sh -c "'
        "until grep -q '\\\"completed\\\"' $ev; do sleep 0.002; done; "
        'while kill -USR1 $sup 2>/dev/null; do :; done" >/dev/null 2>&1 &'
    )
    r = ckrun(["submit", "--run", "late", "--storage", "runs", "--", "sh", "-c",
               f"{spam} exit 0"], tmp_path, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert kinds(tmp_path / "runs" / "late").count("spawn") == 1


# ------------------------------------------------------------------- item 7
def test_exit_75_at_every_start_stops_across_separate_runs(tmp_path: Path) -> None:
    # Each `ckrun run` is one start (the command stops its supervisor, as a node going
    # away would); the streak persists with the run, the 3rd start stops the run.
    cmd = ["--", "sh", "-c", "kill -TERM $PPID; sleep 5; exit 75"]
    env = {"CKRUN_NO_PROGRESS_PREEMPTIONS": "3"}
    codes = [
        ckrun(["run", "--run", "st", "--storage", "runs", *cmd], tmp_path, env).returncode
        for _ in range(4)
    ]
    root = tmp_path / "runs" / "st"
    assert codes == [76, 76, 1, 1]
    assert kinds(root).count("spawn") == 3
    failed = [e for e in events(root) if e["kind"] == "failed"]
    assert failed and all("requeue storm" in e["message"] for e in failed)
    assert json.loads((root / "budgets.json").read_text())["streak"] == 3


# ------------------------------------------------------------------- item 8
def test_a_script_exiting_4_on_its_own_is_a_failure_not_incompatible(tmp_path: Path) -> None:
    r = ckrun(["submit", "--run", "x4", "--storage", "runs", "--", "sh", "-c", "exit 4"], tmp_path)
    assert r.returncode == 1, r.stderr
    assert "incompatible" not in kinds(tmp_path / "runs" / "x4")
    assert "crash loop" in r.stderr


def test_scheduler_refusal_exits_7_and_leaves_no_run_json(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(
        "#!/bin/sh\necho 'sbatch: error: Invalid partition name specified' >&2\nexit 1\n"
    )
    sbatch.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = ckrun(["submit", "--profile", "slurm", "--run", "ref", "--storage", "runs", "--",
               "true"], tmp_path, env)  # fmt: skip
    assert r.returncode == 7, r.stderr
    assert "Invalid partition" in r.stderr
    assert not (tmp_path / "runs" / "ref" / "run.json").exists()


# ------------------------------------------------------------------- item 10
@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done: list[Path] = []

    def make(name: str, opts: str) -> Path:
        p = tmp_path / name
        p.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(p)], check=True)
        done.append(p)
        return p

    yield make
    for p in done:
        subprocess.run(["umount", "-l", str(p)], check=False)


def fill(path: Path) -> None:
    """Write until the file system is full (unbuffered, so nothing is left to flush)."""
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 1 << 10, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_read_only_storage_exits_5_with_the_fix(tmp_path: Path, mount: Callable[..., Path]) -> None:
    ro = mount("ro", "ro,size=1m")
    r = ckrun(["submit", "--run", "r", "--storage", str(ro), "--", "true"], tmp_path)
    assert r.returncode == 5, r.stderr
    assert "Traceback" not in r.stderr
    assert "make the storage writable or choose another --storage" in r.stderr


def test_full_storage_at_submit_exits_5_with_the_fix(
    tmp_path: Path, mount: Callable[..., Path]
) -> None:
    full = mount("full", "size=1m")
    fill(full)
    r = ckrun(["submit", "--run", "r", "--storage", str(full), "--", "true"], tmp_path)
    assert r.returncode == 5, r.stderr
    assert "Traceback" not in r.stderr and "free space" in r.stderr


@pytest.mark.slow
def test_disk_full_during_the_run_stops_with_5_not_a_crash_loop(
    tmp_path: Path, mount: Callable[..., Path], procs: Start
) -> None:
    disk = mount("disk", "size=4m")
    sup = procs(["submit", "--run", "r", "--storage", str(disk), CHILD, "--steps", "500",
                 "--step-s", "0.03"], tmp_path)  # fmt: skip
    sup.wait_line(r"^step 5$")
    fill(disk)
    sup.proc.send_signal(signal.SIGUSR1)  # a notice: the child's save hits the full disk
    assert sup.wait(timeout=60) == 5, sup.text
    assert "Traceback" not in sup.text
    assert "storage error, not restarting" in sup.text and "free space" in sup.text
    assert sup.text.count("started, ") == 1


# ------------------------------------------------------------------- item 11
@pytest.mark.slow
def test_a_moved_run_directory_resumes_from_its_own_checkpoints(
    tmp_path: Path, procs: Start
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    cmd = ["--", PY, CHILD, "--steps", "60", "--step-s", "0.03", "--save-every", "10",
           "--hold-at", "25"]  # fmt: skip
    first = procs(["run", "--run", "mv", "--storage", str(a / "runs"), *cmd], tmp_path)
    first.wait_line(r"^step 25$")
    first.proc.send_signal(signal.SIGTERM)  # the node goes away: checkpoint and exit 75
    assert first.wait(timeout=60) == 75, first.text
    saved = int(first.wait_line(r"^saved (\d+) on notice").group(1))
    os.rename(a, b)  # the file system is mounted elsewhere now
    again = ckrun(["run", "--run", "mv", "--storage", str(b / "runs")], tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resumed {saved} " in again.stdout
    assert f"done {expected_w(60)}" in again.stdout
    assert not a.exists()
    frozen = json.loads((b / "runs" / "mv" / "run.json").read_text())
    assert frozen["storage"] == str(b / "runs")


# ------------------------------------------------------------------- item 13
def test_plain_script_finishing_after_a_notice_is_completed_not_restarted(
    tmp_path: Path, procs: Start
) -> None:
    # The script finishes once its TERM came (the real event), or after 20 s, well before
    # the 60 s grace's own TERM: a notice delivered late fails the assertions below
    # instead of racing a fixed sleep in the script (which a loaded machine lost).
    prog = (
        "import signal, time\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda *a: got.append(print('got TERM', flush=True)))\n"
        "print('up', flush=True)\n"
        "end = time.monotonic() + 20\n"
        "while not got and time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "print('finished', flush=True)\n"
    )
    sup = procs(["submit", "--run", "plain", "--storage", "runs", "--", PY, "-c", prog], tmp_path)
    sup.wait_line("^up$")
    sup.proc.send_signal(signal.SIGUSR1)
    assert sup.wait(timeout=60) == 0, sup.text
    assert "got TERM" in sup.text  # nothing catches USR1: the notice came as TERM at once
    assert sup.text.count("finished") == 1
    root = tmp_path / "runs" / "plain"
    assert kinds(root).count("spawn") == 1 and "completed" in kinds(root)


def test_ctrl_c_after_the_console_pipe_closed_still_saves(tmp_path: Path) -> None:
    """`ckrun submit train.py 2>&1 | tee log`, then Ctrl-C: the terminal's SIGINT reaches
    `tee` too, so the supervisor's next line hits a closed pipe (EPIPE).  It used to die
    of the BrokenPipeError in the middle of the save it exists for (no checkpoint, run
    SUPERVISOR_DIED); now the console goes quiet, the save commits, exit 130."""
    env = dict(os.environ, **FAST_ENV)
    env.pop("CKRUN_CONTROL_DIR", None)
    # the child keeps its own output, so only the supervisor writes to the pipe
    child = shlex.join([PY, CHILD, "--steps", "400", "--step-s", "0.03"])
    args = ["submit", "--run", "tee", "--storage", "runs", "--", "sh", "-c",
            f"exec {child} > child.out 2>&1"]  # fmt: skip
    sup = subprocess.Popen(
        [PY, "-m", "ckrun.cli", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert sup.stdout is not None
    out = tmp_path / "child.out"
    assert wait_until(lambda: out.exists() and "step 5\n" in out.read_text(), 60), sup.pid
    sup.stdout.close()  # `tee` is gone
    sup.send_signal(signal.SIGINT)
    assert sup.wait(timeout=60) == 130
    root = tmp_path / "runs" / "tee"
    done = [e for e in events(root) if e["kind"] == "cancelled"]
    assert done and done[-1]["new_checkpoint"] is True, kinds(root)
    assert "console_lost" in kinds(root)
    assert "saved" in out.read_text()


def test_a_script_printing_into_the_closed_console_pipe_still_saves(tmp_path: Path) -> None:
    """As above, but the training script prints every step into the same pipe (a
    newcomer's `ckrun submit train.py | tee log`).  It inherited the pipe, so once `tee`
    was gone its next print raised BrokenPipeError and it died before the checkpoint the
    Ctrl-C asked for (every step since the last one lost, run FAILED).  The supervisor
    now relays the script's output (:mod:`ckrun.supervisor.relay`): the script never
    writes into the dead pipe, saves, and the run stops CANCELLED with its work kept."""
    env = dict(os.environ, **FAST_ENV)
    env.pop("CKRUN_CONTROL_DIR", None)
    args = ["submit", "--run", "tee2", "--storage", "runs", CHILD, "--steps", "400",
            "--step-s", "0.03"]  # fmt: skip
    sup = subprocess.Popen(
        [PY, "-m", "ckrun.cli", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE
    )
    assert sup.stdout is not None
    seen = b""
    while b"step 5\n" not in seen:  # the script's own lines come through the relay
        line = sup.stdout.readline()
        assert line, seen
        seen += line
    sup.stdout.close()  # `tee` is gone
    time.sleep(0.3)  # ten more steps print into the pipe
    sup.send_signal(signal.SIGINT)
    assert sup.wait(timeout=60) == 130
    root = tmp_path / "runs" / "tee2"
    done = [e for e in events(root) if e["kind"] == "cancelled"]
    assert done and done[-1]["new_checkpoint"] is True, kinds(root)
    again = ckrun(args, tmp_path)
    assert again.returncode == 0, again.stderr
    resumed = int(again.stdout.split("resumed ")[1].split()[0])
    assert resumed > 5, again.stdout  # the notice's save, after the pipe closed
    assert f"done {expected_w(400)}" in again.stdout, again.stdout


def _ckrun_in_pty(
    tmp_path: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    before_exec: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """``python -m ckrun.cli ARGS`` in ``tmp_path`` as the foreground process of a new
    terminal; ``before_exec`` runs in the child first.  Returns (pid, pty descriptor)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(tmp_path)
        if before_exec is not None:
            before_exec()
        os.execve(PY, [PY, "-m", "ckrun.cli", *args], env or dict(os.environ, **FAST_ENV))
    return pid, fd


def _finish_pty(pid: int, fd: int, out: bytes) -> tuple[bytes, int]:
    """Read the pty ``fd`` of ``pid`` to its end after ``out``; its output and exit code."""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the last process of the pty's session closed it
            break
        if not chunk:
            break
        out += chunk
    _, wstatus = os.waitpid(pid, 0)
    os.close(fd)
    return out, os.waitstatus_to_exitcode(wstatus)


def test_the_script_sees_a_terminal_and_its_streams_stay_apart(tmp_path: Path) -> None:
    """The relay keeps what the script saw before: a terminal console is relayed through
    a pseudo-terminal (the script still sees a tty: line-buffered output, progress bars)
    and stdout and stderr stay separate streams."""
    prog = (
        "import sys\n"
        "print('out', sys.stdout.isatty(), sys.stderr.isatty())\n"
        "print('err-line', file=sys.stderr)\n"
    )
    args = ["run", "--run", "tty", "--storage", "runs", "--", PY, "-c", prog]

    def stderr_to_a_file() -> None:  # not relayed: the script gets the file
        os.dup2(os.open(str(tmp_path / "stderr.txt"), os.O_WRONLY | os.O_CREAT, 0o644), 2)

    pid, fd = _ckrun_in_pty(tmp_path, args, before_exec=stderr_to_a_file)
    out, code = _finish_pty(pid, fd, b"")
    assert code == 0, out
    assert b"out True False\r\n" in out, out
    assert b"err-line" not in out
    assert "err-line" in (tmp_path / "stderr.txt").read_text()


def test_a_resized_terminal_resizes_the_scripts_terminal(tmp_path: Path) -> None:
    """The terminal sends SIGWINCH to its foreground group (the supervisor's); the relay's
    pty takes the new size, so the script's next size query (a progress bar) sees it."""
    prog = (
        "import os, time\n"
        "seen, deadline = None, time.monotonic() + 30\n"
        "while seen != (132, 50) and time.monotonic() < deadline:  # a redraw loop\n"
        "    s = tuple(os.get_terminal_size(1))\n"
        "    if s != seen:\n"
        "        print(f'size {s[0]}x{s[1]}', flush=True)\n"
        "        seen = s\n"
        "    time.sleep(0.01)\n"
    )
    args = ["run", "--run", "winch", "--storage", "runs", "--", PY, "-c", prog]

    def size_80x24() -> None:
        fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))

    pid, fd = _ckrun_in_pty(tmp_path, args, before_exec=size_80x24)
    out = b""
    while b"size 80x24" not in out:
        out += os.read(fd, 4096)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 132, 0, 0))  # resized
    out, code = _finish_pty(pid, fd, out)
    assert code == 0, out
    assert b"size 132x50\r\n" in out, out


def _run_merged(tmp_path: Path, run: str, prog: str) -> subprocess.Popen[bytes]:
    """`ckrun run -- python -c PROG` with stdout and stderr on one pipe (`2>&1 | tee`)."""
    return subprocess.Popen(
        [PY, "-m", "ckrun.cli", "run", "--run", run, "--storage", "runs", "--", PY, "-c", prog],
        cwd=tmp_path,
        env=dict(os.environ, **FAST_ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_the_relayed_output_ends_before_the_verdict(tmp_path: Path) -> None:
    """The supervisor waits until the relay copied the child's last bytes (the child's
    session is empty) before it prints the attempt's end.  The console here reads late,
    so when the child exits, the end of its output is still in the pipes."""
    prog = "import sys\nsys.stdout.write('x' * 2000000 + '\\nlast line\\n')\n"
    sup = _run_merged(tmp_path, "ord", prog)
    assert sup.stdout is not None
    time.sleep(1.0)  # the pipes fill: the child waits for the console
    out = b""
    while chunk := sup.stdout.read(4096):
        out += chunk
        time.sleep(0.0002)
    assert sup.wait(timeout=60) == 0, out[-2000:]
    assert out.count(b"x") >= 2000000
    end = out.index(b"child exited with status 0")
    assert out.index(b"last line") < end, out[-300:]


def test_stdout_and_stderr_on_one_console_keep_their_order(tmp_path: Path) -> None:
    """`ckrun submit train.py 2>&1 | tee log`: stdout and stderr are one pipe, and the
    log must keep the order the script wrote its lines in (a traceback after the last
    progress line, tqdm's stderr between prints).  Two channels relayed side by side
    reordered them; one shared channel cannot."""
    prog = (
        "import sys\n"
        "for i in range(400):\n"
        "    print(i, file=sys.stderr if i % 2 else sys.stdout, flush=True)\n"
    )
    sup = _run_merged(tmp_path, "mix", prog)
    out = sup.communicate(timeout=60)[0].decode()
    assert sup.returncode == 0, out[-2000:]
    numbers = [int(x) for x in out.splitlines() if x.isdigit()]
    assert numbers == list(range(400)), out[:2000]


@pytest.mark.slow
def test_a_hung_up_terminal_keeps_the_work_since_the_last_checkpoint(tmp_path: Path) -> None:
    """An SSH session that drops under a foreground `ckrun submit`: the terminal hangs
    up, the supervisor gets SIGHUP and forwards it.  The training process used to die of
    it at once (no save: every step since the last checkpoint lost, run FAILED with no
    checkpoint); the library now takes it as a notice and commits first."""
    env = dict(os.environ, **FAST_ENV)
    env.pop("CKRUN_CONTROL_DIR", None)
    args = ["submit", "--run", "hup", "--storage", "runs", CHILD, "--steps", "400",
            "--step-s", "0.03"]  # fmt: skip
    pid, fd = _ckrun_in_pty(tmp_path, args, env)
    out = b""
    end = time.monotonic() + 120
    while b"step 5\r\n" not in out and time.monotonic() < end:
        if select.select([fd], [], [], 0.1)[0]:
            out += os.read(fd, 4096)
    assert b"step 5\r\n" in out, out
    os.close(fd)  # the terminal hangs up: SIGHUP to its session leader, the supervisor
    _, wstatus = os.waitpid(pid, 0)
    root = tmp_path / "runs" / "hup"
    assert "forward" in kinds(root)
    # the work is kept, so the run stops resumable (CANCELLED, 128 + SIGHUP), not FAILED
    assert os.waitstatus_to_exitcode(wstatus) == 128 + int(signal.SIGHUP), wstatus
    assert "cancelled" in kinds(root) and "failed" not in kinds(root), kinds(root)
    ends = [e for e in events(root) if e["kind"] == "attempt_end"]
    assert ends and ends[-1]["commits"], events(root)  # a checkpoint made after the hangup
    again = ckrun(args, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resumed None" not in again.stdout, again.stdout
    assert f"done {expected_w(400)}" in again.stdout, again.stdout


def test_a_new_submit_starts_with_fresh_budgets(tmp_path: Path) -> None:
    """README: "`ckrun submit` starts a new submission with fresh budgets".  The
    supervisor's own first write of the run's record (at lease activation) made the
    record look newer than the reset, so a fixed script resubmitted after a crash loop
    started with the old failure streak and stopped after ONE failure."""
    args = ["submit", "--run", "bud", "--storage", "runs", "--", "false"]
    for _ in range(2):
        r = ckrun(args, tmp_path)
        assert r.returncode == 1 and "crash loop: 2 failures in a row" in r.stderr, r.stderr
    starts = [e for e in events(tmp_path / "runs" / "bud") if e["kind"] == "supervisor_start"]
    assert [s["budgets"]["failures"] for s in starts] == [0, 0]


@pytest.mark.slow
def test_a_launch_the_checkpoint_refuses_does_not_replace_the_run(tmp_path: Path) -> None:
    """`--allow-change launch_hash` with a changed experiment: the checkpoint refuses it
    (exit 4, "restore the original settings ...").  The refused launch used to stay
    frozen in run.json, so restoring the original command was refused in turn."""
    base = ["submit", "--run", "x", "--storage", "runs"]
    orig = [CHILD, "--steps", "5", "--step-s", "0", "--save-every", "1"]
    first = ckrun([*base, "--max-failures", "0", *orig, "--crash-at", "2"], tmp_path)
    assert first.returncode == 1 and "crash at 2" in first.stdout, first.stderr  # step 2 kept
    changed = [*base, "--allow-change", "launch_hash", *orig[:1], "--steps", "6"]
    r = ckrun(changed, tmp_path)
    assert r.returncode == 4 and "restore the original settings" in r.stderr, r.stderr
    again = ckrun([*base, *orig, "--crash-at", "2"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert "resumed 2 " in again.stdout, again.stdout
