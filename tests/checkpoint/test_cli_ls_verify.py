"""``ckrun ls`` and ``ckrun verify`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import ckrun
import torch
from ckrun.checkpoint import layout
from ckrun.cli.checkpoints import ls, verify
from click.testing import CliRunner


def _run(run_dir: Path) -> list[ckrun.Manifest]:
    with ckrun.Checkpointer(storage=str(run_dir), keep_last=5) as ck:
        out = [ck.save(s, {"w": torch.arange(2000.0) * s}) for s in (1, 2, 3)]
    return out


def test_ls_table_and_json(run_dir: Path) -> None:
    _run(run_dir)
    r = CliRunner().invoke(ls, [str(run_dir)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["STEP", "KIND", "SIZE"]
    assert [ln.split()[0] for ln in lines[1:]] == ["3", "2", "1"]
    assert all(ln.rstrip().endswith("committed") for ln in lines[1:])  # issue 13: not "ok"
    r = CliRunner().invoke(ls, [str(run_dir), "--json"])
    body = json.loads(r.output)
    assert [c["step"] for c in body["checkpoints"]] == [3, 2, 1] and not body["complete"]
    assert body["checkpoints"][0]["size_bytes"] > 8000


def test_ls_empty_and_missing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(ls, [str(tmp_path / "empty")])
    assert r.exit_code == 0 and "no checkpoints" in r.output
    r = CliRunner().invoke(ls, [str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such run directory" in r.output
    assert not (tmp_path / "nope").exists()


def test_verify_good_then_corrupt(run_dir: Path) -> None:
    ms = _run(run_dir)
    r = CliRunner().invoke(verify, [str(run_dir)])
    assert r.exit_code == 0 and "3 checkpoint(s) verified" in r.output
    path = run_dir / ms[1].shards[0].key
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    r = CliRunner().invoke(verify, [str(run_dir)])
    assert r.exit_code == 5
    assert "step 2" in r.output and "CORRUPT" in r.output and ms[1].shards[0].key in r.output
    assert CliRunner().invoke(verify, [str(run_dir), "--step", "3"]).exit_code == 0
    assert CliRunner().invoke(verify, [str(run_dir), "--step", "2"]).exit_code == 5
    r = CliRunner().invoke(verify, [str(run_dir), "--step", "9"])
    assert r.exit_code == 2 and "no committed checkpoint at step 9" in r.output


def test_ls_and_verify_report_damage(run_dir: Path) -> None:
    ms = _run(run_dir)
    (run_dir / ms[2].shards[0].key).write_bytes(b"short")
    (run_dir / layout.manifest_key(1)).write_text("{")
    r = CliRunner().invoke(ls, [str(run_dir)])
    assert "damaged" in r.output and "invalid" in r.output
    r = CliRunner().invoke(verify, [str(run_dir)])
    assert r.exit_code == 5 and "size 5 bytes" in r.output and "INVALID" in r.output


def test_ls_and_verify_do_not_import_torch(run_dir: Path) -> None:
    import subprocess
    import sys

    _run(run_dir)
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from ckrun.cli.checkpoints import ls, verify\n"
        f"assert CliRunner().invoke(ls, [{str(run_dir)!r}]).exit_code == 0\n"
        f"assert CliRunner().invoke(verify, [{str(run_dir)!r}]).exit_code == 0\n"
        "assert 'torch' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
