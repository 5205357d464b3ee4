"""The torchrun command line, the world size in the config, the worker process tree."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from ckrun.checkpoint.collective import allowed_changes, rederive_sampler, reshards
from ckrun.checkpoint.manifest import Manifest, ShardInfo
from ckrun.config import resolve
from ckrun.errors import ConfigError
from ckrun.supervisor import process, torchrun

PY = sys.executable


def test_one_process_runs_the_command_itself() -> None:
    assert torchrun.wrap((PY, "train.py", "--x"), nproc_per_node=1) == (PY, "train.py", "--x")


def test_a_script_runs_under_torchrun_with_the_grace_as_shutdown_timeout() -> None:
    argv = torchrun.wrap((PY, "train.py", "--steps", "3"), nproc_per_node=2, grace_s=59.5)
    assert argv[:4] == (PY, "-m", "torch.distributed.run", "--nproc-per-node")
    assert argv[-3:] == ("train.py", "--steps", "3") and "--standalone" in argv
    assert torchrun.supports_shutdown_timeout()  # torch 2.13 in the venv
    i = argv.index("--shutdown-timeout")
    assert argv[i + 1] == "60"


def test_modules_and_other_programs() -> None:
    assert torchrun.wrap((PY, "-m", "pkg.train", "-a"), nproc_per_node=2)[-3:] == (
        "-m",
        "pkg.train",
        "-a",
    )
    argv = torchrun.wrap(("bash", "-c", "python t.py"), nproc_per_node=2)
    assert argv[0] == "python3" and argv[-4:] == ("--no-python", "bash", "-c", "python t.py")


def test_several_nodes_use_a_static_rendezvous() -> None:
    env = {"MASTER_ADDR": "node1", "MASTER_PORT": "1234"}
    argv = torchrun.wrap((PY, "t.py"), nproc_per_node=4, nnodes=2, node_rank=1, env=env)
    i = argv.index("--node-rank")
    assert argv[i : i + 6] == (
        "--node-rank",
        "1",
        "--master-addr",
        "node1",
        "--master-port",
        "1234",
    )
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        torchrun.wrap((PY, "t.py"), nproc_per_node=1, nnodes=2, env={})
    with pytest.raises(ConfigError, match="node rank 2"):
        torchrun.wrap((PY, "t.py"), nproc_per_node=1, nnodes=2, node_rank=2, env=env)


def test_slurm_gives_the_rendezvous_address_and_port() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[03-05,9],cpu1", "SLURM_JOB_ID": "123456"}
    argv = torchrun.wrap((PY, "t.py"), nproc_per_node=8, nnodes=4, node_rank=3, env=env)
    i = argv.index("--master-addr")
    assert argv[i : i + 4] == ("--master-addr", "gpu03", "--master-port", str(20000 + 3456))
    assert torchrun.first_host("a1,b2") == "a1" and torchrun.first_host("n[7]") == "n7"


def test_world_size_is_derived_and_not_in_the_launch_hash() -> None:
    one = resolve("local", {}, {}, run="r", command=("python", "t.py"))
    two = resolve("local", {"nproc_per_node": 2}, {}, run="r", command=("python", "t.py"))
    four = resolve(
        "local", {"nproc_per_node": 2, "nnodes": 2}, {}, run="r", command=("python", "t.py")
    )
    assert (one.world_size, two.world_size, four.world_size) == (1, 2, 4)
    # a run may move to another world size when its checkpoint reshards: the child's
    # compat gate decides (tests/distributed/test_dist_checkpoint.py), not the launch hash
    assert len({one.launch_hash(), two.launch_hash(), four.launch_hash()}) == 1
    with pytest.raises(ConfigError, match="contradicts"):
        resolve("local", {"nproc_per_node": 2, "world_size": 3}, {}, run="r")
    with pytest.raises(ConfigError, match=">= 1"):
        resolve("local", {"nproc_per_node": 0}, {}, run="r")


def _manifest(world: int, compat: dict[str, object]) -> Manifest:
    shards = tuple(
        ShardInfo(
            f"checkpoints/step-0000000001/shard-r{r:05d}-a0000-0000000{r}.ckpt",
            r,
            1,
            "crc32c:00000000",
        )
        for r in range(world)
    )
    return Manifest(
        run="r",
        step=1,
        kind="recovery",
        attempt=0,
        world_size=world,
        shards=shards,
        compat=compat,
        metrics={},
        resumed_from=None,
        created_utc="",
        committed_utc="",
        save_duration_s=0.0,
    )


def test_world_size_may_change_only_when_the_format_reshards() -> None:
    replicated = {"world_size": 2, "sharding": {"policy": "replicated"}}
    assert reshards(_manifest(1, {})) and reshards(_manifest(2, replicated))
    assert allowed_changes(_manifest(2, replicated), 1) == ("world_size", "sharding")
    assert allowed_changes(_manifest(2, replicated), 2) == ()
    other = {"world_size": 2, "sharding": {"policy": "per-rank-only"}}
    assert not reshards(_manifest(2, other)) and allowed_changes(_manifest(2, other), 1) == ()


def test_sampler_position_follows_the_global_sample_count() -> None:
    sd = {
        "epoch": 3,
        "position": 10,
        "seed": 1,
        "n": 100,
        "shuffle": True,
        "num_replicas": 4,
        "rank": 0,
    }
    assert rederive_sampler(sd, 2, 1) == {**sd, "position": 20, "num_replicas": 2, "rank": 1}
    assert rederive_sampler(sd, 3, 2)["position"] == 13  # 40 // 3: one sample seen again
    assert rederive_sampler({**sd, "position": 25}, 1, 0)["position"] == 100  # clamped


def _wait(cond: object, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if callable(cond) and cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_workers_in_their_own_sessions_are_found_even_when_orphaned(tmp_path: Path) -> None:
    # A launcher (its own session, like the supervisor's child) starts a worker with
    # start_new_session=True, as torchrun does, then is killed: the worker is orphaned.
    pidfile = tmp_path / "worker.pid"
    code = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(w.pid))\n"
        "time.sleep(60)\n"
    )
    child = process.spawn((PY, "-c", code), dict(os.environ), track_tree=True)
    try:
        _wait(lambda: pidfile.exists() and pidfile.read_text())
        worker = int(pidfile.read_text())
        assert os.getsid(worker) != child.pid
        assert worker in process.members(child)  # a descendant in another session
        plain = process.Child(child.pid, child.argv, child.started)
        assert worker not in process.members(plain)  # session-only view misses it
        os.kill(child.pid, 9)
        os.waitpid(child.pid, 0)  # the launcher is gone; the worker lives on
        assert worker in process.members(child)  # orphan: found by its session
        assert process.session_alive(child)
        process.signal_session(child, 9)
        _wait(lambda: not process.session_alive(child))
    finally:
        for pid in process.members(child):
            os.kill(pid, 9)
