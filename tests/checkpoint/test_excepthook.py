"""Issue 13 item 4: an uncaught error drains the in-flight async save, keeps its status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ckrun
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
