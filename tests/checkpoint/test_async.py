"""Async saves (issue 7): snapshot isolation, commit order, buffer reuse, errors, drain,
emergency saves under a notice deadline.  Real files on the local disk; the only hook is
:class:`async_helpers.GatedStorage`, which holds shard writes at a gate so a test acts
while the background persist is provably in progress."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch
from async_helpers import GatedStorage
from ckpt_helpers import make_state, params_equal
from ckrun.checkpoint import discovery
from ckrun.checkpoint.async_save import AsyncSaveHandle
from ckrun.checkpoint.verify import verify_manifest
from ckrun.control import write_notice
from ckrun.errors import StorageFull
from ckrun.notices import Notice


def _steps(run: Path) -> list[int]:
    return [m.step for m in discovery.scan(ckrun.open_storage(str(run))).manifests]


def _flat(s: dict[str, Any]) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in s["model"].parameters()]
    for st in s["optimizer"].state.values():
        out += [v.clone() for v in st.values() if torch.is_tensor(v)]
    return out


def test_mutation_after_return_does_not_leak(run_dir: Path) -> None:
    st = GatedStorage(str(run_dir))
    st.gate.clear()  # the persist cannot read a byte until the state was mutated
    s = make_state(1)
    before = _flat(s)
    with ckrun.Checkpointer(storage=st) as ck:
        h = ck.async_save(4, s)
        assert isinstance(h, AsyncSaveHandle) and not h.done()
        with torch.no_grad():
            for p in s["model"].parameters():
                p.mul_(-3).add_(1)
            for v in s["optimizer"].state.values():
                v["exp_avg"].fill_(123.0)
        s["extra"]["epoch"] = 99
        torch.rand(5)  # advances the RNG after the snapshot
        st.gate.set()
        assert h.result(60).step == 4
    fresh = make_state(7)
    with ckrun.Checkpointer(storage=str(run_dir)) as ck2:
        assert ck2.load(fresh).step == 4
    assert all(torch.equal(a, b) for a, b in zip(before, _flat(fresh), strict=True))
    assert fresh["extra"]["epoch"] == 0


def test_latest_and_retention_move_only_after_the_commit(run_dir: Path) -> None:
    st = GatedStorage(str(run_dir))
    s = make_state(1)
    with ckrun.Checkpointer(storage=st, keep_last=1) as ck:
        ck.async_save(1, s).result(60)
        st.gate.clear()
        h = ck.async_save(2, s)
        assert st.started.wait(30)  # the worker is inside the shard write
        assert _steps(run_dir) == [1]
        assert ck.latest() is not None and ck.latest().step == 1
        assert not h.done()
        st.gate.set()
        m = ck.wait()
        assert m is not None and m.step == 2
        assert ck.latest().step == 2
    assert _steps(run_dir) == [2]  # retention ran after the commit, keep_last=1


def test_host_buffers_allocated_once_and_reused(run_dir: Path) -> None:
    s = make_state(1)
    with ckrun.Checkpointer(storage=str(run_dir)) as ck:
        ck.async_save(1, s)
        assert ck._async is not None
        ptr = ck._async.buffers.data_ptr()
        for step in (2, 3, 4):
            ck.async_save(step, s)
        ck.wait()
        assert ck._async.buffers.data_ptr() == ptr and ck._async.buffers.allocations == 1
        big = make_state(1, width=64)  # more bytes: one new arena, then reused again
        ck.async_save(5, big)
        ck.async_save(6, big)
        assert ck.wait().step == 6
        assert ck._async.buffers.allocations == 2
    got = make_state(2, width=64)
    with ckrun.Checkpointer(storage=str(run_dir)) as ck2:
        ck2.load(got)
    assert params_equal(got, big)


def test_at_most_one_save_in_flight(run_dir: Path) -> None:
    st = GatedStorage(str(run_dir))
    st.gate.clear()
    s = make_state(1)
    second: list[Any] = []
    with ckrun.Checkpointer(storage=st) as ck:
        h1 = ck.async_save(1, s)
        t = threading.Thread(target=lambda: second.append(ck.async_save(2, s)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not h1.done()  # the second call waits for the first
        st.gate.set()
        t.join(60)
        assert h1.result().step == 1 and second[0].result(60).step == 2
    assert _steps(run_dir) == [2, 1]


def test_worker_error_surfaces_on_result_next_save_wait_close(small_fs: Path) -> None:
    big = {"w": torch.ones(1 << 20)}  # 4 MiB on a 512 KiB filesystem: ENOSPC in the worker
    small = {"w": torch.ones(1000)}
    run = small_fs / "run"
    with ckrun.Checkpointer(storage=str(run), rng=False) as ck:
        ck.async_save(1, small).result(60)
        with pytest.raises(StorageFull):
            ck.async_save(2, big).result(60)
        assert ck.async_save(3, small).result(60).step == 3  # observed: not raised again
        ck.async_save(4, big)
        with pytest.raises(StorageFull) as ei:  # unobserved: the next save raises it
            ck.async_save(5, small)
        assert "background save of step 4" in "".join(ei.value.__notes__)
        ck.async_save(5, small).result(60)
        ck.async_save(6, big)
        with pytest.raises(StorageFull):
            ck.wait()
        assert ck.wait() is None
        ck.async_save(7, big)
        with pytest.raises(StorageFull):
            ck.save(8, small)  # a sync save also surfaces it
        ck.async_save(9, big)
        with pytest.raises(StorageFull):
            ck.close()
    assert _steps(run) == [5, 3, 1]


def test_exit_without_wait_drains_the_save(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = (
        "import ckrun, torch, sys\n"
        f"ck = ckrun.Checkpointer(storage={str(run)!r}, rng=False)\n"
        "h = ck.async_save(7, {'w': torch.arange(1 << 22, dtype=torch.float32)})\n"
        "print('returned', h.done(), flush=True)\n"
        "sys.exit(75)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 75, r.stderr
    st = ckrun.open_storage(str(run))
    ms = discovery.scan(st).manifests
    assert [m.step for m in ms] == [7] and verify_manifest(st, ms[0]) == []
    got = {"w": torch.zeros(1 << 22)}
    with ckrun.Checkpointer(storage=str(run), rng=False) as ck:
        ck.load(got)
    assert torch.equal(got["w"], torch.arange(1 << 22, dtype=torch.float32))


def _emergency(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lead_s: float
) -> tuple[ckrun.Manifest, list[int]]:
    cdir = tmp_path / "control"
    monkeypatch.setenv("CKRUN_CONTROL_DIR", str(cdir))
    st = GatedStorage(str(run_dir))
    s = make_state(1)
    out: list[ckrun.Manifest] = []
    with ckrun.Checkpointer(storage=st, keep_last=5) as ck:
        ck.async_save(1, s).result(60)
        st.gate.clear()
        ck.async_save(2, s)
        assert st.started.wait(30)
        write_notice(str(cdir), Notice.with_lead("preemption", "test", lead_s))
        t = threading.Thread(target=lambda: out.append(ck.save(3, s)))
        t.start()
        st.gate.set()
        t.join(60)
    return out[0], _steps(run_dir)


def test_emergency_save_waits_then_saves_when_the_deadline_allows(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, steps = _emergency(run_dir, tmp_path, monkeypatch, lead_s=600.0)
    assert m.step == 3 and steps == [3, 2, 1]


def test_emergency_save_commits_the_inflight_snapshot_when_late(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    m, steps = _emergency(run_dir, tmp_path, monkeypatch, lead_s=0.001)
    assert m.step == 2 and steps == [2, 1]
    assert "committed the in-flight snapshot of step 2" in caplog.text


def test_async_save_of_a_step_already_committed_returns_it(run_dir: Path) -> None:
    s = make_state()
    with ckrun.Checkpointer(storage=str(run_dir)) as ck:
        a = ck.save(3, s)
        h = ck.async_save(3, s)
        assert h.done() and h.result() is a
        with pytest.raises(ckrun.CheckpointError, match="step"):
            ck.async_save(-1, s)


def test_emergency_save_goes_ahead_when_the_inflight_save_failed(
    small_fs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cdir = tmp_path / "control"
    monkeypatch.setenv("CKRUN_CONTROL_DIR", str(cdir))
    run = small_fs / "run"
    with ckrun.Checkpointer(storage=str(run), rng=False) as ck:
        ck.async_save(1, {"w": torch.ones(1 << 20)})  # 4 MiB on 512 KiB: fails in the worker
        write_notice(str(cdir), Notice.with_lead("preemption", "test", 600.0))
        assert ck.save(2, {"w": torch.ones(1000)}).step == 2
        assert ck.wait() is None
    assert _steps(run) == [2]
