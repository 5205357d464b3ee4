"""Exactly one owner per run across machines (issue 12): two "machines" on one run.

Each machine is its own ``ckrun run`` process tree with its own HOME, working directory,
TMPDIR and machine id (``CKRUN_MACHINE_ID``: to the lease they are different hosts, so a
dead holder is only ever detected by its silence), sharing nothing but the run's storage:
S3 (moto's server on 127.0.0.1) or a local directory.  No profile and no ``state_dir``
on S3: the machine-local cache defaults under ``$HOME/.local/state/ckrun``.  With local
storage each machine keeps its state cache on its own disk (``CKRUN_STATE_DIR``), as
two hosts sharing a network directory would.  The lease TTL is short (3 s, heartbeat
0.5 s); every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckrun.checkpoint import layout
from ckrun.checkpoint.lease import read_lease
from ckrun.checkpoint.manifest import Manifest
from ckrun.storage.base import Storage
from ckrun.storage.local import LocalStorage
from s3_server import MotoS3

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "spot_train.py")
CKRUN = str(Path(sys.executable).parent / "ckrun")
STEPS = 150
TTL_S = 3.0


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Run:
    """The shared run: its storage URL and a Storage to inspect it."""

    def __init__(self, url: str, storage: Storage, local: bool) -> None:
        self.url, self.storage, self.local = url, storage, local

    def manifests(self) -> dict[str, Manifest]:
        out = {}
        for o in self.storage.list("checkpoints/"):
            if o.key.endswith(layout.MANIFEST):
                out[o.key] = Manifest.loads(self.storage.get(o.key), key=o.key)
        return out

    def newest_step(self) -> int:
        return max((m.step for m in self.manifests().values()), default=-1)


@pytest.fixture(params=["s3", "local"])
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Run]:
    if request.param == "s3":
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        bucket = moto.new_bucket()
        yield Run(f"s3://{bucket}/runs", moto.storage(f"s3://{bucket}/runs/r1"), False)
    else:
        shared = tmp_path / "shared"
        yield Run(str(shared), LocalStorage(str(shared / "r1")), True)


class Machine:
    """One "machine": its own HOME, cwd, TMPDIR, machine id and processes."""

    def __init__(self, tmp: Path, name: str, run: Run, step_sleep_s: float = 0.02) -> None:
        self.name, self.run = name, run
        self.root = tmp / name
        self.home = self.root / "home"
        for d in (self.home, self.root / "tmp"):
            d.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CKRUN_", "XDG_"))}
        env.update(
            HOME=str(self.home),
            TMPDIR=str(self.root / "tmp"),
            CKRUN_MACHINE_ID=name,
            CKRUN_LEASE_TTL_S=f"{TTL_S:g}",
            CKRUN_LEASE_HEARTBEAT_S="0.5",
            SPOT_STEPS=str(STEPS),
            SPOT_STEP_SLEEP_S=str(step_sleep_s),
            SPOT_PROGRESS=str(self.root / "progress.json"),
            SPOT_OUT=str(self.root / "out.json"),
        )
        if run.local:
            env["CKRUN_STATE_DIR"] = str(self.home / "ckrun-state")
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def cmd(self, *extra: str) -> list[str]:
        return [CKRUN, "run", "--run", "r1", "--storage", self.run.url, *extra, "--",
                sys.executable, TRAIN]  # fmt: skip

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        log = open(self.root / "stderr.txt", "wb")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(self.cmd(*extra), env=self.env, cwd=self.root,
                                     start_new_session=True, stdout=log, stderr=log)  # fmt: skip
        return self.proc

    def finish(self, timeout_s: float = 120) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stderr(self) -> str:
        return (self.root / "stderr.txt").read_text(errors="replace")

    def progress(self) -> dict[str, Any]:
        return read_json(self.root / "progress.json") or {}

    def events(self) -> list[dict[str, Any]]:
        paths = list(self.home.rglob("r1/events.jsonl"))
        if not paths:
            return []
        return [json.loads(x) for x in paths[0].read_text().splitlines() if x.strip()]

    def signal_all(self, sig: int) -> None:
        """The machine's supervisor and its training child (its own session)."""
        assert self.proc is not None
        child = self.progress().get("pid")
        for pid in (child, self.proc.pid):
            if pid:
                os.kill(int(pid), sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for pgid in (self.progress().get("pid"), self.proc.pid):
                try:
                    os.killpg(int(pgid), signal.SIGKILL)
                except (ProcessLookupError, TypeError, ValueError):
                    pass
            self.proc.wait()


@pytest.fixture
def machines(tmp_path: Path, run: Run) -> Iterator[Callable[..., Machine]]:
    made: list[Machine] = []

    def make(name: str, **kw: Any) -> Machine:
        m = Machine(tmp_path, name, run, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                m.signal_all(sig)
            except (ProcessLookupError, AssertionError):
                pass
        m.kill()


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("ref")
    env = dict(os.environ, SPOT_REF_STORAGE=str(tmp / "ref"), SPOT_OUT=str(tmp / "ref.json"),
               SPOT_STEP_SLEEP_S="0", SPOT_STEPS=str(STEPS))  # fmt: skip
    r = subprocess.run([sys.executable, TRAIN], env=env, timeout=300, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return read_json(tmp / "ref.json")


def _trained_past_a_commit(a: Machine, run: Run) -> None:
    wait_for(lambda: run.newest_step() >= 25 and a.progress().get("step", 0) >= 30, 120,
             f"{a.name} to commit and train on")  # fmt: skip


def test_second_machine_exits_2_naming_the_holder_and_never_trains(
    run: Run, machines: Callable[..., Machine]
) -> None:
    a, b = machines("machine-a", step_sleep_s=0.3), machines("machine-b")
    a.start()
    wait_for(lambda: a.progress().get("step", 0) >= 5, 120, "machine-a training")
    for extra in ((), ("--wait-for-lease", "1")):  # exit at once; wait 1 s, then exit
        r = subprocess.run(b.cmd(*extra), env=b.env, cwd=b.root, timeout=120,
                           capture_output=True, text=True)  # fmt: skip
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"pid {a.proc.pid if a.proc else '?'}" in r.stderr and "epoch 1" in r.stderr
        assert "owned by host" in r.stderr
    assert not (b.root / "progress.json").exists()  # B never started the command
    assert a.proc is not None and a.proc.poll() is None, "machine-a ended too early"
    assert a.proc.poll() is None, "machine-a ended too early"
    os.kill(a.proc.pid, signal.SIGTERM)  # A is stopped: it commits and releases the lease
    assert a.finish() == 75, a.stderr()[-3000:]
    lease = read_lease(run.storage)
    assert lease is not None and lease[0].epoch == 1 and lease[0].holder is None  # released
    assert {m.lease_epoch for m in run.manifests().values()} <= {1}


def test_killed_holder_is_taken_over_after_the_ttl_and_resumed_bitwise(
    run: Run, machines: Callable[..., Machine], expected: Any
) -> None:
    a, b = machines("machine-a", step_sleep_s=0.1), machines("machine-b")  # A: 12 s left
    a.start()
    _trained_past_a_commit(a, run)
    a.kill()  # the VM is gone: supervisor and child, no release of the lease
    newest = run.newest_step()
    lease = read_lease(run.storage)
    assert lease is not None and lease[0].holder is not None and lease[0].epoch == 1

    b.start("--wait-for-lease", "60")
    assert b.finish() == 0, b.stderr()[-3000:]
    assert "waiting up to 60 s" in b.stderr() and f"TTL {TTL_S:g} s" in b.stderr()
    start = [e for e in b.events() if e["kind"] == "attempt_start"][-1]
    assert start["message"] == f"started, resuming from step {newest}"
    sv = [e for e in b.events() if e["kind"] == "supervisor_start"][-1]
    assert sv["lease_epoch"] == 2
    assert read_json(b.root / "out.json") == expected  # bitwise, as floats
    assert run.storage.head(layout.COMPLETE) is not None
    lease = read_lease(run.storage)
    assert lease is not None and lease[0].epoch == 2 and lease[0].holder is None  # released


def test_paused_holder_wakes_up_fenced_and_stops(
    run: Run, machines: Callable[..., Machine], expected: Any
) -> None:
    a = machines("machine-a", step_sleep_s=0.1)  # 12 s of training left past the commit
    b = machines("machine-b", step_sleep_s=0.05)
    a.start()
    _trained_past_a_commit(a, run)
    a.signal_all(signal.SIGSTOP)  # a frozen VM: supervisor and child stop mid-step
    before = set(run.manifests())

    b.start("--wait-for-lease", "60")
    wait_for(lambda: any(m.lease_epoch == 2 for m in run.manifests().values()), 120,
             "machine-b to take over and commit")  # fmt: skip
    b_commits = {k for k, m in run.manifests().items() if m.lease_epoch == 2}
    a.signal_all(signal.SIGCONT)  # A wakes up past the TTL

    assert a.finish(timeout_s=60) == 2, a.stderr()[-3000:]
    assert "lease" in a.stderr() and ("refused" in a.stderr() or "was lost" in a.stderr())
    assert any(e["kind"] == "lease_lost" for e in a.events())
    assert b.finish() == 0, b.stderr()[-3000:]
    assert read_json(b.root / "out.json") == expected
    final = run.manifests()
    stale = {k for k, m in final.items() if m.lease_epoch == 1}
    assert stale <= before  # A published nothing after it was paused
    b_steps = sorted(m.step for m in final.values() if m.lease_epoch == 2)
    gone = {k for k in b_commits if k not in final}  # only B's own retention deletes
    assert all(int(k.split("step-")[1][:10]) < b_steps[-3] for k in gone)
    assert run.storage.head(layout.COMPLETE) is not None  # B's marker: nothing deleted it
    marker = json.loads(run.storage.get(layout.COMPLETE))
    assert marker["lease_epoch"] == 2


def test_budgets_continue_across_three_machines(run: Run, machines: Callable[..., Machine]) -> None:
    for i in (1, 2, 3):
        m = machines(f"machine-{i}")
        m.env["CKRUN_MAX_REQUEUES"] = "2"
        first = run.newest_step()
        m.start()
        wait_for(lambda m=m, first=first: m.progress().get("step", 0) >= max(first, 0) + 3,
                 120, f"machine-{i} training")  # fmt: skip
        assert m.proc is not None
        os.kill(m.proc.pid, signal.SIGTERM)  # the machine is being stopped
        assert m.finish() == 75, m.stderr()[-3000:]
        evs = m.events()
        pre = [e for e in evs if e["kind"] == "preempted"][-1]
        assert f"requeue {i}/2" in pre["message"]
        assert ("budget spent" in pre["message"]) == (i == 3)
        start = [e for e in evs if e["kind"] == "supervisor_start"][-1]
        assert start["budgets"]["preemptions"] == i - 1  # read from the run's storage
    state = json.loads(run.storage.get(layout.RUN_STATE))
    assert state["preemptions"] == 3 and state["attempts"] == 3
    kinds = [e["kind"] for e in state["events"]]  # the history travels with the run
    assert kinds.count("supervisor_start") == 3 and kinds.count("preempted") == 3
