"""Golden renders of the sbatch script (run everywhere; no Slurm needed).

Regenerate after an intended change with ``CKRUN_UPDATE_GOLDEN=1 pytest tests/slurm``
and review the diff.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from ckrun import config
from ckrun.errors import ConfigError
from ckrun.scheduler.base import JobSpec, get_scheduler
from ckrun.scheduler.slurm import Options, SlurmScheduler, options_from_mapping

GOLDEN = Path(__file__).resolve().parent / "golden"
LOGS = "/shared/ckrun-logs"

CASES: dict[str, tuple[Options, JobSpec]] = {
    "minimal": (
        Options(log_dir=LOGS),
        JobSpec(run="demo", command=("python", "train.py"), storage="/shared/runs/demo"),
    ),
    "multinode_gpu": (
        Options(
            partition="gpu",
            time="1-00:00:00",
            nodes=4,
            gpus_per_node=8,
            cpus_per_task=32,
            mem="480G",
            account="ml",
            qos="preemptible",
            lead_s=300,
            log_dir=LOGS,
            launcher="/opt/venv/bin/ckrun",
            setup=("source /opt/venv/bin/activate",),
            extra_sbatch=("--constraint=h100", "--exclusive"),
        ),
        JobSpec(
            run="llama-7b",
            command=("torchrun", "--nproc_per_node=8", "train.py", "--lr", "3e-4", "--name", "a b"),
            storage="s3://bucket/runs/llama-7b",
            env={"NCCL_DEBUG": "WARN", "WANDB_NAME": "it's"},
            supervisor_args=("--grace", "240"),
        ),
    ),
    "batch_shell": (
        Options(use_srun=False, time="30", lead_s=60, signal="SIGUSR2", log_dir=LOGS),
        JobSpec(run="small", command=("python", "-u", "train.py"), storage="/shared/runs/small"),
    ),
    "no_requeue": (
        Options(requeue=False, partition="debug", time="10", lead_s=30, log_dir=LOGS),
        JobSpec(run="dbg", command=("python", "train.py"), storage="/shared/runs"),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_matches_golden(name: str) -> None:
    opts, spec = CASES[name]
    text = SlurmScheduler(opts).render(spec)
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("CKRUN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"render changed; see {path}"
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_render_essentials() -> None:
    opts, spec = CASES["minimal"]
    text = SlurmScheduler(opts).render(spec)
    for line in (
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --job-name=demo",
        "#SBATCH --time=1:00:00",
        "export CKRUN_LEAD_S=120",
        "export CKRUN_NOTICE_SIGNAL=SIGUSR1",
    ):
        assert line in text.splitlines()
    assert "ckrun run --run demo --storage /shared/runs -- python train.py" in text
    assert "submitit.core._submit" not in text  # the program is the supervisor, not submitit's
    assert "USR2@90" not in text and "wckey" not in text


def test_storage_base_and_explicit_storage_arg() -> None:
    s = SlurmScheduler(Options(log_dir=LOGS))
    spec = JobSpec(run="r", command=("x",), storage="s3://b/p/r/")
    assert "--storage s3://b/p -- x" in s.supervisor_command(spec)
    spec = JobSpec(run="r", command=("x",), storage="/a/r", supervisor_args=("--storage", "/a"))
    assert s.supervisor_command(spec).count("--storage") == 1


def test_spec_options_win_over_scheduler_options() -> None:
    spec = JobSpec(
        run="r", command=("x",), storage="/s", options=Options(partition="p2", log_dir=LOGS)
    )
    text = SlurmScheduler(Options(partition="p1", log_dir=LOGS)).render(spec)
    assert "#SBATCH --partition=p2" in text and "p1" not in text


def test_render_refuses_mismatched_notice_signal() -> None:
    spec = JobSpec(run="r", command=("x",), storage="/s", env={"CKRUN_NOTICE_SIGNAL": "SIGUSR2"})
    with pytest.raises(ConfigError, match="notice_signal"):
        SlurmScheduler(Options(log_dir=LOGS)).render(spec)


def test_render_refuses_empty_command_and_bad_env() -> None:
    s = SlurmScheduler(Options(log_dir=LOGS))
    with pytest.raises(ConfigError, match="no training command"):
        s.render(JobSpec(run="r", command=(), storage="/s"))
    with pytest.raises(ConfigError, match="not a valid shell variable"):
        s.render(JobSpec(run="r", command=("x",), storage="/s", env={"A;rm -rf /": "1"}))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"time": "4h"}, "invalid Slurm time"),
        ({"time": "0"}, "longer than zero"),
        ({"lead_s": 3600, "time": "1:00:00"}, "shorter than time"),
        ({"nodes": 0}, "at least 1"),
        ({"nodes": "two"}, "whole number"),
        ({"signal": "KILL"}, "use one of"),
        ({"use_srun": False, "nodes": 2}, "nodes must be 1"),
        ({"extra_sbatch": ["--signal=USR2@60"]}, "renders itself"),
        ({"extra_sbatch": ["--array=0-3"]}, "ckrun.sbatch"),
        ({"extra_sbatch": ["constraint=a100"]}, "--flag"),
        ({"launcher": " "}, "launcher is empty"),
    ],
)
def test_options_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Options(**kwargs)  # type: ignore[arg-type]


def test_options_normalise() -> None:
    o = Options(signal="SIGUSR2", gpus_per_node="4", setup="module load cuda", partition="")  # type: ignore[arg-type]
    assert (o.signal, o.gpus_per_node, o.setup, o.partition) == (
        "USR2",
        4,
        ("module load cuda",),
        None,
    )
    assert Options(extra_sbatch=["#SBATCH --exclusive"]).sbatch_extra_params() == {
        "exclusive": True
    }
    with pytest.raises(ConfigError, match="valid: "):
        options_from_mapping({"partitio": "gpu"})


def test_slurm_profile_resolves_to_options() -> None:
    cfg = config.resolve(
        "slurm",
        cli={"partition": "gpu", "nodes": 2, "time": "2:00:00"},
        env={"CKRUN_GPUS_PER_NODE": "4", "CKRUN_LEAD_S": "90"},
        run="demo",
        command=("python", "train.py"),
    )
    assert cfg.scheduler == "slurm"
    assert isinstance(cfg.options, Options)
    assert (cfg.options.partition, cfg.options.nodes, cfg.options.gpus_per_node) == ("gpu", 2, 4)
    assert cfg.options.lead_s == 90 and cfg.options.time == "2:00:00"
    assert cfg.notice_signal.removeprefix("SIG") == cfg.options.signal
    assert isinstance(get_scheduler("slurm", options=cfg.options), SlurmScheduler)
