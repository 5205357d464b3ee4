"""Config precedence (CLI > env > profile > defaults), validation, run.json round trip."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest
from ckrun import config
from ckrun.config import RunConfig, parse_duration, parse_signal, resolve
from ckrun.errors import ConfigError
from ckrun.supervisor.rundir import RunDir


def test_precedence_and_sources() -> None:
    prof = config.load_profile("local")
    cfg = resolve("local", {"grace_s": "45"}, {"CKRUN_GRACE_S": "30", "CKRUN_MAX_FAILURES": "7"})
    assert cfg.grace_s == 45.0 and cfg.sources["grace_s"] == "cli"
    assert cfg.max_failures == 7 and cfg.sources["max_failures"] == "env:CKRUN_MAX_FAILURES"
    assert cfg.max_requeues == prof["max_requeues"]
    assert cfg.sources["max_requeues"] == "profile:local"
    assert cfg.world_size == RunConfig.world_size and cfg.sources["world_size"] == "default"


def test_storage_env_is_not_the_childs_run_root() -> None:
    cfg = resolve("local", {}, {"CKRUN_STORAGE": "/child/run/root", "CKRUN_STORAGE_BASE": "/b"})
    assert cfg.storage == "/b" and cfg.sources["storage"] == "env:CKRUN_STORAGE_BASE"


def test_backend_options_and_durations() -> None:
    cfg = resolve("local", {"chaos_preempt_every": "20s"}, {})
    assert cfg.options.chaos_preempt_every == 20.0
    cfg = resolve("local", {}, {"CKRUN_CHAOS_PREEMPT_EVERY": "2m"})
    assert cfg.options.chaos_preempt_every == 120.0
    assert parse_duration("500ms") == 0.5 and parse_duration(3) == 3.0
    with pytest.raises(ConfigError, match="invalid duration"):
        parse_duration("soon")


def test_unknown_keys_rejected_with_the_valid_list() -> None:
    with pytest.raises(ConfigError) as e:
        resolve("local", {"partition": "gpu"}, {})
    msg = str(e.value)
    assert "partition" in msg and "grace_s" in msg and "chaos_preempt_every" in msg
    assert e.value.exit_code == 3


def test_bad_values_and_unknown_profile() -> None:
    with pytest.raises(ConfigError, match="max_failures"):
        resolve("local", {"max_failures": "many"}, {})
    with pytest.raises(ConfigError, match="unknown signal"):
        resolve("local", {"notice_signal": "SIGNOPE"}, {})
    with pytest.raises(ConfigError, match="shipped profiles: .*local"):
        resolve("nosuchprofile", {}, {})
    with pytest.raises(ConfigError, match="notice_sources"):
        resolve("local", {"notice_sources": "aws,ibm"}, {})
    with pytest.raises(ConfigError, match="grace_s"):
        resolve("local", {"grace_s": "1", "margin_s": "2"}, {})


def test_notice_sources_and_cloud_keys() -> None:
    cfg = resolve("local", {"notice_sources": "aws,gcp"}, {"CKRUN_AWS_POLL_INTERVAL_S": "6"})
    assert cfg.notice_sources == ("aws", "gcp")
    assert cfg.cloud == {"aws_poll_interval_s": 6.0}


def test_parse_signal() -> None:
    assert parse_signal("USR2").name == "SIGUSR2"
    assert parse_signal("SIGTERM").name == "SIGTERM"
    assert parse_signal(10).name == "SIGUSR1"


def test_launch_hash_ignores_interpreter_path_but_not_args() -> None:
    a = RunConfig(run="r", command=("/usr/bin/python3", "t.py", "--lr", "1"))
    b = dataclasses.replace(a, command=("/venv/bin/python3", "t.py", "--lr", "1"))
    c = dataclasses.replace(a, command=("/usr/bin/python3", "t.py", "--lr", "2"))
    assert a.launch_hash() == b.launch_hash() != c.launch_hash()
    # world size changes are judged by the checkpoint's compat gate (resharding), not here
    assert a.launch_hash() == dataclasses.replace(a, world_size=2).launch_hash()


def test_run_json_round_trip(tmp_path: object) -> None:
    cfg = resolve(
        "local",
        {"storage": str(tmp_path), "grace_s": "12", "allow_change": "config.lr"},
        {},
        run="r1",
        command=("python", "t.py"),
    )
    rd = RunDir(cfg.state_root)
    rd.freeze(cfg)
    back = rd.load_config()
    assert back == cfg and back is not None and back.sources["grace_s"] == "cli"
    body = json.loads(open(rd.run_json).read())
    assert body["launch_hash"] == cfg.launch_hash() and body["allow_change"] == ["config.lr"]


def test_remote_storage_state_dir_defaults_to_the_user_state_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # issue 12: a fresh machine needs nothing but the storage URL (was: ConfigError)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    cfg = resolve("local", {"storage": "s3://bucket/prefix"}, {}, run="r")
    assert cfg.state_root.startswith(str(tmp_path / "xdg" / "ckrun") + "/")
    assert cfg.state_root.endswith("/r")
    other = resolve("local", {"storage": "s3://other/prefix"}, {}, run="r")
    assert other.state_root != cfg.state_root  # one cache per storage base
    monkeypatch.delenv("XDG_STATE_HOME")
    home = resolve("local", {"storage": "s3://bucket/prefix"}, {}, run="r").state_root
    assert home.startswith(os.path.expanduser("~/.local/state/ckrun/"))
    cfg = resolve("local", {"storage": "s3://bucket/prefix", "state_dir": "/tmp/st"}, {}, run="r")
    assert cfg.state_root == "/tmp/st/r" and cfg.run_root == "s3://bucket/prefix/r"
