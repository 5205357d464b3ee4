"""Checkpointer.from_env: the CKRUN_* environment and the exit-code excepthook."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.errors import ConfigError

SCRIPT = """
import ckrun, torch
ck = ckrun.Checkpointer.from_env(compat={{"model_version": "{mv}"}})
state = {{"w": torch.ones(3)}}
m = ck.load(state)
print("loaded", None if m is None else m.step, ck.attempt, ck.run, flush=True)
print("saved", ck.save({step}, state).compat.get("launch_hash"), flush=True)
"""


def _child(run_dir: Path, step: int, mv: str = "v1", **env: str) -> subprocess.CompletedProcess:
    e = dict(
        os.environ,
        CKRUN_STORAGE=str(run_dir),
        CKRUN_RUN="demo",
        CKRUN_ATTEMPT="3",
        CKRUN_CONFIG_HASH="ab12",
    )
    e.update(env)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.format(step=step, mv=mv)],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_env_configures_and_incompatible_exits_4(run_dir: Path) -> None:
    r = _child(run_dir, 1)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["loaded None 3 demo", "saved ab12"]
    r = _child(run_dir, 2, CKRUN_CONFIG_HASH="cd34")
    assert r.returncode == 4, r.stderr
    assert "launch_hash: ab12 → cd34" in r.stderr and "Traceback" not in r.stderr
    r = _child(run_dir, 2, CKRUN_CONFIG_HASH="cd34", CKRUN_ALLOW_CHANGE="launch_hash, x")
    assert r.returncode == 0 and "loaded 1 3 demo" in r.stdout


def test_storage_kwarg_and_missing_storage(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> None:
    for k in (
        "CKRUN_STORAGE",
        "CKRUN_CONFIG_HASH",
        "CKRUN_ALLOW_CHANGE",
        "CKRUN_ATTEMPT",
        "CKRUN_RESUME_STEP",
        "CKRUN_CONTROL_DIR",
    ):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="CKRUN_STORAGE"):
        ckrun.Checkpointer.from_env(compat={})
    ck = ckrun.Checkpointer.from_env(compat={}, storage=str(run_dir), keep_last=2)
    assert ck.keep_last == 2 and ck.attempt == 0
    ck.save(1, {"w": torch.ones(1)})
    ck.close()
    monkeypatch.setenv("CKRUN_ATTEMPT", "x")
    with pytest.raises(ConfigError, match="CKRUN_ATTEMPT"):
        ckrun.Checkpointer.from_env(storage=str(run_dir))
    monkeypatch.setenv("CKRUN_ATTEMPT", "1")
    monkeypatch.setenv("CKRUN_RESUME_STEP", "1")
    with ckrun.Checkpointer.from_env(storage=str(run_dir)) as ck2:
        assert ck2.resume_step == 1 and ck2.load({"w": torch.zeros(1)}).step == 1  # type: ignore[union-attr]
