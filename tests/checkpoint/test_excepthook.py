"""Issue 13 item 4: an uncaught error drains the in-flight async save, keeps its status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ckrun
import pytest
from ckrun.checkpoint import discovery

PROG = str(Path(__file__).parent / "progs" / "raise_in_flight.py")


def test_exception_with_an_async_save_in_flight_still_commits_it(run_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKRUN_")}
    r = subprocess.run(
        [sys.executable, PROG, str(run_dir)], capture_output=True, text=True, timeout=120, env=env
    )
    assert "save in flight" in r.stdout
    assert r.returncode == 5, r.stderr  # the error's exit code, as before
    assert "ckrun: StorageError: the dataset mount went away" in r.stderr
    committed = discovery.committed(ckrun.open_storage(str(run_dir)))
    assert [m.step for m in committed] == [1], r.stderr


def test_exit_drain_is_bounded_by_the_notice_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past a notice's deadline the exit drain gives up on a save that cannot finish
    (here: a shard write held until the end of the test) instead of hanging."""
    import datetime as dt
    import threading
    import weakref

    import torch
    from ckrun import control
    from ckrun.checkpoint import async_exit
    from ckrun.notices import Notice
    from ckrun.storage.local import LocalStorage

    gate = threading.Event()

    class Held(LocalStorage):
        def open_write(self, key: str, **kw: Any) -> Any:
            if "/shard-" in key:
                gate.wait(120)
            return super().open_write(key, **kw)

    cdir = tmp_path / "control"
    cdir.mkdir()
    monkeypatch.setenv("CKRUN_CONTROL_DIR", str(cdir))
    now = dt.datetime.now(dt.timezone.utc)
    notice = Notice("preemption", "cli", now, now - dt.timedelta(seconds=1))
    control.write_notice(str(cdir), notice)
    ck = ckrun.Checkpointer(Held(str(tmp_path / "run")), rng=False)
    try:
        ck.async_save(1, {"w": torch.ones(8)})
        assert ck._async is not None
        drain = threading.Thread(target=async_exit.finish_at_exit, args=(weakref.ref(ck._async),))
        drain.start()
        drain.join(60)
        assert not drain.is_alive(), "the exit drain waited past the deadline"
    finally:
        gate.set()
        ck.close()
    assert [m.step for m in discovery.committed(ckrun.open_storage(str(tmp_path / "run")))] == [1]
