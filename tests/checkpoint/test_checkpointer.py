"""Checkpointer save/load/finalize/latest and every bad-input case of issue 2."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch
from ckpt_helpers import COMPAT, make_state, params_equal, remount_ro
from ckrun.checkpoint import discovery, layout
from ckrun.errors import (
    ConfigError,
    IncompatibleCheckpoint,
    NoUsableCheckpoint,
    RunComplete,
    RunLocked,
    StorageFull,
    StoragePermissionError,
)


def _ck(run_dir: Path, **kw: object) -> ckrun.Checkpointer:
    kw.setdefault("compat", COMPAT)
    return ckrun.Checkpointer(storage=str(run_dir), **kw)  # type: ignore[arg-type]


def _flip(path: str, offset: int = 5000) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _shard_path(run_dir: Path, m: ckrun.Manifest) -> str:
    return str(run_dir / m.shards[0].key)


def test_save_load_roundtrip_and_manifest_fields(run_dir: Path) -> None:
    s1 = make_state(1)
    with _ck(run_dir) as ck:
        m = ck.save(
            5, s1, metrics={"loss": 0.5, "nan": float("nan"), "t": torch.tensor(2.0), "n": 3}
        )
    assert (m.step, m.kind, m.attempt, m.world_size, m.resumed_from) == (5, "recovery", 0, 1, None)
    assert m.save_duration_s > 0 and m.total_size_bytes == m.shards[0].size_bytes > 0
    assert m.compat["optimizer"] == "AdamW" and m.compat["scheduler"] == "StepLR"
    assert m.metrics == {"loss": 0.5, "nan": "nan", "t": 2.0, "n": 3}
    assert m.committed_utc.endswith("Z")
    assert (run_dir / "checkpoints/step-0000000005/manifest.json").exists()
    s2 = make_state(2)
    assert not params_equal(s1, s2)
    with _ck(run_dir) as ck2:
        got = ck2.load(s2)
        assert got is not None and got.step == 5 and ck2.resumed_from == 5
        m2 = ck2.save(6, s2)
    assert params_equal(s1, s2) and m2.resumed_from == 5
    assert (
        s2["optimizer"]
        .state_dict()["state"][0]["exp_avg"]
        .equal(s1["optimizer"].state_dict()["state"][0]["exp_avg"])
    )
    assert s2["scheduler"].last_epoch == s1["scheduler"].last_epoch


def test_empty_run_dir(run_dir: Path) -> None:
    with _ck(run_dir) as ck:
        assert ck.load(make_state()) is None and ck.latest() is None
    assert discovery.preflight(ckrun.open_storage(str(run_dir)), {}).resume is None


def test_bit_flip_falls_back_to_older(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    s = make_state(1)
    with _ck(run_dir) as ck:
        ck.save(1, s)
        old = [p.detach().clone() for p in s["model"].parameters()]
        with torch.no_grad():
            for p in s["model"].parameters():
                p.add_(1)
        m2 = ck.save(2, s)
    _flip(_shard_path(run_dir, m2))
    s2 = make_state(3)
    with _ck(run_dir) as ck2, caplog.at_level(logging.ERROR):
        got = ck2.load(s2)
        assert got is not None and got.step == 1
        assert any("step 2" in x and "checksum mismatch" in x for x in ck2.skipped)
        assert m2.shards[0].key in caplog.text
        assert ck2.latest() is not None and ck2.latest().step == 1  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(old, s2["model"].parameters(), strict=True))


def test_truncated_shard_falls_back(run_dir: Path) -> None:
    s = make_state(1)
    with _ck(run_dir) as ck:
        ck.save(1, s)
        m2 = ck.save(2, s)
    p = _shard_path(run_dir, m2)
    os.truncate(p, os.path.getsize(p) // 2)
    with _ck(run_dir) as ck2:
        got = ck2.load(make_state())
        assert got is not None and got.step == 1 and "truncated" in ck2.skipped[0]
    pf = discovery.preflight(ckrun.open_storage(str(run_dir)), {})
    assert pf.resume is not None and pf.resume.step == 1
    assert any("step 2" in x and "size" in x for x in pf.skipped)


def _edit_manifest(run_dir: Path, step: int, edit: object) -> None:
    p = run_dir / layout.manifest_key(step)
    body = json.loads(p.read_text())
    edit(body)  # type: ignore[operator]
    p.write_text(json.dumps(body))


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b.update(format_version=999),
        lambda b: b["shards"][0].update(key="../../outside.ckpt"),
        lambda b: b["shards"][0].update(key="/etc/passwd"),
    ],
)
def test_bad_manifest_skipped(run_dir: Path, edit: object) -> None:
    s = make_state(1)
    with _ck(run_dir) as ck:
        ck.save(1, s)
        ck.save(2, s)
    _edit_manifest(run_dir, 2, edit)
    st = ckrun.open_storage(str(run_dir))
    sc = discovery.scan(st)
    assert [m.step for m in sc.manifests] == [1] and sc.problems[0][0].endswith("manifest.json")
    with _ck(run_dir) as ck2:
        assert ck2.load(make_state()).step == 1  # type: ignore[union-attr]
    assert discovery.preflight(st, {}).skipped


def test_unparsable_manifest_skipped(run_dir: Path) -> None:
    with _ck(run_dir) as ck:
        ck.save(1, make_state())
        ck.save(2, make_state())
    (run_dir / layout.manifest_key(2)).write_bytes(b"{garbage")
    with _ck(run_dir) as ck2:
        assert ck2.load(make_state()).step == 1  # type: ignore[union-attr]


def test_enospc_keeps_previous_checkpoint(small_fs: Path) -> None:
    run = small_fs / "run"
    small = {"w": torch.ones(1000)}
    with ckrun.Checkpointer(storage=str(run)) as ck:
        ck.save(1, small)
        with pytest.raises(StorageFull) as ei:
            ck.save(2, {"w": torch.ones(1 << 20)})  # 4 MiB on a 512 KiB filesystem
    assert "shard" in ei.value.path and ei.value.needed_bytes
    assert "no space left" in str(ei.value)
    files = [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()]
    assert not any("step-0000000002" in f for f in files), files
    got = {"w": torch.zeros(1000)}
    with ckrun.Checkpointer(storage=str(run)) as ck2:
        assert ck2.load(got).step == 1  # type: ignore[union-attr]
    assert torch.equal(got["w"], torch.ones(1000))


def test_read_only_storage(small_fs: Path) -> None:
    run = small_fs / "run"
    with ckrun.Checkpointer(storage=str(run), lock=False) as ck:
        ck.save(1, {"w": torch.ones(10)})
    remount_ro(small_fs)
    got = {"w": torch.zeros(10)}
    ck2 = ckrun.Checkpointer(storage=str(run), lock=False)
    assert ck2.load(got).step == 1  # type: ignore[union-attr]
    with pytest.raises(StoragePermissionError, match="read-only"):
        ck2.save(2, got)
    assert discovery.committed(ckrun.open_storage(str(run)))[0].step == 1


def test_compat_gate_refuses_with_diff(run_dir: Path) -> None:
    with _ck(run_dir) as ck:
        ck.save(1, make_state())
    other = dict(COMPAT, config={"lr": 3e-4, "batch": 8}, precision="bf16")
    s = make_state(5)
    before = [p.clone() for p in s["model"].parameters()]
    with _ck(run_dir, compat=other) as ck2, pytest.raises(IncompatibleCheckpoint) as ei:
        ck2.load(s)
    assert ei.value.diff == ["config.lr: 0.001 → 0.0003", "precision: fp32 → bf16"]
    assert ei.value.exit_code == 4 and "allow_change" in str(ei.value)
    assert all(torch.equal(a, b) for a, b in zip(before, s["model"].parameters(), strict=True))


def test_allow_change_records_drift(run_dir: Path) -> None:
    with _ck(run_dir) as ck:
        ck.save(1, make_state())
    other = dict(COMPAT, config={"lr": 3e-4, "batch": 8})
    with _ck(run_dir, compat=other, allow_change=("config.lr",)) as ck2:
        assert ck2.load(make_state()).step == 1  # type: ignore[union-attr]
        m = ck2.save(2, make_state())
    assert m.compat_drift == ("config.lr: 0.001 → 0.0003",)
    assert m.compat["config"]["lr"] == 3e-4


def test_optimizer_type_is_strict_and_versions_warn(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _ck(run_dir) as ck:
        ck.save(1, make_state())
    man = run_dir / layout.manifest_key(1)
    body = json.loads(man.read_text())
    body["compat"]["torch_version"] = "1.0.0"
    body["compat"]["code_commit"] = "deadbeef"
    man.write_text(json.dumps(body))
    with _ck(run_dir) as ck2, caplog.at_level(logging.WARNING):
        assert ck2.load(make_state()).step == 1  # type: ignore[union-attr]
    assert "torch_version: 1.0.0" in caplog.text
    s = make_state()
    s["optimizer"] = torch.optim.SGD(s["model"].parameters(), lr=0.1)
    with _ck(run_dir) as ck3, pytest.raises(IncompatibleCheckpoint, match="AdamW → SGD"):
        ck3.load(s)


def test_finalize_marker_and_refusal(run_dir: Path) -> None:
    s = make_state()
    with _ck(run_dir) as ck:
        ck.save(1, s)
        fin = ck.finalize(2, s)
        assert fin.kind == "final" and fin.key == layout.manifest_key(2, "final")
        with pytest.raises(RunComplete):
            ck.save(3, s)
    st = ckrun.open_storage(str(run_dir))
    marker, problem = discovery.completion(st)
    assert marker is not None and problem is None and marker.final_step == 2
    with _ck(run_dir) as ck2:
        with pytest.raises(RunComplete):
            ck2.save(3, s)
        with pytest.raises(RunComplete):
            ck2.finalize(3, s)
        assert ck2.latest().kind == "final"  # type: ignore[union-attr]
    assert discovery.preflight(st, {}).complete is not None
    os.truncate(run_dir / fin.shards[0].key, 10)
    marker, problem = discovery.completion(st)
    assert marker is None and problem is not None and "final artifact" in problem
    (run_dir / "COMPLETE.json").write_text("{}")
    marker, problem = discovery.completion(st)
    assert marker is None and problem


def test_milestones_and_foreign_files_survive_retention(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    foreign = [
        "run.json",
        "events.jsonl",
        "checkpoints/NOTES.txt",
        "checkpoints/step-0000000001/user-file.pt",
    ]
    for f in foreign:
        (run_dir / f).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / f).write_text("mine")
    s = make_state()
    with _ck(run_dir, keep_last=2, milestone_every=4) as ck:
        for step in range(1, 11):
            ck.save(step, s)
    steps = [m.step for m in discovery.committed(ckrun.open_storage(str(run_dir)))]
    assert steps == [10, 9, 8, 4]
    for f in foreign:
        assert (run_dir / f).read_text() == "mine"


def test_orphans_of_dead_attempts_collected(run_dir: Path) -> None:
    s = make_state()
    with _ck(run_dir, keep_last=2) as ck:
        ck.save(1, s)
    orphan = run_dir / layout.shard_key(4, 0, 7)
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"leftover of a killed save")
    with _ck(run_dir, keep_last=2) as ck2:
        ck2.load(s)
        ck2.save(3, s)
        assert orphan.exists()  # newer than every commit: may belong to a live save
        ck2.save(4, s)
    assert not orphan.exists()  # unreferenced and not newer than the commit: collected
    assert (run_dir / layout.manifest_key(1)).exists()  # resumed-from is protected


def test_resumed_from_is_never_deleted(run_dir: Path) -> None:
    s = make_state()
    with _ck(run_dir, keep_last=1) as ck:
        ck.save(1, s)
    with _ck(run_dir, keep_last=1) as ck2:
        ck2.load(s)
        for step in range(2, 6):
            ck2.save(step, s)
    assert [m.step for m in discovery.committed(ckrun.open_storage(str(run_dir)))] == [5, 1]


def test_second_writer_gets_run_locked(run_dir: Path) -> None:
    code = (
        "import ckrun, torch, sys\n"
        f"ck = ckrun.Checkpointer(storage={str(run_dir)!r}, attempt=7)\n"
        "ck.save(1, {'w': torch.ones(2)}); print('holding', flush=True); sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "holding"
        with pytest.raises(RunLocked) as ei:
            _ck(run_dir).save(2, {"w": torch.ones(2)})
        assert f"pid {p.pid}" in str(ei.value) and "attempt 7" in str(ei.value)
        assert ei.value.holder["pid"] == p.pid
    finally:
        p.kill()
        p.wait(10)
    with _ck(run_dir) as ck:  # the OS released the dead holder's lock
        assert ck.save(2, {"w": torch.ones(2)}).step == 2


def test_same_step_saved_twice_is_not_rewritten(run_dir: Path) -> None:
    s = make_state()
    with _ck(run_dir) as ck:
        a = ck.save(3, s)
        b = ck.save(3, s)
    assert a is b


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_bad_step(run_dir: Path, step: object) -> None:
    with _ck(run_dir) as ck, pytest.raises(ckrun.CheckpointError, match="step"):
        ck.save(step, make_state())  # type: ignore[arg-type]


def test_bad_retention_settings(run_dir: Path) -> None:
    with pytest.raises(ConfigError):
        _ck(run_dir, keep_last=0)
    with pytest.raises(ConfigError):
        _ck(run_dir, milestone_every=0)


def test_load_into_a_different_model_names_the_key(run_dir: Path) -> None:
    with _ck(run_dir) as ck:
        ck.save(1, make_state(width=16))
    with _ck(run_dir) as ck2, pytest.raises(ckrun.CheckpointError, match="'model'"):
        ck2.load(make_state(width=32))


def test_save_handle_and_snapshot_persist_split(run_dir: Path) -> None:
    s = make_state()
    with _ck(run_dir) as ck:
        h = ckrun.SaveHandle.completed(ck.save(1, s))
        assert h.done() and h.result().step == 1
        snap = ck.snapshot(s, copy=True)  # step 1 of a save, independent of training
        with torch.no_grad():
            for p in s["model"].parameters():
                p.add_(1)
        import time as _t

        m = ck.persist(
            2,
            snap,
            kind="recovery",
            compat=ck.compat_block(s),
            metrics=None,
            created_utc="2026-01-01T00:00:00.000000Z",
            started=_t.monotonic(),
        )
    s2 = make_state(9)
    with _ck(run_dir) as ck2:
        assert ck2.load(s2).step == m.step == 2  # type: ignore[union-attr]
    assert not params_equal(s, s2)  # the snapshot predates the in-place update


def test_retention_runs_after_the_commit_off_the_save_return(run_dir: Path) -> None:
    """Issue 19: a synchronous save returns once its checkpoint is committed; retention's
    deletes run in the background after it and are joined before the next save."""
    import threading

    from ckrun.storage.local import LocalStorage

    entered, release = threading.Event(), threading.Event()
    deleted: list[list[str]] = []

    class SlowDelete(LocalStorage):
        def delete(self, keys: Any) -> None:
            keys = list(keys)
            entered.set()
            release.wait()
            super().delete(keys)
            deleted.append(keys)

    s = make_state()
    ck = ckrun.Checkpointer(SlowDelete(str(run_dir)), keep_last=1, rng=False, lock=False)
    ck.save(1, s)
    done = threading.Event()

    def second() -> None:
        ck.save(2, s)  # retention of step 1 blocks in delete: the save returns anyway
        done.set()

    threading.Thread(target=second, daemon=True).start()
    assert entered.wait(20) and done.wait(20), "save 2 waited for its retention pass"
    assert (run_dir / layout.manifest_key(2)).exists()  # committed before retention
    assert (run_dir / layout.manifest_key(1)).exists() and not deleted  # not deleted yet
    third = threading.Thread(target=ck.save, args=(3, s), daemon=True)
    third.start()
    third.join(0.5)
    assert third.is_alive() and not (run_dir / layout.shard_key(3, 0, 0)).parent.exists()
    release.set()  # the next save started only after the previous pass finished
    third.join(20)
    ck.close()
    assert deleted and not (run_dir / layout.manifest_key(1)).exists()
    assert [m.step for m in discovery.committed(ckrun.open_storage(str(run_dir)))] == [3]


def test_no_usable_checkpoint_refuses_instead_of_starting_from_scratch(run_dir: Path) -> None:
    """Committed checkpoints exist but none can be read (here: the only shard missing,
    so nothing was read in place): starting from step 0 would silently throw the run's
    work away.  load() refuses, names every checkpoint and the fix, and the damaged
    checkpoint is left where it is for inspection."""
    s = make_state(1)
    with _ck(run_dir) as ck:
        m1 = ck.save(1, s)
    os.unlink(_shard_path(run_dir, m1))
    with _ck(run_dir) as ck2, pytest.raises(NoUsableCheckpoint) as e:
        ck2.load(make_state(2))
    msg = str(e.value)
    assert "step 1" in msg and "ckrun verify" in msg and "start from scratch" in msg
    assert e.value.exit_code == 5
    assert layout.manifest_key(m1.step) in {
        i.key for i in ckrun.open_storage(str(run_dir)).list("")
    }
    with _ck(run_dir / "empty") as ck3:  # a run with no checkpoint still starts fresh
        assert ck3.load(make_state(3)) is None


def test_an_unparsable_only_manifest_refuses_too(run_dir: Path) -> None:
    s = make_state(1)
    with _ck(run_dir) as ck:
        m1 = ck.save(1, s)
    mpath = run_dir / layout.manifest_key(m1.step)
    mpath.write_text("{ not json")
    with _ck(run_dir) as ck2, pytest.raises(NoUsableCheckpoint) as e:
        ck2.load(make_state(2))
    assert layout.manifest_key(m1.step) in str(e.value)


def test_a_script_finding_no_usable_checkpoint_exits_5_with_a_stop_record(
    run_dir: Path, tmp_path: Path
) -> None:
    """The uncaught NoUsableCheckpoint leaves the exit-reason record that makes the
    supervisor stop instead of restarting into the same refusal (a restart cannot help)."""
    from ckrun import control

    with _ck(run_dir) as ck:
        m1 = ck.save(1, make_state(1))
    os.unlink(_shard_path(run_dir, m1))
    cdir = tmp_path / "control"
    cdir.mkdir()
    control.reserve_exit_reason(str(cdir))
    code = (  # from_env installs the library's excepthook, as a supervised script gets
        "import ckrun, sys; sys.path.insert(0, sys.argv[2]); "
        "from ckpt_helpers import COMPAT, make_state; "
        "ckrun.Checkpointer.from_env(storage=sys.argv[1], compat=COMPAT).load(make_state(2))"
    )
    helpers = str(Path(__file__).parent)
    env = dict(os.environ, CKRUN_CONTROL_DIR=str(cdir))
    r = subprocess.run(
        [sys.executable, "-c", code, str(run_dir), helpers],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 5, r.stderr
    rec = control.read_exit_reason(str(cdir))
    assert rec is not None and rec["reason"] == "checkpoints_unusable", rec
    assert "ckrun verify" in r.stderr
