"""Checked input: every bad-input case of issue 16 with its exit code and message (the
real CLI in a subprocess), and suggested commands that work as pasted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PY = sys.executable


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "ckrun.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_run_name_with_a_path_component_is_refused(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    for bad in ("../x", "a/b", ".hidden", "-x", "my run", ""):
        r = cli(["submit", "--run", bad, "--storage", "runs", "--", "true"], tmp_path)
        assert r.returncode == 3, (bad, r.stderr)
        assert "invalid run name" in r.stderr and "letters, digits" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists() and list((tmp_path / "runs").iterdir()) == []
    r = cli(["status", "../x", "--storage", "runs"], tmp_path)
    assert r.returncode == 3 and "invalid run name" in r.stderr


def test_misspelled_option_before_dashdash_is_an_error_with_a_suggestion(tmp_path: Path) -> None:
    r = cli(
        ["submit", "--dry-run", "train.py", "--chaos-preempt-evry", "3s", "--", "--steps", "5"],
        tmp_path,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "No such option '--chaos-preempt-evry'" in r.stderr
    assert "Did you mean '--chaos-preempt-every'?" in r.stderr
    r = cli(["submit", "--dry-run", "--storag", "x", "--", "python", "t.py"], tmp_path)
    assert r.returncode == 2 and "Did you mean '--storage'?" in r.stderr, r.stderr
    # without `--` the script's own options still go to it; a near miss gets a note
    r = cli(["submit", "--dry-run", "train.py", "--steps", "5"], tmp_path)
    assert r.returncode == 0 and "note" not in r.stderr, r.stderr
    r = cli(["submit", "--dry-run", "train.py", "--max-requeue", "5"], tmp_path)
    assert r.returncode == 0 and "did you mean --max-requeues?" in r.stderr, r.stderr


def test_unknown_profile_and_key_suggest_the_closest(tmp_path: Path) -> None:
    r = cli(["submit", "--dry-run", "--profile", "slrum", "--", "true"], tmp_path)
    assert r.returncode == 3 and "unknown profile 'slrum' (did you mean 'slurm'?)" in r.stderr
    r = cli(["submit", "--dry-run", "--set", "max_requeus=3", "--", "true"], tmp_path)
    assert r.returncode == 3 and "(did you mean 'max_requeues'?)" in r.stderr, r.stderr
    r = cli(["config", "--profile", "k8", "--json"], tmp_path)
    assert r.returncode == 3 and "(did you mean 'k8s'?)" in r.stderr, r.stderr


def test_negative_durations_say_so(tmp_path: Path) -> None:
    for args in (["--grace", "-5"], ["--chaos-preempt-every", "-1s"], ["--set", "grace_s=-2m"]):
        r = cli(["submit", "--dry-run", *args, "--", "true"], tmp_path)
        assert r.returncode == 3, (args, r.stderr)
        assert "cannot be negative" in r.stderr, (args, r.stderr)


def _complete_run(tmp_path: Path) -> Path:
    import torch
    from ckrun import Checkpointer
    from ckrun.config import resolve
    from ckrun.supervisor.rundir import RunDir

    cfg = resolve("local", {"storage": str(tmp_path / "runs")}, {}, run="done", command=("true",))
    RunDir(cfg.state_root).freeze(cfg)
    with Checkpointer(cfg.run_root) as ck:
        ck.save(3, {"w": torch.zeros(2)})
        ck.finalize(5, {"w": torch.ones(2)})
    return tmp_path / "runs"


def test_cancel_of_a_complete_run_says_it_is_complete(tmp_path: Path) -> None:
    runs = _complete_run(tmp_path)
    r = cli(["cancel", "done", "--storage", str(runs)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "run done is complete (final step 5): nothing to cancel" in r.stdout
    assert not (runs / "done" / "cancelled.json").exists()


def test_ls_and_verify_take_a_run_name(tmp_path: Path) -> None:
    runs = _complete_run(tmp_path)
    r = cli(["ls", "done", "--storage", str(runs), "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert [c["step"] for c in body["checkpoints"]] == [5, 3] and body["complete"]
    r = cli(["verify", "done", "--storage", str(runs)], tmp_path)
    assert r.returncode == 0 and "2 checkpoint(s) verified" in r.stdout, r.stdout + r.stderr
    r = cli(["ls", "runs/done"], tmp_path)  # the run root form still works
    assert r.returncode == 0 and "complete: final step 5" in r.stdout
    r = cli(["ls", "nope", "--storage", str(runs)], tmp_path)
    assert r.returncode == 2 and "no run 'nope'" in r.stderr


def test_suggested_commands_carry_the_storage_that_found_the_run(tmp_path: Path) -> None:
    runs = _complete_run(tmp_path)
    r = cli(["status", "other", "--storage", "runs"], tmp_path)
    assert r.returncode == 2
    assert f"`ckrun runs --storage {runs}`" in r.stderr, r.stderr
    r = cli(["logs", "done", "--storage", "runs"], tmp_path)
    assert r.returncode == 2 and f"`ckrun status done --storage {runs}`" in r.stderr, r.stderr
    # pasted from another directory, the suggestion still finds the run
    (tmp_path / "elsewhere").mkdir()
    r = cli(["status", "done", "--storage", str(runs)], tmp_path / "elsewhere")
    assert r.returncode == 0 and "COMPLETE.json present" in r.stdout


def test_status_html_to_an_unwritable_path_names_it(tmp_path: Path) -> None:
    runs = _complete_run(tmp_path)
    bad = tmp_path / "no-such-dir" / "page.html"
    r = cli(["status", "done", "--storage", str(runs), "--html", str(bad)], tmp_path)
    assert r.returncode == 2 and f"--html {bad}: cannot write it" in r.stderr, r.stderr
    r = cli(["status", "done", "--storage", str(runs), "--watch", "--every", "0"], tmp_path)
    assert r.returncode == 2 and "--every" in r.stderr


def test_a_missing_script_is_refused_before_a_run_exists(tmp_path: Path) -> None:
    """`ckrun submit train_charlmm.py` (a typo) used to create the run, start the child
    twice and end in a crash loop; now it names the closest script and creates nothing."""
    (tmp_path / "train_charlm.py").write_text("print('hi')\n")
    r = cli(["submit", "train_charlmm.py", "--run", "t", "--storage", "runs"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "script 'train_charlmm.py' not found" in r.stderr, r.stderr
    assert "did you mean 'train_charlm.py'?" in r.stderr, r.stderr
    assert "started" not in r.stderr and not (tmp_path / "runs").exists(), r.stderr


def test_a_misspelled_run_name_suggests_the_closest_run(tmp_path: Path) -> None:
    assert (
        cli(["submit", "--run", "charlm", "--storage", "runs", "--", "true"], tmp_path).returncode
        == 0
    )
    for cmd in ("status", "logs", "preempt", "cancel"):
        r = cli([cmd, "charml", "--storage", "runs"], tmp_path)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "no run 'charml'" in r.stderr and "(did you mean 'charlm'?)" in r.stderr, (
            cmd,
            r.stderr,
        )
