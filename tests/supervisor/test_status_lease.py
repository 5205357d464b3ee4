"""``ckrun status`` shows who holds the run's lease (issue 12's leftover).

A real supervisor (``ckrun run``) holds a real lease in ``locks/lease.json`` while its
child sleeps; ``status`` names it (host, pid, job id, attempt, epoch, time since the
last renewal) as live, and as expired once the supervisor is SIGKILLed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ckrun.checkpoint.lease import Lease, read_lease
from ckrun.report.lease_view import lease_line, lease_numbers
from ckrun.storage.local import LocalStorage
from sv_helpers import FAST_ENV, Ckrun

PY = sys.executable
LEASE_ENV = {"CKRUN_LEASE_TTL_S": "30", "CKRUN_LEASE_HEARTBEAT_S": "0.2"}


def status(name: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **FAST_ENV)
    env.pop("CKRUN_CONTROL_DIR", None)
    return subprocess.run(
        [PY, "-m", "ckrun.cli", "status", name, "--storage", "runs", *extra],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_names_the_lease_holder_live_then_gone(tmp_path: Path, procs) -> None:
    prog = "import time; print('up', flush=True); time.sleep(60)"
    sup: Ckrun = procs(
        ["run", "--run", "held", "--storage", "runs", "--", PY, "-c", prog], tmp_path, LEASE_ENV
    )
    sup.wait_line("^up$")
    r = status("held", tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    lease = json.loads(r.stdout)["lease"]
    assert lease["epoch"] == 1 and lease["ttl_s"] == 30
    assert lease["holder"] == {
        "host": socket.gethostname(),
        "pid": sup.proc.pid,
        "job_id": str(sup.proc.pid),  # a local job's id is its supervisor's pid
        "attempt": 0,
        "machine": lease["holder"]["machine"],
    }
    assert 0 <= lease["since_renewal_s"] < 30 and lease["expired"] is False
    text = status("held", tmp_path).stdout
    line = next(x for x in text.splitlines() if "lease:" in x)
    who = f"host {socket.gethostname()} pid {sup.proc.pid}, job {sup.proc.pid} attempt 0"
    assert f"epoch 1, held by {who}" in line
    assert line.endswith(": live"), line

    os.kill(sup.proc.pid, signal.SIGKILL)  # the supervisor dies holding the lease
    sup.proc.wait(30)
    lease = json.loads(status("held", tmp_path, "--json").stdout)["lease"]
    assert lease["holder"]["pid"] == sup.proc.pid
    assert lease["expired"] is True and lease["expired_by"] == "holder_gone"
    assert "EXPIRED (its process on this machine is gone)" in status("held", tmp_path).stdout


def test_a_silent_holder_on_another_machine_is_expired_after_its_ttl(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "run"))
    other = Lease(storage, "r1", ttl_s=10, job_id="77", attempt=2)
    other.holder = dataclasses.replace(other.holder, machine="machine-b", host="node-b")
    rec = other.acquire(wait_s=0)
    renewed = dt.datetime.fromisoformat(rec.renewed_utc.replace("Z", "+00:00"))
    live = lease_numbers(rec, renewed + dt.timedelta(seconds=4))
    assert live["since_renewal_s"] == 4.0 and not live["expired"]
    silent = lease_numbers(rec, renewed + dt.timedelta(seconds=11))
    assert silent["expired"] and silent["expired_by"] == "ttl"
    line = lease_line(silent)
    assert line is not None and "host node-b pid" in line and "job 77 attempt 2" in line
    assert "renewed 11.0 s ago" in line and "EXPIRED (silent" in line
    other.release()
    found = read_lease(storage)
    assert found is not None
    released = lease_numbers(found[0])
    assert released["holder"] is None and released["expired_by"] == "released"
    assert lease_line(released) == "lease: epoch 1, released (no holder)"
