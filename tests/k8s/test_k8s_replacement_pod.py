"""A replacement pod and the run's lease; only the pod of index 0 writes the run state.

SIMULATED, because no Kubernetes can run here: the Job controller's replacement pod is a
``ckrun run`` process given the environment ckrun's rendered Job gives a pod (its literal
env, and the Downward API values a kubelet would fill in: job name, namespace, pod name,
``JOB_COMPLETION_INDEX``); no Kubernetes API is called on this path (nothing is mocked:
nothing answers).  The old pod, still holding the run's lease on a node that stopped
renewing it, is a real :class:`ckrun.checkpoint.lease.Lease` of another machine id.
Everything else is real: the supervisor, its child, the lease in the "PVC" (a local
directory), ``supervisor/state.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckrun.checkpoint import layout
from ckrun.checkpoint.lease import Lease, read_lease
from ckrun.scheduler.base import JobSpec
from ckrun.scheduler.k8s import K8sScheduler, Options
from ckrun.storage.local import LocalStorage

TTL_S = 2.0


def pod_env(tmp: Path, index: int, api_host: bool) -> dict[str, str]:
    """The env of pod ``index`` of run ``demo``: rendered literals + Downward API values."""
    spec = JobSpec(run="demo", command=("python", "t.py"), storage="pvc:ckpt/demo",
                   options=Options(image="i"))  # fmt: skip
    (c,) = K8sScheduler().manifest(spec)["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKRUN_", "XDG_"))}
    env.update({e["name"]: e["value"] for e in c["env"] if "value" in e})
    env.update(
        CKRUN_K8S_JOB_NAME="demo",
        CKRUN_K8S_NAMESPACE="default",
        CKRUN_K8S_POD_NAME=f"demo-{index}-x7k2p",
        HOSTNAME=f"demo-{index}-x7k2p",
        JOB_COMPLETION_INDEX=str(index),
        CKRUN_MACHINE_ID=f"new-pod-{index}",
        CKRUN_STATE_DIR=str(tmp / f"emptydir-{index}"),  # the pod's own emptyDir
        CKRUN_LEASE_TTL_S=f"{TTL_S:g}",
        CKRUN_LEASE_HEARTBEAT_S="0.2",
    )
    if api_host:
        env["KUBERNETES_SERVICE_HOST"] = "10.96.0.1"
    return env


def ckrun_run(tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    child = [sys.executable, "-c", "print('trained')"]
    cmd = [sys.executable, "-m", "ckrun.cli", "run", "--run", "demo",
           "--storage", str(tmp / "pvc"), "--", *child]  # fmt: skip
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=120)


def old_pod_lease(tmp: Path) -> LocalStorage:
    """The old pod's lease, held on a node that no longer renews it."""
    storage = LocalStorage(str(tmp / "pvc" / "demo"))
    old = Lease(storage, "demo", ttl_s=TTL_S, job_id="default/demo", attempt=0)
    old.holder = dataclasses.replace(old.holder, machine="old-pod", host="demo-0-a1b2c")
    assert old.acquire(wait_s=0).epoch == 1
    return storage


@pytest.mark.parametrize("api_host", [True, False], ids=["service-env", "downward-api-only"])
def test_a_replacement_pod_of_index_0_waits_for_the_old_pods_lease(
    tmp_path: Path, api_host: bool
) -> None:
    storage = old_pod_lease(tmp_path)
    r = ckrun_run(tmp_path, pod_env(tmp_path, 0, api_host))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out  # before: exit 2 "run is owned by host demo-0-a1b2c"
    assert f"waiting up to {2 * TTL_S:g} s" in out and "trained" in out
    found = read_lease(storage)
    assert found is not None and found[0].epoch == 2 and found[0].holder is None  # released
    state = json.loads(storage.get(layout.RUN_STATE))
    assert state["attempts"] == 1


def test_only_the_pod_of_index_0_writes_the_run_state(tmp_path: Path) -> None:
    storage = old_pod_lease(tmp_path)  # index 1 neither waits for it nor takes it
    r = ckrun_run(tmp_path, pod_env(tmp_path, 1, True))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trained" in r.stdout + r.stderr and "waiting up to" not in r.stdout + r.stderr
    assert storage.head(layout.RUN_STATE) is None  # index 1 wrote no supervisor/state.json
    found = read_lease(storage)
    assert found is not None and found[0].epoch == 1  # nor touched the lease
    assert found[0].holder is not None and found[0].holder.machine == "old-pod"
    r0 = ckrun_run(tmp_path, pod_env(tmp_path, 0, True))
    assert r0.returncode == 0, r0.stdout + r0.stderr
    assert storage.head(layout.RUN_STATE) is not None  # index 0 does
