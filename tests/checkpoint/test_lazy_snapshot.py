"""Lazy snapshot of ``async_save`` (issue 19): tensors copied during the next step.

Real model (Linear + BatchNorm + Linear), real AdamW/SGD steps, real shards on the local
disk.  To make "the copier has not copied this tensor yet when step() comes"
deterministic, the copier (the persist thread) is held on a real ``threading.Event``
before each of its copies; copies made by the optimizer's pre-hook (the training
thread) pass freely.
"""

from __future__ import annotations

import copy
import glob
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch
from ckrun.checkpoint import async_save as aio
from ckrun.checkpoint import discovery
from ckrun.checkpoint.lazy_snapshot import DONE, LazySnapshot
from ckrun.control import write_notice
from ckrun.notices import Notice

K = 3  # the step saved


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def make(two: bool = False) -> dict[str, Any]:
    """A state: model, AdamW (and with ``two`` an SGD with momentum on the head)."""
    torch.manual_seed(0)
    model = Net()
    if two:
        body = [*model.a.parameters(), *model.bn.parameters()]
        return {
            "model": model,
            "optimizer": torch.optim.AdamW(body, lr=1e-2),
            "head_optimizer": torch.optim.SGD(model.b.parameters(), lr=1e-2, momentum=0.9),
            "extra": {"epoch": 1},
        }
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
        "extra": {"epoch": 1},
    }


def optimizers(state: dict[str, Any]) -> list[torch.optim.Optimizer]:
    return [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]


def train(state: dict[str, Any], steps: int, *, only: int | None = None) -> None:
    """``steps`` real steps (forward/backward/step) with a fixed data stream."""
    model = state["model"]
    opts = optimizers(state)
    for _ in range(steps):
        x = torch.randn(32, 8)
        loss = model(x).pow(2).mean()
        for o in opts:
            o.zero_grad()
        loss.backward()
        for i, o in enumerate(opts):
            if only is None or i == only:
                o.step()


def shard_bytes(run: Path, step: int) -> bytes:
    (path,) = glob.glob(str(run / "checkpoints" / f"step-{step:0{10}d}" / "shard-*"))
    return Path(path).read_bytes()


