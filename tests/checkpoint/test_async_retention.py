"""An async save's pause does not wait for the last save's retention pass (issue 19,
the async pause): a synchronous save's deletions run in the background, and an
``async_save`` right after it returns once its snapshot is taken; its background
persist waits for the pass before it writes, so retention still never runs beside a
save's writes.  Real saves on the local disk; the retention pass is held on an event,
so each test observes the order of the calls, not a timing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ckrun.checkpoint import pipeline, retention
from ckrun.checkpoint.checkpointer import Checkpointer
from ckrun.checkpoint.discovery import committed
from ckrun.errors import StorageError
from ckrun.storage.local import LocalStorage


def _steps(root: Path) -> list[int]:
    return sorted(m.step for m in committed(LocalStorage(str(root))))


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    return {"model": model, "extra": {"w": torch.randn(1000)}}


class _HeldRetention:
    """``retention.retain_after`` held until :attr:`go` is set; records the order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.calls: list[str] = []
        real_retain, real_persist = retention.retain_after, pipeline.persist

        def held(*a: Any, **kw: Any) -> Any:
            self.entered.set()
            self.go.wait()
            out = real_retain(*a, **kw)
            self.calls.append("retention done")
            return out

        def persist(*a: Any, **kw: Any) -> Any:
            self.calls.append(f"persist step {a[1]}")
            return real_persist(*a, **kw)

        monkeypatch.setattr(retention, "retain_after", held)
        monkeypatch.setattr(pipeline, "persist", persist)


def test_an_async_save_returns_while_the_last_retention_pass_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    with Checkpointer(str(tmp_path), rng=False, lock=False, keep_last=1) as ck:
        ck.save(1, state)  # nothing to delete yet: its pass is not held
        pipeline.wait_retention(ck._ctx)
        held = _HeldRetention(monkeypatch)
        ck.save(2, state)  # its retention pass (deleting step 1) is held
        assert held.entered.wait(30)
        returned = threading.Event()
        handle: list[Any] = []

        def call() -> None:
            handle.append(ck.async_save(3, state))
            returned.set()

        caller = threading.Thread(target=call)
        caller.start()
        try:
            # the pause ends while the pass is still held (before: it waited for it)
            assert returned.wait(20), "async_save waited for the last save's retention"
            assert held.calls == ["persist step 2"]  # the persist has not written
        finally:
            held.go.set()
            caller.join()
        m = handle[0].result()
        assert m.step == 3
        # the pass finished before the persist began to write step 3
        assert held.calls[1:3] == ["retention done", "persist step 3"]
        assert _steps(tmp_path) == [3]


def test_a_retention_error_fails_the_async_save_that_waited_for_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass that raises (an error it does not log itself) fails the async save that
    took it over, on its handle, and only that save: the next save commits and close
    closes the async saver."""
    state = _state()
    ck = Checkpointer(str(tmp_path), rng=False, lock=False, keep_last=1)
    ck.save(1, state)
    gate = threading.Event()
    real = retention.retain_after

    def broken(*a: Any, **kw: Any) -> Any:
        gate.wait(30)  # before the fix the call itself waited here
        raise RuntimeError("retention broke")

    monkeypatch.setattr(retention, "retain_after", broken)
    ck.save(2, state)
    h = ck.async_save(3, state)
    gate.set()
    with pytest.raises(RuntimeError, match="retention broke"):
        h.result()
    monkeypatch.setattr(retention, "retain_after", real)
    assert ck.save(4, state).step == 4  # the error was this one save's
    ck.close()
    assert ck._async is None or ck._async._closed
    assert 3 not in _steps(tmp_path) and 4 in _steps(tmp_path)


def test_storage_errors_of_the_pass_stay_in_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A storage error of the pass is logged by it (retention retries after the next
    save), as for a synchronous save: the async save after it commits."""
    state = _state()
    with Checkpointer(str(tmp_path), rng=False, lock=False, keep_last=1) as ck:
        ck.save(1, state)

        def failing(*a: Any, **kw: Any) -> Any:
            raise StorageError("disk said no")

        monkeypatch.setattr(retention, "retain_after", failing)
        ck.save(2, state)
        m = ck.async_save(3, state).result()
        assert m.step == 3
    assert "retention after step 2 failed" in caplog.text
