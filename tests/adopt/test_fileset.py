"""File-set commits, own-checkpoint validation, drill planning (issue 15): fast tests."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckrun.checkpoint import fileset
from ckrun.checkpoint.discovery import committed, completion
from ckrun.cli import resume_drills as drills
from ckrun.storage import open_storage
from ckrun.supervisor.watched import WatchedFiles, validate


def _hf_dir(root: Path, step: int, payload: bytes) -> dict[str, str]:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(payload)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return {f"checkpoint-{step}/{p.name}": str(p) for p in d.iterdir()}


def test_commit_restore_and_retention(tmp_path: Path) -> None:
    st = open_storage(str(tmp_path / "run"))
    out = tmp_path / "out"
    for step in (10, 20, 30, 40):
        fileset.commit_files(
            st, step, _hf_dir(out, step, bytes([step]) * 100), run="r", attempt=0, keep_last=2
        )
    assert [m.step for m in committed(st)] == [40, 30]  # ckrun's retention
    fs = fileset.newest(st, prefix="checkpoint-")
    assert fs is not None and fs.manifest.step == 40
    # a half-written checkpoint-40 (a kill while the Trainer saved) is replaced whole
    (out / "checkpoint-40" / "model.safetensors").write_bytes(b"half")
    (out / "checkpoint-40" / "junk.tmp").write_bytes(b"x")
    path = fileset.restore_dir(fs, str(out), "checkpoint-40")
    assert sorted(os.listdir(path)) == ["model.safetensors", "trainer_state.json"]
    assert (out / "checkpoint-40" / "model.safetensors").read_bytes() == bytes([40]) * 100


def test_a_damaged_commit_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    st = open_storage(str(tmp_path / "run"))
    out = tmp_path / "out"
    fileset.commit_files(st, 1, _hf_dir(out, 1, b"a" * 5000), run="r", attempt=0)
    m2 = fileset.commit_files(st, 2, _hf_dir(out, 2, b"b" * 5000), run="r", attempt=0)
    shard = tmp_path / "run" / m2.shards[0].key
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the newest commit
    shard.write_bytes(bytes(data))
    fs = fileset.newest(st)
    assert fs is not None and fs.manifest.step == 1


def test_final_commit_writes_the_completion_marker(tmp_path: Path) -> None:
    st = open_storage(str(tmp_path / "run"))
    fileset.commit_files(st, 5, _hf_dir(tmp_path / "o", 5, b"z"), run="r", attempt=0, kind="final")
    marker, problem = completion(st)
    assert marker is not None and problem is None and marker.final_step == 5


def test_a_file_that_changes_while_copied_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "ckpt.pt"
    p.write_bytes(b"x" * 1000)
    real = fileset._stat_sig
    calls = []

    def growing(path: str) -> tuple[int, int, int]:
        calls.append(path)
        if len(calls) == 2:
            with open(path, "ab") as f:
                f.write(b"more")
        return real(path)

    monkeypatch.setattr(fileset, "_stat_sig", growing)
    with pytest.raises(fileset.FileSetChanged):
        fileset.read_stable(str(p))


def test_validate_refuses_a_torch_save_cut_short(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(5000.0), "iter_num": 3}, buf)
    good, cut = tmp_path / "good.pt", tmp_path / "cut.pt"
    good.write_bytes(buf.getvalue())
    cut.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    assert validate(str(good), require_known=True) is None
    assert "incomplete zip" in str(validate(str(cut), require_known=False))
    other = tmp_path / "ckpt.bin"
    other.write_bytes(b"opaque")
    assert validate(str(other), require_known=False) is None
    assert "cannot be checked" in str(validate(str(other), require_known=True))


def test_watched_files_commit_after_a_kill_only_when_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    st = open_storage(str(tmp_path / "run"))
    w = WatchedFiles(("out/ckpt.pt",), st, "r")
    assert w.restore(0) is None
    os.makedirs("out")
    buf = io.BytesIO()
    torch.save({"iter_num": 1}, buf)
    with open("out/ckpt.pt", "wb") as f:
        f.write(buf.getvalue())
    assert w.poll([]) == 0  # a valid zip is committed at once
    with open("out/ckpt.pt", "wb") as f:  # a kill mid-write leaves half a file
        f.write(buf.getvalue()[:100])
    assert w.after_exit(128 + 9, None) is None
    assert [m.step for m in committed(st)] == [0]
    assert w.restore(1) == 0  # the good version comes back into place
    assert torch.load("out/ckpt.pt", weights_only=True)["iter_num"] == 1


def test_drill_planning() -> None:
    assert drills.drill_steps(20, 3, 5) == sorted(
        __import__("random").Random(5).sample(range(20), 3)
    )
    edges = drills.drill_steps(20, 0, 5, edges=True, first_save=9)
    assert edges == [0, 10, 20]  # first step, the step after the save at 9, the last step
    assert drills.drill_steps(30, 0, 5, edges=True, file_set=True, first_save=10) == [0, 10, 29]
    assert drills.per_attempt([2, 5, 6]) == [2, 3, 1]
    assert drills.first_diverging_step({"1": "a", "2": "b"}, {"1": "a", "2": "c"}) == 2
    note = drills.step_note({"1": "a", "2": "b"}, {"1": "a", "2": "c"}, [0], file_set=True)
    assert note is not None and "first step after the resume at step 1" in note


def test_rng_note_names_used_generators_or_says_none_saved() -> None:
    none = drills.rng_note({"rng": None}, {"rng": None}, [])
    assert "saves no RNG state" in none
    ref = {"rng": {"used": ["torch"]}}
    note = drills.rng_note(ref, ref, ["rng.torch", "rng.numpy.1"])
    assert "rng.torch" in note and "numpy" not in note


def test_check_resume_on_a_command_without_ckrun_says_so(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ckrun", "check-resume", "-k", "1", "--workdir", str(tmp_path),
         "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "committed no checkpoint through ckrun" in r.stdout + r.stderr


def test_supervisor_and_cli_start_without_the_frameworks() -> None:
    code = (
        "import sys, ckrun, ckrun.cli.main, ckrun.supervisor.loop, ckrun.supervisor.watched\n"
        "bad = [m for m in ('transformers', 'lightning', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_step_digests_are_saved_and_continue_after_a_restore() -> None:
    from ckrun.checkpoint import state as st

    st.STEP_DIGESTS.clear()
    model = torch.nn.Linear(2, 2)
    s = {"model": model}
    st.record_step(s)
    with torch.no_grad():
        model.weight.add_(1.0)
    st.record_step(s)
    tree = st.capture(s)
    assert sorted(tree["ckrun_steps"]) == ["0", "1"]
    assert tree["ckrun_steps"]["0"] != tree["ckrun_steps"]["1"]
    st.STEP_DIGESTS.clear()
    st.restore(s, tree, where="test")  # a resumed process: numbering continues at 2
    st.record_step(s)
    assert sorted(st.STEP_DIGESTS) == ["0", "1", "2"]
    assert st.STEP_DIGESTS["2"] == tree["ckrun_steps"]["1"]
    st.STEP_DIGESTS.clear()
