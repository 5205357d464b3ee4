"""Supervisor benchmark: start-up time, RSS, idle CPU, notice → child flag latency.

Usage::

    python bench/supervisor.py [--n 200] [--idle-s 5] [--json]

Measurements (each against a bare-Python baseline on the same machine):

* **start-up**: wall seconds from launching ``python -m ckrun.cli run ... -- CHILD`` to
  the child's first instruction (the child records ``time.monotonic()``, a system-wide
  clock on Linux), versus launching ``python -c pass`` to its first instruction.
* **RSS**: the supervisor's resident set (``VmRSS``, ``VmHWM`` from ``/proc``) while it
  supervises an idle child, versus a bare ``python -c`` sleeping.
* **idle CPU**: the supervisor's ``utime + stime`` (``/proc/PID/stat``) over
  ``--idle-s`` seconds of supervising an idle child, as a percentage of one core.
* **notice → flag latency**: ``SIGUSR1`` sent to the supervisor at ``t0``; the child's
  ``ckrun.control`` handler runs at ``t1``; latency ``t1 - t0`` (the supervisor writes
  ``notice.json`` with fsync, scans the child's session and signals it).  ``--n``
  cycles: each child exits 75 and the supervisor restarts it in place.  Baseline: the
  same signal sent directly to a bare Python process with a handler.

* **notice → checkpoint durable** (end to end, a torch child with a ``--state-mb`` state):
  ``ckrun preempt``'s notice at ``t0`` to the child's ``save()`` returning (manifest
  durable) at ``t1``, against the save's own duration.
* **restart → first resumed step**: the supervisor's ``attempt_end`` event to the next
  attempt's first completed step, against that attempt's ``load()`` time.

Targets (issue 3): start ≤ 0.3 s, RSS ≤ 60 MB, p50 latency ≤ 10 ms; notice → durable ≤
save time + 1 s; restart → first resumed step ≤ load time + 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
CHILD = r"""
import os, signal, sys, time
t_start = time.monotonic()
out = os.environ["BENCH_OUT"]
from ckrun import control
stamp = []
control.install_signal_handlers()
inner = signal.getsignal(signal.SIGUSR1)
def h(s, f):
    stamp.append(time.monotonic())
    inner(s, f)
signal.signal(signal.SIGUSR1, h)
with open(out, "a") as f:
    f.write(f"ready {os.getpid()} {t_start}\n")
while not stamp:
    time.sleep(0.0005)
with open(out, "a") as f:
    f.write(f"flag {stamp[0]}\n")
sys.exit(75)
"""
BARE = r"""
import os, signal, sys, time
stamp = []
signal.signal(signal.SIGUSR1, lambda s, f: stamp.append(time.monotonic()))
sys.stdout.write("ready\n"); sys.stdout.flush()
for line in sys.stdin:
    while not stamp:
        time.sleep(0.0005)
    sys.stdout.write(f"{stamp.pop()}\n"); sys.stdout.flush()
"""


TRAIN = r"""
import json, os, sys, time
import torch, ckrun
def emit(**kw):
    print(json.dumps(dict(kw, attempt=int(os.environ["CKRUN_ATTEMPT"]))), flush=True)
ck = ckrun.Checkpointer.from_env(rng=False, keep_last=1)
state = {"w": torch.ones(int(os.environ["BENCH_STATE_MB"]) * 2**18), "step": 0}
t = time.time(); m = ck.load(state); load_s = time.time() - t
start = int(state["step"]) if m is not None else 0
for step in range(start, 10**6):
    if ckrun.preemption_requested():
        t_flag = time.time(); ck.save(step, state)
        emit(ev="saved", t_flag=t_flag, t_done=time.time(), step=step); sys.exit(75)
    state["w"].mul_(0.999); state["step"] = step + 1
    if step == start:
        emit(ev="first_step", t=time.time(), load_s=load_s, resumed=m is not None)
    if m is not None and step >= start + 3:
        break
    time.sleep(0.01)
