"""A machine that never ran the run shows its history from the run's storage (issue 12).

Machine A runs the run (a first attempt that fails, a second that completes); machine B
has its own HOME and an empty ``XDG_STATE_HOME`` (no local state of the run) and shares
only the run's storage: S3 (moto's server on 127.0.0.1) or a shared directory (each
machine with its own ``CKRUN_STATE_DIR``).  On B, ``ckrun status`` (text, ``--json``,
``--html``), ``ckrun logs`` and ``ckrun runs`` show both attempts from
``supervisor/state.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_server import MotoS3

pytestmark = pytest.mark.slow  # ~15 s each: six ckrun processes
PY = sys.executable
#: Attempt 0 fails (exit 1), attempt 1 completes: the marker file tells them apart.
SCRIPT = (
    "import os, sys\n"
    "m = sys.argv[1]\n"
    "if not os.path.exists(m):\n"
    "    open(m, 'w').close(); print('first attempt fails', flush=True); sys.exit(1)\n"
    "print('second attempt completes', flush=True)\n"
)


@pytest.fixture(params=["s3", "shared-dir"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "s3":
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        yield f"s3://{moto.new_bucket()}/runs"
    else:
        yield str(tmp_path / "shared")


def machine_env(root: Path, shared_dir: bool) -> dict[str, str]:
    """A machine of its own: HOME, XDG_STATE_HOME, TMPDIR, machine id; no CKRUN_/XDG_ of
    the test's environment."""
    for d in ("home", "state", "tmp"):
        (root / d).mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKRUN_", "XDG_"))}
    env.update(
        HOME=str(root / "home"),
        XDG_STATE_HOME=str(root / "state"),
        TMPDIR=str(root / "tmp"),
        CKRUN_MACHINE_ID=root.name,
        CKRUN_BACKOFF_S="0.1",
    )
    if shared_dir:
        env["CKRUN_STATE_DIR"] = str(root / "state" / "ckrun-runs")
    return env


def ckrun(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "ckrun.cli", *args], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_a_fresh_machine_shows_the_runs_history(tmp_path: Path, storage_url: str) -> None:
    shared = not storage_url.startswith("s3://")
    a_env, b_env = (machine_env(tmp_path / m, shared) for m in ("machine-a", "machine-b"))
    marker = tmp_path / "machine-a" / "tmp" / "failed-once"
    a = ckrun(["run", "--run", "r1", "--storage", storage_url, "--", PY, "-c", SCRIPT,
               str(marker)], a_env, tmp_path / "machine-a")  # fmt: skip
    assert a.returncode == 0, a.stdout + a.stderr
    assert not any((tmp_path / "machine-b").rglob("events.jsonl"))  # B has nothing local

    b = tmp_path / "machine-b"
    st = ckrun(["status", "r1", "--storage", storage_url, "--json"], b_env, b)
    assert st.returncode == 0, st.stderr
    s = json.loads(st.stdout)
    assert s["run"] == "r1" and s["state"] == "COMPLETED" and s["attempts"] == 2
    assert [x["outcome"] for x in s["attempt_detail"]] == ["failure", "completed"]
    assert s["failures"] == 1
    assert s["lease"]["holder"] is None and s["lease"]["expired_by"] == "released"

    text = ckrun(["status", "r1", "--storage", storage_url], b_env, b).stdout
    assert text.startswith("run r1: COMPLETED") and "attempts 2" in text
    page = b / "r1.html"
    ckrun(["status", "r1", "--storage", storage_url, "--html", str(page)], b_env, b)
    html = page.read_text()
    assert "attempt 0" in html and "attempt 1" in html

    logs = ckrun(["logs", "r1", "--storage", storage_url], b_env, b)
    assert logs.returncode == 0, logs.stderr
    kinds = [line.split()[3] for line in logs.stdout.splitlines()]
    assert kinds.count("spawn") == 2 and "completed" in kinds
    assert "no output on this machine" in logs.stderr

    missing = ckrun(["status", "nosuch", "--storage", storage_url], b_env, b)
    assert missing.returncode != 0 and "no run 'nosuch'" in missing.stderr
    suggested = f"ckrun runs --storage {storage_url}"  # the error's suggestion works
    assert suggested in missing.stderr

    listed = ckrun(["runs", "--storage", storage_url, "--json"], b_env, b)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["run"], r["state"], r["attempts"]) for r in rows] == [("r1", "COMPLETED", 2)]
    table = ckrun(["runs", "--storage", storage_url], b_env, b).stdout
    assert table.splitlines()[1].split()[:3] == ["r1", "COMPLETED", "2"], table
