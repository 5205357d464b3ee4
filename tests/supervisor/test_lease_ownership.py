"""A lost lease in the pure state machine, and the supervisor's Ownership (issue 12).

The machine rows need no processes; the Ownership tests use a real LocalStorage, a
real heartbeat thread and a second Lease that takes the run over.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
from ckrun.checkpoint.lease import Lease, read_lease
from ckrun.config import resolve
from ckrun.errors import LeaseHeld
from ckrun.storage.local import LocalStorage
from ckrun.supervisor import machine as sm
from ckrun.supervisor.machine import Phase
from ckrun.supervisor.ownership import Ownership, wait_for_lease_s

P = sm.Policy(grace_s=30.0, margin_s=2.0, kill_delay_s=5.0)


def running(**kw: Any) -> sm.State:
    base: dict[str, Any] = dict(policy=P, phase=Phase.RUNNING, attempt=1, child=True, base_step=10)
    base.update(kw)
    return sm.State(**base)


def lost(now: float = 100.0) -> sm.NoticeEvent:
    return sm.NoticeEvent("termination", "lease:lost", now + 30, now, lease_lost=True)


def test_lost_lease_drains_the_child_then_exits_2_without_requeue() -> None:
    s, acts = sm.step(running(), lost())
    assert s.phase is Phase.DRAINING and s.lease_lost
    assert [type(a).__name__ for a in acts][:2] == ["WriteNotice", "Deliver"]
    s, acts = sm.step(s, sm.ChildExited(2, 10, False, 101.0))
    assert s.phase is Phase.LEASE_LOST and s.exit_code == 2
    assert not any(isinstance(a, sm.Requeue) for a in acts)
    assert any(isinstance(a, sm.Exit) and a.code == 2 for a in acts)


def test_lost_lease_during_backoff_or_preflight_never_spawns() -> None:
    backoff = running(child=False, respawn_at=150.0)
    s, acts = sm.step(backoff, lost())
    assert s.phase is Phase.LEASE_LOST and s.exit_code == 2
    pre = sm.State(policy=P, lease_lost=True)
    s, acts = sm.step(pre, sm.Preflighted(sm.PreflightOutcome.READY, 10))
    assert s.phase is Phase.LEASE_LOST and not any(isinstance(a, sm.Spawn) for a in acts)


def _cfg(**kw: Any) -> Any:
    return resolve("local", {"lease_ttl_s": 2, "lease_heartbeat_s": 0.1, **kw}, {}, run="r1")


def test_wait_for_lease_default() -> None:
    assert wait_for_lease_s(_cfg(), {}) == 0.0
    assert wait_for_lease_s(_cfg(), {"SLURM_RESTART_COUNT": "1"}) == 4.0  # requeued job
    cloud = dataclasses.replace(_cfg(), notice_sources=("aws",))
    assert wait_for_lease_s(cloud, {}) == 4.0
    assert wait_for_lease_s(_cfg(), {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == 4.0
    assert wait_for_lease_s(_cfg(wait_for_lease_s=7), {"SLURM_RESTART_COUNT": "1"}) == 7.0


def test_heartbeat_renews_and_notices_a_takeover(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "run"))
    said: list[str] = []
    own = Ownership(_cfg(), storage, job_id="42", attempt=3, say=said.append)
    own.acquire()
    assert own.epoch == 1 and "epoch 1" in said[0]
    first = read_lease(storage)
    assert first is not None and first[0].holder is not None
    assert first[0].holder.job_id == "42" and first[0].holder.attempt == 3

    def renewals() -> int:
        cur = read_lease(storage)
        return cur[0].renewals if cur else -1

    deadline = time.monotonic() + 10
    while renewals() < 3 and time.monotonic() < deadline:  # the thread beats every 0.1 s
        time.sleep(0.02)
    assert renewals() >= 3 and own.lost is None

    rival = Lease(storage, "r1", ttl_s=2)
    with pytest.raises(LeaseHeld, match="job 42 attempt 3"):
        rival.acquire(wait_s=0)
    # another machine takes the run over (as after a pause longer than the TTL)
    cur = read_lease(storage)
    assert cur is not None
    own._stop.set()  # the holder "freezes"; its thread ends
    assert own._thread is not None
    own._thread.join()
    rival.holder = dataclasses.replace(rival.holder, machine="other")
    assert rival.acquire(wait_s=10, poll_s=0.05).epoch == 2  # waited out the silence
    assert own.check() is not None and "lost" in (own.lost or "")
    own.release()  # never overwrites the new owner's lease
    cur = read_lease(storage)
    assert cur is not None and cur[0].epoch == 2 and cur[0].holder is not None