@pytest.fixture
def held_copier(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold the copier before it takes each tensor until the event is set."""
    gate = threading.Event()
    orig = LazySnapshot._claim
    main = threading.main_thread()

    def gated(self: LazySnapshot, entries: Any) -> Any:
        if threading.current_thread() is not main and not gate.wait(30):
            gate.set()  # the test failed before releasing the copier: let the save end
        return orig(self, entries)

    monkeypatch.setattr(LazySnapshot, "_claim", gated)
    yield gate
    gate.set()


def sync_reference(tmp_path: Path, state: dict[str, Any]) -> bytes:
    """The shard a synchronous save of (a deep copy of) ``state`` writes at step K."""
    ref = tmp_path / "ref"
    with ckrun.Checkpointer(str(ref), run="r", attempt=0, rng=False) as ck:
        ck.save(K, copy.deepcopy(state))
    return shard_bytes(ref, K)


def lazy_saver(tmp_path: Path) -> ckrun.Checkpointer:
    return ckrun.Checkpointer(str(tmp_path / "run"), run="r", attempt=0, rng=False)


def started_lazy(ck: ckrun.Checkpointer) -> LazySnapshot:
    lz = ck._async._lazy if ck._async is not None else None
    assert isinstance(lz, LazySnapshot)
    return lz


def test_lazy_save_is_bitwise_a_sync_save_at_the_same_step(tmp_path: Path) -> None:
    """The copier runs freely while the next steps train (and move BatchNorm's running
    statistics in forward): the committed shard is byte for byte the synchronous one."""
    state = make()
    train(state, K)
    expected = sync_reference(tmp_path, state)
    with lazy_saver(tmp_path) as ck:
        h = ck.async_save(K, state, lazy=True)
        lz = started_lazy(ck)
        train(state, 3)
        assert h.result().step == K
        assert lz.stats.eager >= 3  # BatchNorm's running_mean, running_var, count
        assert lz.stats.by_copier + lz.stats.by_hook == len(lz.entries) > 0
    assert shard_bytes(tmp_path / "run", K) == expected


def test_an_uncopied_tensor_is_copied_before_the_step_writes_it(
    tmp_path: Path, held_copier: threading.Event
) -> None:
    """The copier is held: step() finds every parameter and AdamW moment uncopied, its
    pre-hook copies them first; the shard is still bitwise the synchronous one."""
    state = make()
    train(state, K)
    expected = sync_reference(tmp_path, state)
    with lazy_saver(tmp_path) as ck:
        h = ck.async_save(K, state, metrics={"loss": 1.0}, lazy=True)
        lz = started_lazy(ck)
        assert lz.stats.by_hook == 0 and not h.done()
        train(state, 2)  # the pre-hook of the first step copies everything
        assert lz.stats.by_hook == len(lz.entries) > 0
        held_copier.set()
        assert h.result().step == K
        assert lz.stats.by_copier == 0
    assert shard_bytes(tmp_path / "run", K) == expected


def test_two_optimizers_each_copy_their_own_tensors_first(
    tmp_path: Path, held_copier: threading.Event
) -> None:
    state = make(two=True)
    train(state, K)
    expected = sync_reference(tmp_path, state)
    body, head = optimizers(state)
    with lazy_saver(tmp_path) as ck:
        h = ck.async_save(K, state, lazy=True)
        lz = started_lazy(ck)
        n_body = sum(1 for e in lz.entries if e.owners == (0,))
        n_head = sum(1 for e in lz.entries if e.owners == (1,))
        assert n_body and n_head and n_body + n_head == len(lz.entries)
        train(state, 1, only=0)  # only the AdamW steps: only its tensors are copied
        assert lz.stats.by_hook == n_body
        assert len(body._optimizer_step_pre_hooks) == 0
        assert len(head._optimizer_step_pre_hooks) == 1
        train(state, 1)  # now the SGD too (and AdamW again, hook gone)
        assert lz.stats.by_hook == n_body + n_head
        held_copier.set()
        h.result()
    assert shard_bytes(tmp_path / "run", K) == expected


def test_hooks_are_gone_once_the_copy_is_complete(tmp_path: Path) -> None:
    state = make()
    opt = state["optimizer"]
    train(state, 1)
    with lazy_saver(tmp_path) as ck:
        ck.async_save(1, state, lazy=True)
        assert len(opt._optimizer_step_pre_hooks) == 1
        train(state, 1)  # the hook is the last one: it removes itself in step()
        assert len(opt._optimizer_step_pre_hooks) == 0
        ck.wait()
        # a hook registered after ours: ours stays until the next safe point (wait)
        ck.async_save(2, state, lazy=True)
        user = opt.register_step_pre_hook(lambda *a: None)
        train(state, 1)
        assert len(opt._optimizer_step_pre_hooks) == 2
        ck.wait()
        assert list(opt._optimizer_step_pre_hooks) == [user.id]
        user.remove()


def test_an_in_place_write_outside_the_step_fails_the_save_without_a_commit(
    tmp_path: Path, held_copier: threading.Event
) -> None:
    state = make()
    train(state, 1)
    with lazy_saver(tmp_path) as ck:
        ck.save(1, state)  # the last good checkpoint
        h = ck.async_save(2, state, lazy=True)
        with torch.no_grad():
            state["model"].b.weight.mul_(0.5)  # a manual update outside optimizer.step()
        held_copier.set()
        with pytest.raises(ckrun.CheckpointError) as ei:
            h.result()
        msg = str(ei.value)
        assert "user.model.b.weight" in msg and "outside optimizer.step()" in msg
        assert "lazy=False" in msg
        storage = ckrun.open_storage(str(tmp_path / "run"))
        assert [m.step for m in discovery.committed(storage)] == [1]
        assert ck.latest() is not None and ck.latest().step == 1  # type: ignore[union-attr]
        assert not glob.glob(str(tmp_path / "run" / "checkpoints" / "step-*2" / "shard-*"))


def test_an_optimizer_not_in_the_state_is_caught_at_the_step(tmp_path: Path) -> None:
    """A second optimizer over the same parameters, not saved: its step is not guarded,
    so the save fails (in the pre-hook's check of the saved optimizer, or before the
    commit) instead of committing mixed content."""
    state = make()
    other = torch.optim.SGD(state["model"].parameters(), lr=0.1)
    train(state, 1)
    gate = threading.Event()
    orig = LazySnapshot.copy_all

    def held(self: LazySnapshot) -> None:
        gate.wait(30)
        orig(self)

    with lazy_saver(tmp_path) as ck:
        LazySnapshot.copy_all = held  # type: ignore[method-assign]
        try:
            h = ck.async_save(2, state, lazy=True)
            state["model"](torch.randn(4, 8)).sum().backward()
            other.step()
            gate.set()
            with pytest.raises(ckrun.CheckpointError, match="outside optimizer.step"):
                h.result()
        finally:
            LazySnapshot.copy_all = orig  # type: ignore[method-assign]
        assert ck.latest() is None


def test_a_pending_notice_keeps_the_save_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cdir = tmp_path / "control"
    cdir.mkdir()
    monkeypatch.setenv("CKRUN_CONTROL_DIR", str(cdir))
    write_notice(str(cdir), Notice.with_lead("preemption", "test", 600.0))
    state = make()
    train(state, 1)
    with ckrun.Checkpointer(str(tmp_path / "run"), rng=False, lazy_snapshot=True) as ck:
        h = ck.async_save(1, state)
        assert ck._async is not None and ck._async._lazy is None
        assert len(state["optimizer"]._optimizer_step_pre_hooks) == 0
        h.result()


def test_lazy_snapshot_is_the_checkpointers_default_when_asked(tmp_path: Path) -> None:
    state = make()
    train(state, 1)
    with ckrun.Checkpointer(str(tmp_path / "run"), rng=False, lazy_snapshot=True) as ck:
        ck.async_save(1, state)
        assert isinstance(started_lazy(ck), LazySnapshot)
        ck.wait()
        ck.async_save(2, state, lazy=False)  # per call: eager
        assert ck._async is not None and ck._async._lazy is None
    assert isinstance(aio.AsyncSaver, type) and os.path.isdir(tmp_path / "run")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lazy_save_of_cuda_tensors_is_bitwise_a_sync_save(
    tmp_path: Path, held_copier: threading.Event
) -> None:
    """The CUDA path (side stream, events, pinned buffers): skipped without a GPU."""
    state = make()
    state["model"].cuda()
    state["optimizer"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-2)

    def cuda_train(steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(32, 8, device="cuda")
            state["optimizer"].zero_grad()
            state["model"](x).pow(2).mean().backward()
            state["optimizer"].step()

    cuda_train(K)
    expected = sync_reference(tmp_path, state)
    with lazy_saver(tmp_path) as ck:
        h = ck.async_save(K, state, lazy=True)
        cuda_train(2)
        held_copier.set()
        h.result()
    assert shard_bytes(tmp_path / "run", K) == expected


def _until(cond: Any, what: str, timeout_s: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def _leaves_idle() -> None:
    from ckrun.storage import priority

    if not hasattr(os, "SCHED_IDLE") or not priority.can_leave_idle(0):
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE / RLIMIT_NICE)")


def test_the_copier_copies_at_sched_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copier takes only cores the training leaves idle (SCHED_IDLE, as the persist):
    at the training's priority its copy slowed the overlapped step 1.31× on 2 busy cores
    (bench/README.md, lazy rows); ``CKRUN_PERSIST_SCHED=other`` keeps the old policy."""
    _leaves_idle()
    seen: list[int] = []
    orig = LazySnapshot._copy
    main = threading.main_thread()

    def spy(self: LazySnapshot, e: Any, **kw: Any) -> None:
        if threading.current_thread() is not main:
            seen.append(os.sched_getscheduler(0))
        orig(self, e, **kw)

    monkeypatch.setattr(LazySnapshot, "_copy", spy)
    for sched, want in (("idle", os.SCHED_IDLE), ("other", os.SCHED_OTHER)):
        monkeypatch.setenv("CKRUN_PERSIST_SCHED", sched)
        seen.clear()
        state = make()
        train(state, 1)
        with ckrun.Checkpointer(str(tmp_path / sched), rng=False) as ck:
            h = ck.async_save(2, state, lazy=True)
            lz = started_lazy(ck)
            # result() raises a waited-for copier (by design): let it finish unwaited
            _until(lambda lz=lz: all(e.state == DONE for e in lz.entries), "the copies")
            h.result()
        assert seen and set(seen) == {want}, (sched, seen)


def test_a_step_waiting_for_the_copier_raises_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the optimizer's pre-hook must wait for a tensor the idle copier is copying,
    the copier goes back to the normal policy first: a busy machine cannot starve the
    step behind it."""
    _leaves_idle()
    monkeypatch.setenv("CKRUN_PERSIST_SCHED", "idle")
    entered, gate = threading.Event(), threading.Event()
    policy: list[int] = []
    orig = LazySnapshot._copy
    main = threading.main_thread()
    trainer: list[threading.Thread] = []

    def held(self: LazySnapshot, e: Any, **kw: Any) -> None:
        me = threading.current_thread()
        if me is not main and me not in trainer and not entered.is_set():
            entered.set()
            gate.wait(30)  # released by the test (or on its failure: copy anyway)
            policy.append(os.sched_getscheduler(0))
        orig(self, e, **kw)

    monkeypatch.setattr(LazySnapshot, "_copy", held)
    state = make()
    train(state, 1)
    with ckrun.Checkpointer(str(tmp_path / "run"), rng=False) as ck:
        h = ck.async_save(2, state, lazy=True)
        assert entered.wait(10)
        lz = started_lazy(ck)
        t = threading.Thread(target=train, args=(state, 1))
        trainer.append(t)
        t.start()  # its step's pre-hook copies the rest, then waits for the held tensor
        import time

        deadline = time.monotonic() + 10
        try:
            while os.sched_getscheduler(lz._copier_tid or 0) != os.SCHED_OTHER:
                assert time.monotonic() < deadline, "the waiting step did not raise the copier"
                time.sleep(0.01)
        finally:
            gate.set()
        t.join(30)
        h.result()
    assert policy == [os.SCHED_OTHER]
    assert lz.stats.by_hook >= 1 and lz.stats.by_copier >= 1


def test_the_idle_copier_leaves_no_unraisable_idle_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's ``copy_`` from another thread starts an OpenMP worker of that thread's
    own; started by the idle copier it would inherit SCHED_IDLE, and raising the copier
    (a step waiting for it) would leave that worker starving.  Every thread at
    SCHED_IDLE after a lazy save is one the priority module raises when waited for."""
    _leaves_idle()
    from ckrun.storage import priority

    monkeypatch.setenv("CKRUN_PERSIST_SCHED", "idle")
    state = make()
    # tensors above torch's parallel grain (32768 elements): copy_ would use a team
    state["model"].a = torch.nn.Linear(8, 16384)
    state["model"].bn = torch.nn.BatchNorm1d(16384)
    state["model"].b = torch.nn.Linear(16384, 4)
    state["optimizer"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-2)
    train(state, 1)
    with ckrun.Checkpointer(str(tmp_path / "run"), rng=False) as ck:
        ck.async_save(2, state, lazy=True).result()
        assert started_lazy(ck).stats.by_copier >= 1
        idle = {
            int(t) for t in os.listdir("/proc/self/task") if priority.policy_name(int(t)) == "idle"
        }
        names = {t.native_id: t.name for t in threading.enumerate()}  # in the message
        stray = idle - priority.registered()
        assert not stray, [(t, names.get(t)) for t in stray]


def test_a_copier_failing_mid_entry_fails_the_save_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error in the copier between claiming a tensor and finishing its copy (here: in
    the copy itself, before the entry is marked) fails the save with the copier's error;
    the entry it held is not left pending for the persist to wait on forever."""
    main = threading.main_thread()

    def broken(self: LazySnapshot, e: Any, **kw: Any) -> None:
        if threading.current_thread() is not main:
            raise MemoryError("simulated: the copier died mid-copy")

    monkeypatch.setattr(LazySnapshot, "_copy", broken)
    state = make()
    train(state, 1)
    with ckrun.Checkpointer(str(tmp_path / "run"), rng=False) as ck:
        h = ck.async_save(2, state, lazy=True)
        with pytest.raises(ckrun.CheckpointError, match="the copier stopped"):
            h.result(timeout=30)
        assert ck.latest() is None


class BigNet(Net):
    """Net with an 8 MiB parameter: its entries (and AdamW's two moments of it) are
    hashed beside their writes (:mod:`ckrun.checkpoint.crc_beside`)."""

    def __init__(self) -> None:
        super().__init__()
        from ckrun.checkpoint import crc_beside

        self.big = torch.nn.Parameter(torch.randn(2 * crc_beside.BESIDE_BYTES // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.big.mean()


def test_a_lazy_save_hashes_its_big_entries_from_their_final_bytes(
    tmp_path: Path, held_copier: threading.Event
) -> None:
    """Big entries copied by the optimizer's pre-hook while the next step runs are
    hashed from the copies once they have landed: the shard is byte for byte the
    synchronous one and every CRC32C in the manifest is that of the file's bytes."""
    import crc32c

    torch.manual_seed(0)
    model = BigNet()
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    train(state, K)
    expected = sync_reference(tmp_path, state)
    with lazy_saver(tmp_path) as ck:
        h = ck.async_save(K, state, lazy=True)
        lz = started_lazy(ck)
        train(state, 1)  # the held copier took nothing: the step's pre-hook copies
        held_copier.set()
        m = h.result()
        assert lz.stats.by_hook >= 3  # big, and AdamW's exp_avg and exp_avg_sq of it
    data = shard_bytes(tmp_path / "run", K)
    assert data == expected
    assert m.shards[0].checksum == f"crc32c:{crc32c.crc32c(data):08x}"
    assert m.tensor_layout is not None
    entries = m.tensor_layout["shards"][0]["entries"].values()
    assert sum(end - begin >= 2 * (4 << 20) for begin, end, _ in entries) == 3
    for begin, end, crc in entries:
        assert crc == f"crc32c:{crc32c.crc32c(data[begin:end]):08x}"
