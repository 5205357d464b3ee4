"""The peer notice: one pod's drain reaches every node's supervisor (real processes).

When one pod of a multi-node run is drained, only its supervisor gets SIGTERM.  The
ranks agree on the step through ``preemption_requested(sync=True)``; a rank that learnt
of the notice only through that all-reduce leaves ``peer-notice.json`` for its own
supervisor, which then drains too: the child's exit (torchrun exits 1 when a worker
exits 75) is judged by the commit, never counted as a failure and restarted in place.

Nothing is mocked: a real ``ckrun run`` supervisor with a pod's environment (the k8s
backend is picked from ``KUBERNETES_SERVICE_HOST``; no API server is involved, the
supervisor makes no API call) and a real child process; two real gloo ranks for the
all-reduce.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: The child: leaves the peer notice as a rank would, then exits 1 like torchrun.
CHILD = textwrap.dedent(
    """
    import sys, time
    from ckrun import control
    control.write_peer_notice()
    time.sleep(float(sys.argv[1]))
    sys.exit(1)
    """
)


def _pod_env(index: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKRUN_", "SLURM_"))}
    env.update(
        KUBERNETES_SERVICE_HOST="10.96.0.1",
        JOB_COMPLETION_INDEX=str(index),
        CKRUN_K8S_JOB_NAME="grp",
        CKRUN_K8S_NAMESPACE="default",
        CKRUN_K8S_POD_NAME=f"grp-{index}-abcde",
        CKRUN_BACKOFF_S="0.1",
        CKRUN_MAX_FAILURES="1",
        CKRUN_KILL_DELAY_S="1",
        CKRUN_MARGIN_S="0.5",
        CKRUN_GRACE_S="10",
    )
    return env


@pytest.mark.parametrize("linger_s", ["0.5", "0"])  # 0: it exits right after the notice
def test_a_peer_notice_drains_the_supervisor_instead_of_a_restart(
    tmp_path: Path, linger_s: str
) -> None:
    cmd = [sys.executable, "-m", "ckrun.cli", "run", "--run", "grp", "--storage", str(tmp_path)]
    cmd += ["--", sys.executable, "-c", CHILD, linger_s]
    r = subprocess.run(cmd, env=_pod_env(1), capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 76, out  # drained, no new checkpoint: requeue without progress
    assert "notice peer:agreed-step" in out, out
    assert "restarting" not in out and out.count("started, from scratch") == 1, out
    # rank 1 keeps its own event log; index 0's is the run's
    assert (tmp_path / "grp" / "events-rank1.jsonl").exists()


RANKS = textwrap.dedent(
    """
    import os, sys
    import torch.distributed as dist
    from ckrun import control
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agreed = [control.preemption_requested(sync=True) for _ in range(2)]
    print(rank, agreed, flush=True)
    # a live gloo group at interpreter exit can abort a rank (std::terminate on its
    # threads) once the peer is gone: a well-formed torch.distributed script destroys it
    dist.destroy_process_group()
    """
)


def test_only_ranks_told_by_the_all_reduce_leave_a_peer_notice(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dirs = [tmp_path / f"control{r}" for r in range(2)]
    for d in dirs:
        d.mkdir()
    (dirs[1] / "notice.json").write_text(
        '{"kind": "termination", "source": "signal:SIGTERM", "deadline_utc": '
        '"2099-01-01T00:00:00Z", "issued_utc": "2026-01-01T00:00:00Z", "detail": {}}'
    )
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKRUN_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            CKRUN_CONTROL_DIR=str(dirs[rank]),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANKS], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs == ["0 [True, True]\n", "1 [True, True]\n"]
    assert (dirs[0] / "peer-notice.json").exists()  # rank 0 learnt it from rank 1
    assert not (dirs[1] / "peer-notice.json").exists()  # rank 1 had its own notice


def test_a_peer_notice_on_one_machine_restarts_there(tmp_path: Path) -> None:
    """Local backend (one machine, several ranks; one rank got a signal of its own): the
    peer notice drains, and the machine is not going away, so the run restarts here."""
    child = textwrap.dedent(
        """
        import os, sys
        from ckrun import control
        if os.environ["CKRUN_ATTEMPT"] == "0":
            control.write_peer_notice()
            sys.exit(1)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKRUN_", "SLURM_"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.update(CKRUN_BACKOFF_S="0.1", CKRUN_KILL_DELAY_S="1", CKRUN_MARGIN_S="0.5")
    cmd = [sys.executable, "-m", "ckrun.cli", "run", "--run", "one", "--storage", str(tmp_path)]
    cmd += ["--", sys.executable, "-c", child]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "notice peer:agreed-step" in out and "restarting here" in out, out
