"""The supervisor's preflight: marker, resume source, diff, skipped — without torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ckrun
import torch
from ckpt_helpers import COMPAT
from ckrun.checkpoint import discovery, layout


def _save(run_dir: Path, steps: list[int], **compat: object) -> None:
    with ckrun.Checkpointer(storage=str(run_dir), compat=dict(COMPAT, **compat)) as ck:
        for s in steps:
            ck.save(s, {"w": torch.ones(4)})


def test_preflight_diff_and_allow_change(run_dir: Path) -> None:
    _save(run_dir, [1, 2], launch_hash="ab12")
    st = ckrun.open_storage(str(run_dir))
    pf = discovery.preflight(st, {"launch_hash": "ab12"})
    assert pf.resume is not None and pf.resume.step == 2 and pf.diff == [] and not pf.complete
    pf = discovery.preflight(st, {"launch_hash": "cd34", "config": {"lr": 1e-3}})
    assert pf.diff == ["launch_hash: ab12 → cd34"]
    assert discovery.preflight(st, {"launch_hash": "cd34"}, ["launch_hash"]).diff == []
    pf = discovery.preflight(st, {"torch_version": "0.1"})
    assert pf.diff == [] and pf.warnings and "torch_version" in pf.warnings[0]


def test_preflight_skips_newer_broken(run_dir: Path) -> None:
    _save(run_dir, [1, 2, 3])
    st = ckrun.open_storage(str(run_dir))
    m3 = discovery.committed(st)[0]
    os.unlink(run_dir / m3.shards[0].key)
    (run_dir / layout.manifest_key(2)).write_text("{}")
    pf = discovery.preflight(st, {})
    assert pf.resume is not None and pf.resume.step == 1
    assert len(pf.skipped) == 2 and "missing" in pf.skipped[0]


def test_invalid_marker_is_a_warning(run_dir: Path) -> None:
    _save(run_dir, [1])
    (run_dir / layout.COMPLETE).write_text(json.dumps({"format": "ckrun.complete"}))
    pf = discovery.preflight(ckrun.open_storage(str(run_dir)), {})
    assert pf.complete is None and "completion marker ignored" in pf.warnings[0]


def test_discovery_does_not_import_torch(run_dir: Path) -> None:
    _save(run_dir, [1])
    code = (
        "import sys\n"
        "from ckrun.storage import open_storage\n"
        "from ckrun.checkpoint import discovery\n"
        f"pf = discovery.preflight(open_storage({str(run_dir)!r}), {{'launch_hash': 'x'}})\n"
        "print(pf.resume.step, pf.diff, discovery.completion(open_storage("
        f"{str(run_dir)!r})))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("1 ['launch_hash: <absent> → x']")


def test_a_manifest_deleted_between_list_and_read_is_not_a_problem(run_dir: Path) -> None:
    """Retention deletes an old step while a scan runs: a manifest listed and then gone
    was deleted, not damaged; it must not count as an unreadable checkpoint (which, with
    nothing else usable, would refuse the resume)."""
    _save(run_dir, [1, 2])
    st = ckrun.open_storage(str(run_dir))
    gone = layout.manifest_key(1)

    class RetentionBeside:
        def __getattr__(self, name: str) -> object:
            return getattr(st, name)

        def get(self, key: str) -> bytes:
            if key == gone:  # retention removed the step after the listing
                st.delete([k.key for k in st.list(layout.step_prefix(1))])
            return st.get(key)

    sc = discovery.scan(RetentionBeside())  # type: ignore[arg-type]
    assert [m.step for m in sc.manifests] == [2] and sc.problems == []
