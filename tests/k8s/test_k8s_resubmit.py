"""Submitting a Kubernetes run twice: the 409's suggested command works as pasted.

The Kubernetes API is a stub (``k8s_stub_api.StubApi``, an http.server on 127.0.0.1
speaking the batch/v1 Jobs REST API; no API server can run here); everything else is
real: ``ckrun submit`` with the shipped k8s profile (its ``state_dir`` is
``./ckrun-state``), then the ``ckrun cancel`` the error message suggests, run from
another directory, then a new submit.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_stub_api import StubApi


@pytest.fixture
def stub() -> Iterator[StubApi]:
    with StubApi() as s:
        yield s


def test_the_409_suggests_a_cancel_that_works(stub: StubApi, tmp_path: Path) -> None:
    kc = stub.write_kubeconfig(tmp_path / "kubeconfig")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKRUN_", "XDG_"))}
    env.update(HOME=str(tmp_path / "home"), XDG_STATE_HOME=str(tmp_path / "state"))
    submit_dir, other_dir = tmp_path / "project", tmp_path / "elsewhere"
    submit_dir.mkdir()
    other_dir.mkdir()

    def ckrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ckrun.cli", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    submit = ["submit", "--profile", "k8s", "--run", "demo", "--storage", "pvc:data/runs",
              "--image", "img:1", "--set", f"kubeconfig={kc}",
              "--", "python", "train.py"]  # fmt: skip
    assert ckrun(submit, submit_dir).returncode == 0
    again = ckrun(submit, submit_dir)
    assert again.returncode == 7, again.stderr  # the scheduler refused it
    assert "already exists in namespace 'default'" in again.stderr
    assert "default/demo" not in again.stderr.split("to start it again")[1].split("(or")[0]
    m = re.search(r"`(ckrun cancel [^`]*)`", again.stderr)
    assert m is not None, again.stderr
    assert m.group(1) == "ckrun cancel demo --storage pvc:data/runs"

    cancel = ckrun(shlex.split(m.group(1))[1:], other_dir)  # as pasted, from elsewhere
    assert cancel.returncode == 0, cancel.stderr
    assert "k8s job default/demo cancelled" in cancel.stdout
    assert ("DELETE", "/apis/batch/v1/namespaces/default/jobs/demo") in [
        (r["method"], r["path"]) for r in stub.requests
    ]
    assert not any(other_dir.iterdir())  # no local directory named after the claim
    assert ckrun(submit, submit_dir).returncode == 0  # and the run can be submitted again


def test_the_409_message_without_a_known_storage_names_the_placeholder() -> None:
    from ckrun.scheduler import k8s_api

    doc = {"kind": "Job", "metadata": {"namespace": "ml", "name": "ckrun-r1",
                                       "annotations": {"ckrun/run": "r1"}}}  # fmt: skip
    msg = str(k8s_api._exists_error(doc, None))
    assert "`ckrun cancel r1 --storage STORAGE` (STORAGE: the --storage it was" in msg
    assert "`kubectl delete job ckrun-r1 -n ml`" in msg
    msg = str(k8s_api._exists_error(doc, "s3://b/runs"))
    assert "`ckrun cancel r1 --storage s3://b/runs`" in msg


def test_an_unwritable_default_state_dir_only_costs_the_pointer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckrun.cli.commands import remember_state_root
    from ckrun.config import resolve

    (tmp_path / "not-a-dir").write_text("")  # XDG_STATE_HOME is a file: nothing under it
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "not-a-dir"))
    cfg = resolve("k8s", {"storage": "s3://b/runs", "state_dir": str(tmp_path / "st")}, run="r")
    remember_state_root(cfg)  # the submit goes on
    assert f"CKRUN_STATE_DIR={tmp_path / 'st'}" in capsys.readouterr().err