ck.finalize(int(state["step"]), state)
"""


def e2e(tmp: Path, state_mb: int) -> dict[str, float]:
    """One drill on a torch child: notice → durable and restart → first resumed step."""
    env = dict(os.environ, BENCH_STATE_MB=str(state_mb))
    env.pop("CKRUN_CONTROL_DIR", None)
    sup = subprocess.Popen(
        [
            PY,
            "-m",
            "ckrun.cli",
            "submit",
            "--run",
            "e2e",
            "--storage",
            str(tmp / "runs"),
            "--",
            PY,
            "-c",
            TRAIN,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert sup.stdout is not None
    evs = [json.loads(sup.stdout.readline())]
    t0 = time.time()
    subprocess.run(
        [PY, "-m", "ckrun.cli", "preempt", "e2e", "--storage", str(tmp / "runs")],
        check=True,
        capture_output=True,
    )
    for line in sup.stdout:
        evs.append(json.loads(line))
    sup.wait(timeout=300)
    saved = next(e for e in evs if e["ev"] == "saved")
    resumed = next(e for e in evs if e["ev"] == "first_step" and e["resumed"])
    log = [
        json.loads(x)
        for x in (tmp / "runs" / "e2e" / "events.jsonl").read_text().split("\n")
        if x.strip()
    ]
    from ckrun.notices import parse_utc

    end = next(parse_utc(e["utc"]).timestamp() for e in log if e["kind"] == "attempt_end")
    return {
        "notice_to_durable_s": saved["t_done"] - t0,
        "save_s": saved["t_done"] - saved["t_flag"],
        "restart_to_first_step_s": resumed["t"] - end,
        "load_s": resumed["load_s"],
    }


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait(cond, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.0005)
    raise TimeoutError("benchmark condition not met")


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def baseline_start(n: int = 5) -> float:
    """Median seconds from launching ``python -c`` to its first instruction."""
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        out = subprocess.run(
            [PY, "-c", "import time; print(time.monotonic())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        times.append(float(out) - t0)
    return statistics.median(times)


def baseline_latency(n: int) -> list[float]:
    """Direct ``kill(SIGUSR1)`` → handler latencies of a bare Python process, seconds."""
    p = subprocess.Popen([PY, "-c", BARE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdin and p.stdout
    p.stdout.readline()
    lat = []
    for _ in range(n):
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGUSR1)
        p.stdin.write("x\n")
        p.stdin.flush()
        lat.append(float(p.stdout.readline()) - t0)
    p.kill()
    p.wait()
    return lat


def supervised(n: int, idle_s: float, tmp: Path) -> dict[str, object]:
    """Start-up, RSS, idle CPU and ``n`` notice → flag latencies of one supervisor."""
    out = tmp / "child.out"
    env = dict(os.environ, BENCH_OUT=str(out), CKRUN_MAX_REQUEUES=str(n + 10), CKRUN_GRACE_S="30")
    env.pop("CKRUN_CONTROL_DIR", None)
    t0 = time.monotonic()
    sup = subprocess.Popen(
        [
            PY,
            "-m",
            "ckrun.cli",
            "run",
            "--run",
            "bench",
            "--storage",
            str(tmp / "runs"),
            "--",
            PY,
            "-c",
            CHILD,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first = _wait(lambda: [x for x in _lines(out) if x.startswith("ready")])
    startup = float(first[0].split()[2]) - t0
    time.sleep(0.5)
    cpu0, w0 = _cpu_s(sup.pid), time.monotonic()
    time.sleep(idle_s)
    idle_cpu = (_cpu_s(sup.pid) - cpu0) / (time.monotonic() - w0)
    mem = _proc_status(sup.pid)
    lat = []
    for i in range(n):
        _wait(lambda i=i: sum(x.startswith("ready") for x in _lines(out)) > i)
        t = time.monotonic()
        os.kill(sup.pid, signal.SIGUSR1)
        flags = _wait(lambda i=i: [x for x in _lines(out) if x.startswith("flag")][i:])
        lat.append(float(flags[0].split()[1]) - t)
    _wait(lambda: sum(x.startswith("ready") for x in _lines(out)) > n)
    sup.send_signal(signal.SIGTERM)
    sup.wait(timeout=60)
    return {
        "startup_s": startup,
        "rss_bytes": mem.get("VmRSS"),
        "rss_peak_bytes": mem.get("VmHWM"),
        "idle_cpu_fraction": idle_cpu,
        "latency_s": lat,
    }


def bare_rss() -> int:
    p = subprocess.Popen([PY, "-c", "import time; time.sleep(30)"])
    time.sleep(0.5)
    rss = _proc_status(p.pid)["VmRSS"]
    p.kill()
    p.wait()
    return rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="notice cycles (median of N)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle CPU window, seconds")
    ap.add_argument("--state-mb", type=int, default=64, help="torch child state, MiB")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        sv = supervised(a.n, a.idle_s, Path(d))
    with tempfile.TemporaryDirectory() as d:
        ee = e2e(Path(d), a.state_mb)
    lat = sorted(float(x) for x in sv["latency_s"])  # type: ignore[attr-defined]
    base = sorted(baseline_latency(a.n))
    res = {
        "startup_s": round(float(sv["startup_s"]), 4),  # type: ignore[arg-type]
        "startup_baseline_s": round(baseline_start(), 4),
        "rss_mb": round(int(sv["rss_bytes"]) / 2**20, 1),  # type: ignore[call-overload]
        "rss_peak_mb": round(int(sv["rss_peak_bytes"]) / 2**20, 1),  # type: ignore[call-overload]
        "rss_baseline_mb": round(bare_rss() / 2**20, 1),
        "idle_cpu_percent": round(100 * float(sv["idle_cpu_fraction"]), 3),  # type: ignore[arg-type]
        "notice_p50_ms": round(1000 * statistics.median(lat), 3),
        "notice_p90_ms": round(1000 * lat[int(0.9 * (len(lat) - 1))], 3),
        "notice_max_ms": round(1000 * lat[-1], 3),
        "direct_signal_p50_ms": round(1000 * statistics.median(base), 3),
        "n": a.n,
        "state_mb": a.state_mb,
        **{k: round(v, 4) for k, v in ee.items()},
    }
    targets = {
        "startup_s": 0.3,
        "rss_mb": 60.0,
        "notice_p50_ms": 10.0,
        "notice_to_durable_s": ee["save_s"] + 1.0,
        "restart_to_first_step_s": ee["load_s"] + 3.0,
    }
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            t = targets.get(k)
            ok = "ok" if t is not None and v <= t else "MISS"
            mark = "" if t is None else f"  (target ≤ {t:g}: {ok})"
            print(f"{k:<24} {v}{mark}")
    return 0 if all(float(res[k]) <= t for k, t in targets.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
