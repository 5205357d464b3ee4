"""What a save fsyncs, and when (issue 19: batched directory fsyncs, same durability).

``os.fsync`` of :mod:`ckrun.storage.local_writer` and of :mod:`ckrun.storage.direct`
(the same function object) is wrapped to record the path of each fsynced descriptor;
the files and directories are real.
"""

from __future__ import annotations

import os
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import layout
from ckrun.storage import local_writer
from ckrun.storage.local import LocalStorage


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = os.fsync

    def rec(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(local_writer.os, "fsync", rec)  # type: ignore[attr-defined]
    return seen


def _name(p: str, root: Path) -> str:
    rel = os.path.relpath(p, root)
    base = os.path.basename(rel)
    if base.startswith(local_writer.TEMP_PREFIX):  # the temp file: data fsync
        kind = "shard" if base.endswith(".ckpt") else base.rsplit("-", 1)[-1]
        return os.path.join(os.path.dirname(rel), "<tmp>" + kind)
    return rel


def test_new_directories_are_synced_after_the_file(tmp_path: Path, fsynced: list[str]) -> None:
    """The parents of directories a writer creates are fsynced at its commit, after the
    file's data and its rename (one journal commit covers them on ext4), not at open."""
    st = LocalStorage(str(tmp_path), direct=False)
    w = st.open_write("a/b/obj")
    assert fsynced == []  # nothing synced at open: nothing is promised before the commit
    w.write(b"x" * 10)
    w.commit()
    assert [_name(p, tmp_path) for p in fsynced] == ["a/b/<tmp>obj", "a/b", "a", "."]
    assert st.get("a/b/obj") == b"x" * 10


def test_what_a_save_fsyncs_and_when(tmp_path: Path, fsynced: list[str]) -> None:
    """A synchronous save: shard data, shard directory (then the parents of the new step
    directory), manifest data, manifest directory — in that order, all before it
    returns; retention's deletes come later, off the save's return."""
    ck = ckrun.Checkpointer(str(tmp_path), rng=False, lock=False, keep_last=1)
    state = {"w": torch.arange(1000.0)}
    ck.save(1, state)
    shard = layout.shard_key(1, 0, 0)
    step_dir = os.path.dirname(shard)
    man = layout.manifest_key(1)
    assert os.path.dirname(man) == step_dir and shard.endswith(".ckpt")
    got = [_name(p, tmp_path) for p in fsynced]
    assert got == [
        os.path.join(step_dir, "<tmp>shard"),
        step_dir,
        os.path.dirname(step_dir),
        ".",
        os.path.join(step_dir, "<tmp>" + os.path.basename(man)),
        step_dir,
    ], got
    ck.close()
