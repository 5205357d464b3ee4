"""Issue 13 item 7: explicit arguments vs CKRUN_* variables; two Checkpointers, one run."""

from __future__ import annotations

from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.errors import ConfigError, RunLocked


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("CKRUN_STORAGE", "CKRUN_RUN", "CKRUN_ATTEMPT", "CKRUN_RESUME_STEP"):
        monkeypatch.delenv(k, raising=False)


def test_conflicting_storage_argument_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKRUN_STORAGE", str(tmp_path / "sup"))
    with pytest.raises(ConfigError, match="conflicts with CKRUN_STORAGE") as ei:
        ckrun.Checkpointer.from_env(storage=str(tmp_path / "mine"))
    assert "default_storage=" in str(ei.value)
    # the same root spelled differently is no conflict; default_storage is a fallback
    with ckrun.Checkpointer.from_env(storage=str(tmp_path / "sup") + "/") as ck:
        assert ck.storage.url.rstrip("/").endswith("sup")
    with ckrun.Checkpointer.from_env(default_storage=str(tmp_path / "mine")) as ck:
        assert ck.storage.url.endswith("sup")
    monkeypatch.delenv("CKRUN_STORAGE")
    with ckrun.Checkpointer.from_env(default_storage=str(tmp_path / "mine")) as ck:
        assert ck.storage.url.endswith("mine")


@pytest.mark.parametrize(
    "kw,var,value",
    [({"run": "a"}, "CKRUN_RUN", "b"), ({"attempt": 1}, "CKRUN_ATTEMPT", "2")],
)
def test_conflicting_run_or_attempt_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kw: dict[str, object], var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"conflicts with {var}='{value}'"):
        ckrun.Checkpointer(str(tmp_path), **kw)  # type: ignore[arg-type]
    monkeypatch.setenv(var, str(next(iter(kw.values()))))
    ckrun.Checkpointer(str(tmp_path), **kw).close()  # type: ignore[arg-type]


def test_resume_step_conflict_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKRUN_RESUME_STEP", "5")
    with pytest.raises(ConfigError, match="CKRUN_RESUME_STEP"):
        ckrun.Checkpointer.from_env(storage=str(tmp_path), resume_step=3)


def test_second_checkpointer_in_process_names_the_first(tmp_path: Path) -> None:
    first = ckrun.Checkpointer(str(tmp_path), rng=False)
    first.save(1, {"w": torch.ones(1)})
    second = ckrun.Checkpointer(str(tmp_path), rng=False)
    with pytest.raises(RunLocked) as ei:
        second.save(2, {"w": torch.ones(1)})
    msg = str(ei.value)
    assert "in this process" in msg and "test_explicit.py:" in msg and "another process" not in msg
    first.close()
    second.save(2, {"w": torch.ones(1)})  # the first is closed: the run is free
    second.close()
