"""A LOCAL SIMULATION of a two-pod ckrun group on Kubernetes: one pod preempted, the
group stops at one agreed step, restarts, and resumes exactly.

No API server, Job controller or kubelet can run here, so these parts are SIMULATED by
the test, and only these:

* the Job controller: the test starts one "pod" per index of the *rendered* Indexed Job
  (its container ``command`` and literal env as rendered, ``JOB_COMPLETION_INDEX``, the
  Downward API values such as the ignored-failure count), and after every pod exited 75
  it starts the next generation, as ``podFailurePolicy: Ignore`` on exit 75 does;
* the container runtime: each pod is ``unshare --pid --uts --mount`` (needs root), so
  ``ckrun run`` is the namespace's PID 1, the host name is the pod's (``<job>-<index>``);
* cluster DNS and the headless Service: a private ``/etc/hosts`` (bind-mounted in the
  pod's mount namespace) maps the pods' stable names ``<job>-<index>.<service>`` to
  127.0.0.1; every pod shares the machine's loopback network;
* the PVC: a directory on the local disk, mounted nowhere (``pvc_mount_path`` points at
  it); with S3 storage, moto's S3 server on 127.0.0.1 stands in for S3, its endpoint
  and dummy credentials are put in the pod's env (what ``env_from_secret`` would
  inject), and each pod's ``emptyDir`` at ``/ckrun-state`` is a directory of its own
  (``CKRUN_STATE_DIR`` pointed at it);
* the kubelet's drain of one pod: SIGTERM to that pod's PID 1 from outside.

Everything else is real: torchrun with the c10d rendezvous at ``<job>-0.<service>``,
gloo over loopback on CPU, the supervisors, the ranks' all-reduce agreeing on the step,
the collective commit on disk, exit codes, the exact-resume comparison.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckrun.scheduler.base import JobSpec
from ckrun.scheduler.k8s import K8sScheduler, Options

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "storage"))
from s3_server import MotoS3, moto_s3  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "tests" / "distributed" / "dist_train.py"
CKRUN = Path(sys.executable).with_name("ckrun")
GRACE_S = 40  # terminationGracePeriodSeconds of the simulated pods
MARGIN_S = 12  # grace_margin_s: > the supervisor's kill_delay_s (10 s) + margin_s (2 s)
STEPS = 16


def _unshare_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not CKRUN.exists():
        return False
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "--mount", "true"],
        capture_output=True,
        timeout=30,
    )
    return r.returncode == 0


pytestmark = pytest.mark.skipif(
    not _unshare_works(), reason="needs root and a working `unshare --pid --uts --mount`"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _poll(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2 :].split()[0] != "Z"


def _children(ppid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            raw = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if raw and int(raw[raw.rindex(")") + 2 :].split()[1]) == ppid:
            out.append(int(entry))
    return out


def render(tmp: Path, run: str, train_args: list[str], storage: str) -> list[dict[str, Any]]:
    """The documents ``ckrun submit --nnodes 2 --nproc-per-node 1`` would create."""
    spec = JobSpec(
        run=run,
        command=("python", str(TRAIN), *train_args),
        storage=storage,
        nnodes=2,
        nproc_per_node=1,
        env={"OMP_NUM_THREADS": "1", "CKRUN_KILL_DELAY_S": "10", "CKRUN_MARGIN_S": "2"},
        options=Options(
            image="i",
            pvc_mount_path=str(tmp / "pvc"),
            ckrun_command=(str(CKRUN),),
            termination_grace_period_s=GRACE_S,
            grace_margin_s=MARGIN_S,
            rdzv_port=_free_port(),
            rdzv_timeout_s=120,
        ),
    )
    return K8sScheduler().manifests(spec)


class Pod:
    """One pod of the rendered Indexed Job: ``ckrun run`` as PID 1 of its namespaces."""

    def __init__(
        self,
        tmp: Path,
        docs: list[dict[str, Any]],
        index: int,
        generation: int,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        svc, job = docs
        name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
        pod = job["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        host = f"{name}-{index}"  # the Job controller's host name for an Indexed pod
        assert pod["subdomain"] == svc["metadata"]["name"]
        hosts = tmp / f"hosts-{index}"
        names = [
            f"{name}-{i}.{pod['subdomain']}.{ns}.svc.cluster.local {name}-{i}.{pod['subdomain']}"
            for i in range(job["spec"]["completions"])
        ]
        hosts.write_text(
            "127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {n} {host}\n" for n in names)
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CKRUN_", "SLURM_"))}
        env.update({e["name"]: e["value"] for e in c["env"] if "value" in e})
        env.update(
            PATH=f"{CKRUN.parent}:{os.environ.get('PATH', '')}",
            KUBERNETES_SERVICE_HOST="10.96.0.1",
            HOSTNAME=host,
            JOB_COMPLETION_INDEX=str(index),
            CKRUN_K8S_JOB_NAME=name,
            CKRUN_K8S_NAMESPACE=ns,
            CKRUN_K8S_POD_NAME=f"{host}-g{generation:04d}",
            CKRUN_K8S_POD_UID=f"uid-{index}-{generation}",
            CKRUN_K8S_NODE_NAME=f"spot-{index}",
            CKRUN_K8S_FAILURE_COUNT="0",
            CKRUN_K8S_IGNORED_FAILURE_COUNT=str(generation),
        )
        if "CKRUN_STATE_DIR" in env:  # the pod's own emptyDir
            env["CKRUN_STATE_DIR"] = str(tmp / f"emptydir-{index}-gen{generation}")
        env.update(extra_env or {})
        self.log = tmp / f"pod-{index}-gen{generation}.log"
        argv = [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--uts",
            "--mount",
            "--kill-child",
            "sh",
            "-c",
            'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
            "pod",
            host,
            str(hosts),
            *c["command"],
        ]
        self.out = open(self.log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv, stdout=self.out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.init = int(_poll(lambda: (_children(self.proc.pid) or [0])[0], 30, "PID 1"))

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            tail = self.text()[-4000:]
            raise AssertionError(f"pod did not exit in {timeout_s} s:\n{tail}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.out.close()


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for pod in started:
        pod.close()


class Store:
    """The run's storage as the test reads it: the PVC directory or the S3 bucket."""

    def __init__(self, tmp: Path, kind: str, request: pytest.FixtureRequest) -> None:
        self.kind, self.env = kind, {}
        if kind == "pvc":
            self.url, self.root = "pvc:ckpt/runs", tmp / "pvc" / "runs" / "grp"
            return
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        self.bucket, self.client = moto.new_bucket(), moto.client
        self.url = f"s3://{self.bucket}/runs"
        self.env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}

    def read(self, key: str) -> bytes | None:
        if self.kind == "pvc":
            path = self.root / key
            return path.read_bytes() if path.exists() else None
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=f"runs/grp/{key}")["Body"]
        except self.client.exceptions.NoSuchKey:
            return None
        return bytes(body.read())

    def manifests(self) -> list[dict[str, Any]]:
        if self.kind == "pvc":
            keys = [str(p.relative_to(self.root)) for p in self.root.rglob("manifest.json")]
        else:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix="runs/grp/"
            )
            keys = [
                o["Key"].removeprefix("runs/grp/")
                for page in pages
                for o in page.get("Contents", [])
                if o["Key"].endswith("/manifest.json")
            ]
        found = [json.loads(self.read(k) or b"{}") for k in keys]
        return sorted(found, key=lambda m: m["step"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same training, 2 ranks, no supervisor, no notice: the reference result
    (``torchrun --standalone``: torch picks its own free port, no race for one)."""
    tmp = tmp_path_factory.mktemp("plain")
    out = tmp / "plain.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKRUN_")}
    env.update(CKRUN_STORAGE=str(tmp / "plain"), CKRUN_RUN="plain", OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", "2", str(TRAIN), "--steps", str(STEPS), "--dump", str(out)]
    p = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        text = p.communicate(timeout=300)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, text[-3000:]
    return json.loads(out.read_text())


def _workers(init: int) -> dict[int, int]:
    """Global rank -> host pid of the torchrun workers under a pod's PID 1."""
    out, stack = {}, [init]
    while stack:
        pid = stack.pop()
        stack.extend(_children(pid))
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        env = dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            out[int(env["RANK"])] = pid
    return out


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["pvc", pytest.param("s3", marks=pytest.mark.s3)])
def test_one_pod_preempted_the_group_stops_at_one_step_and_resumes_exactly(
    tmp_path: Path,
    pods: list[Pod],
    storage: str,
    request: pytest.FixtureRequest,
    uninterrupted: Any,
) -> None:
    progress, cut = tmp_path / "progress", tmp_path / "cut.json"
    args = ["--steps", str(STEPS), "--step-s", "0.15", "--progress", str(progress)]
    args += ["--dump", str(cut), "--hold-at", "4"]  # generation 0 waits at 4 for the drain
    store = Store(tmp_path, storage, request)
    docs = render(tmp_path, "grp", args, store.url)
    assert [d["kind"] for d in docs] == ["Service", "Job"]

    # generation 0: both indexes start; one pod is drained by its kubelet at step >= 4
    gen0 = [Pod(tmp_path, docs, i, 0, store.env) for i in range(2)]
    pods.extend(gen0)
    _poll(lambda: progress.exists() and int(progress.read_text() or 0) >= 4, 180, "step 4")
    ranks = {i: _workers(p.init) for i, p in enumerate(gen0)}
    # node rank = JOB_COMPLETION_INDEX: global rank 0 (commits, finalizes) runs in pod 0
    assert {i: sorted(w) for i, w in ranks.items()} == {0: [0], 1: [1]}
    # the drained pod: index 1 on the PVC, index 0 (the rendezvous host) on S3
    victim = 1 if storage == "pvc" else 0
    drained, peer = gen0[victim], gen0[1 - victim]
    t0 = time.monotonic()
    os.kill(drained.init, signal.SIGTERM)  # DisruptionTarget: the kubelet's SIGTERM to PID 1
    codes = [p.wait(GRACE_S) for p in gen0]
    assert codes == [75, 75], "\n".join(p.text()[-3000:] for p in gen0)
    assert time.monotonic() - t0 < GRACE_S
    # the drained pod drained on its own SIGTERM; the other on the peer notice of its rank
    assert "notice signal:SIGTERM" in drained.text(), drained.text()[-3000:]
    assert "notice peer:agreed-step" in peer.text(), peer.text()[-3000:]
    lines = [x for x in peer.text().splitlines() if x.startswith("[ckrun]")]
    assert not [x for x in lines if "failure" in x or "restarting" in x]  # judged as a drain
    assert any(f"checkpoint step {store.manifests()[-1]['step']} committed" in x for x in lines)
    (saved,) = store.manifests()  # one collective commit: one step, both ranks' shards
    assert saved["kind"] == "recovery" and saved["world_size"] == 2
    assert sorted(s["rank"] for s in saved["shards"]) == [0, 1]
    assert not any(_alive(pid) for w in ranks.values() for pid in w.values())  # none left

    # generation 1: the Job controller replaces every index (podFailurePolicy Ignore)
    gen1 = [Pod(tmp_path, docs, i, 1, store.env) for i in range(2)]
    pods.extend(gen1)
    assert [p.wait(180) for p in gen1] == [0, 0], "\n".join(p.text()[-3000:] for p in gen1)
    assert f"resuming from step {saved['step']}" in gen1[0].text(), gen1[0].text()[-3000:]
    assert store.read("COMPLETE.json") is not None
    if storage == "pvc":  # one state dir on the claim: index 1 keeps its own event log
        assert (store.root / "events.jsonl").exists()
        assert (store.root / "events-rank1.jsonl").exists()
    assert json.loads(cut.read_text()) == uninterrupted  # bitwise equal
    assert re.search(r"run completed", gen1[1].text()), gen1[1].text()[-2000:]
