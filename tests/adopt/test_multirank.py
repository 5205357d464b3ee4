"""Hugging Face Trainer and Lightning with two ranks under ckrun (issue 15, left over).

``ckrun submit --nproc-per-node 2`` runs each example under torchrun: the Trainer with
DDP over gloo (``ddp_backend="gloo"``), Lightning with ``strategy="ddp"`` on CPU.  The
supervisor's chaos drill delivers real notices (``notice.json`` polled by every rank,
then SIGTERM to the worker processes); the ranks agree on the step to stop at
(``preemption_requested(sync=True)``), every rank's state is in the commit, and the
resumed run ends **bitwise** equal to an uninterrupted two-rank run: model, optimizer,
scheduler and every rank's RNG (gloo's all-reduce of two ranks is deterministic on CPU).
Real training processes (about a minute each): marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ckrun.cli.resume_check import compare_trees, flatten, load_final

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HF = str(EXAMPLES / "train_hf.py")
PL = str(EXAMPLES / "train_lightning.py")


def _submit(tmp_path: Path, run: str, script: str, *args: str, chaos: str | None = None) -> None:
    extra = ["--chaos-preempt-every", chaos] if chaos else []
    r = subprocess.run(
        [sys.executable, "-m", "ckrun", "submit", script, "--run", run, "--storage",
         str(tmp_path), "--nproc-per-node", "2", *extra, "--", *args],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _preemptions(root: Path) -> int:
    with open(root / "events.jsonl") as f:
        return sum(1 for ln in f if ln.strip() and json.loads(ln)["kind"] == "preempted")


@pytest.mark.slow
@pytest.mark.parametrize("script", [HF, PL], ids=["hf", "lightning"])
def test_two_ranks_preempted_resume_to_the_uninterrupted_state(tmp_path: Path, script: str) -> None:
    pytest.importorskip("transformers" if script == HF else "lightning")
    # 0.4 s steps, 24 steps: a notice every 4 s of training preempts the run about twice
    args = ("--steps", "24", "--step-seconds", "0.4")
    if script == HF:
        args += ("--save-steps", "1000")  # only ckrun's notice saves
    _submit(tmp_path, "ref", script, *args)
    _submit(tmp_path, "chaos", script, *args, chaos="4s")
    assert _preemptions(tmp_path / "chaos") >= 1
    assert (tmp_path / "chaos" / "COMPLETE.json").exists()
    step, ref = load_final(str(tmp_path / "ref"))
    got_step, got = load_final(str(tmp_path / "chaos"))
    assert step == got_step == 24
    # both ranks' RNG states are part of what is compared
    names = [p for p, _ in flatten(got)]
    marker = "rng_state_1" if script == HF else "lightning_ranks"
    assert any(marker in p for p in names), names[:40]
    _, div, _ = compare_trees(ref, got)
    assert div is None, f"{div.path}: {div.detail}"


_RESTORE = """
import os, sys
from ckrun.checkpoint import fileset
from ckrun.integrations.common import restore_shared
from ckrun.storage import open_storage
print("ready", flush=True)
sys.stdin.readline()  # the parent releases both ranks at once
fs = fileset.newest(open_storage(sys.argv[2]), prefix="checkpoint-")
path = restore_shared(fs, sys.argv[1], "checkpoint-5")  # what hf.resume_checkpoint does
print(path, sorted(n for n in os.listdir(path) if not n.startswith(".ckrun-")), flush=True)
"""


@pytest.mark.slow  # four processes importing torch (the shard codec): > 10 s under load
def test_the_ranks_of_a_launch_restore_one_directory_once(tmp_path: Path) -> None:
    """Two ranks of one torchrun launch (same parent, WORLD_SIZE=2) restore the same
    ``checkpoint-N`` into a shared output_dir at the same moment: both get the complete
    directory, neither fails on the other's rename, and a half-written directory left
    by the previous launch is replaced."""
    import os

    from ckrun.checkpoint import fileset
    from ckrun.storage import open_storage

    src = tmp_path / "src" / "checkpoint-5"
    src.mkdir(parents=True)
    for i in range(6):
        (src / f"part{i}.bin").write_bytes(bytes([i]) * (1 << 20))
    files = {f"checkpoint-5/{p.name}": str(p) for p in src.iterdir()}
    st = open_storage(str(tmp_path / "run"))
    fileset.commit_files(st, 5, files, run="r", attempt=0)
    out = tmp_path / "out"
    want = sorted(p.name for p in src.iterdir())
    for launch in (1, 2):
        if launch > 1:  # the previous launch was killed while the Trainer rewrote it
            (out / "checkpoint-5" / "part0.bin").write_bytes(b"half")
        env = {**os.environ, "WORLD_SIZE": "2", "CKRUN_ATTEMPT": str(launch)}
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", _RESTORE, str(out), str(tmp_path / "run")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )  # fmt: skip
            for _ in range(2)
        ]
        for r in ranks:
            assert r.stdout is not None and r.stdout.readline().strip() == "ready"
        for r in ranks:
            assert r.stdin is not None
            r.stdin.write("go\n")
            r.stdin.flush()
        for r in ranks:
            stdout, stderr = r.communicate(timeout=120)
            assert r.returncode == 0, stderr[-3000:]
            assert stdout.strip() == f"{out / 'checkpoint-5'} {want}"
        for i in range(6):
            assert (out / "checkpoint-5" / f"part{i}.bin").read_bytes() == bytes([i]) * (1 << 20)
