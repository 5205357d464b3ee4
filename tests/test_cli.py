"""The ckrun command line: forms, exit codes, laziness (no torch in the supervisor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PY = sys.executable


def cli(args: list[str], cwd: Path | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
    r: subprocess.CompletedProcess[str] = subprocess.run(  # type: ignore[call-overload]
        [PY, "-m", "ckrun.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kw
    )
    return r


NO_TORCH = """
import sys
from ckrun.cli import main
try:
    main({argv!r})
except SystemExit as e:
    code = e.code
assert "torch" not in sys.modules, "torch was imported"
print("exit", code)
"""


def test_help_does_not_import_torch() -> None:
    r = subprocess.run(
        [PY, "-c", NO_TORCH.format(argv=["--help"])], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "exit 0" in r.stdout
    for cmd in ("submit", "run", "status", "preempt", "cancel", "config"):
        assert cmd in r.stdout


def test_run_supervises_without_importing_torch(tmp_path: Path) -> None:
    argv = ["run", "--run", "nt", "--storage", str(tmp_path), "--", "true"]
    r = subprocess.run(
        [PY, "-c", NO_TORCH.format(argv=argv)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "exit 0" in r.stdout


def test_submit_py_script_uses_this_python_and_dry_run_writes_nothing(tmp_path: Path) -> None:
    r = cli(
        [
            "submit",
            "--dry-run",
            "--show-config",
            "--run",
            "d",
            "--storage",
            "runs",
            "train.py",
            "--",
            "--steps",
            "5",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert body["command"] == [PY, "train.py", "--steps", "5"]
    assert body["storage"] == str(tmp_path / "runs")
    assert "ckrun.cli run --run d" in r.stdout
    assert not (tmp_path / "runs").exists()


def test_submit_without_command_is_a_usage_error(tmp_path: Path) -> None:
    r = cli(["submit"], tmp_path)
    assert r.returncode == 2 and "no command" in r.stderr


def test_default_run_name_is_printed(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    r = cli(["submit", "--storage", "runs", str(script)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "hi" in r.stdout
    name = r.stderr.split("[ckrun] run ", 1)[1].split(":", 1)[0]
    assert name.startswith("job-") and (tmp_path / "runs" / name / "run.json").exists()


def test_config_invalid_exits_3(tmp_path: Path) -> None:
    r = cli(["submit", "--run", "x", "--grace", "never", "--", "true"], tmp_path)
    assert r.returncode == 3 and "invalid duration" in r.stderr


def test_command_not_found_fails_clearly(tmp_path: Path) -> None:
    r = cli(["submit", "--run", "nf", "--storage", "runs", "--", "no-such-command-xyz"], tmp_path)
    assert r.returncode == 1 and "cannot run 'no-such-command-xyz'" in r.stderr


def test_config_shows_sources(tmp_path: Path) -> None:
    r = cli(["config", "--json"], tmp_path, env={"PATH": "/usr/bin:/bin", "CKRUN_GRACE_S": "33"})
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["grace_s"] == {"value": 33.0, "source": "env:CKRUN_GRACE_S"}
    assert body["max_requeues"]["source"] == "profile:local"
    assert body["world_size"]["source"] == "default"


def test_status_preempt_cancel_of_unknown_run(tmp_path: Path) -> None:
    for cmd in ("status", "preempt", "cancel"):
        r = cli([cmd, "ghost", "--storage", "runs"], tmp_path)
        assert r.returncode == 2 and "no run 'ghost'" in r.stderr


def test_preempt_needs_a_live_supervisor(tmp_path: Path) -> None:
    assert (
        cli(["submit", "--run", "done", "--storage", "runs", "--", "true"], tmp_path).returncode
        == 0
    )
    r = cli(["preempt", "done", "--storage", "runs"], tmp_path)
    assert r.returncode == 2 and "no live supervisor" in r.stderr


def test_detach_returns_at_once_and_the_run_completes(tmp_path: Path) -> None:
    r = cli(
        [
            "submit",
            "--detach",
            "--run",
            "bg",
            "--storage",
            "runs",
            "--",
            "sh",
            "-c",
            "echo detached-output",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "submitted to local as job" in r.stderr
    log = tmp_path / "runs" / "bg" / "supervisor.log"
    import time

    end = time.monotonic() + 30
    while time.monotonic() < end and "run completed" not in (
        log.read_text() if log.exists() else ""
    ):
        time.sleep(0.05)
    assert "detached-output" in log.read_text() and "run completed" in log.read_text()


def test_submit_options_after_the_script_and_script_args_after_dashdash(tmp_path: Path) -> None:
    # The README's form: ckrun's options anywhere before `--`, the script's after it.
    r = cli(
        [
            "submit",
            "train.py",
            "--run",
            "r1",
            "--dry-run",
            "--show-config",
            "--",
            "--storage",
            "s",
            "--steps",
            "5",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert body["run"] == "r1" and body["storage"] == str(tmp_path / "ckrun-runs")
    assert body["command"] == [PY, "train.py", "--storage", "s", "--steps", "5"]
    r = cli(
        ["submit", "--dry-run", "--show-config", "--run", "r2", "train.py", "--lr=3", "-n", "2"],
        tmp_path,
    )
    assert json.loads(r.stdout[: r.stdout.rindex("}") + 1])["command"] == [
        PY,
        "train.py",
        "--lr=3",
        "-n",
        "2",
    ]


def test_config_says_the_notice_timing(tmp_path: Path) -> None:
    # issue 11 item 4: TERM and KILL both inside grace_s, said in `ckrun config`
    env = {"PATH": "/usr/bin:/bin", "CKRUN_GRACE_S": "20", "CKRUN_KILL_DELAY_S": "5"}
    r = cli(["config"], tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "TERM at +13 s" in r.stdout and "KILL at +18 s" in r.stdout
    assert "exits by +20 s at the latest" in r.stdout


def test_runs_on_a_bucket_it_cannot_list_says_why(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKRUN_"))}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, HOME=str(tmp_path))  # fmt: skip
    r = cli(["runs", "--storage", "s3://ckrun-no-such-bucket/runs"], tmp_path, env=env)
    assert r.returncode == 5, r.stdout + r.stderr  # a storage error, not "no runs"
    assert "cannot list the runs in s3://ckrun-no-such-bucket/runs" in r.stderr
    assert "no AWS credentials" in r.stderr and "no runs under" not in r.stdout


def test_runs_refuses_a_storage_scheme_it_does_not_know(tmp_path: Path) -> None:
    r = cli(["runs", "--storage", "gs://bucket/runs"], tmp_path)
    assert r.returncode != 0 and "no runs under" not in r.stdout
    assert "--storage gs://bucket/runs" in r.stderr and "s3://BUCKET/PREFIX" in r.stderr


def test_runs_lists_only_the_runs_of_its_base_from_a_shared_state_dir(tmp_path: Path) -> None:
    env = dict(os.environ, CKRUN_STATE_DIR=str(tmp_path / "state"))  # one for both bases
    for run, base in (("r1", "a"), ("r2", "b")):
        r = cli(["run", "--run", run, "--storage", base, "--", sys.executable, "-c", "pass"],
                tmp_path, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
    for base, run in (("a", "r1"), ("b", "r2")):
        r = cli(["runs", "--storage", base, "--json"], tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        assert [x["run"] for x in json.loads(r.stdout)] == [run]
