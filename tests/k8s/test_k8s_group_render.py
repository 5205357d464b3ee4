"""Multi-node renders: an Indexed Job + headless Service, or a JobSet; validated offline.

No API server can run here.  The Service and the Indexed Job are validated with
``kubernetes-validate`` against the official OpenAPI schemas of Kubernetes 1.29-1.37 in
strict mode; the JobSet against the published JobSet CRD schemas shipped in
``tests/k8s/schemas`` (v0.10.0, the oldest with every field used, and v0.12.0), strictly
(unknown fields rejected), and its embedded Job spec against the batch/v1 schemas too.
What the Job controller and the JobSet controller then do is not exercised here (see
``test_k8s_group_sim.py`` for the simulated group).

Regenerate the golden files after an intended change with ``CKRUN_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import copy
import gzip
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from ckrun.errors import ConfigError, ExitCode
from ckrun.scheduler.base import JobSpec
from ckrun.scheduler.k8s import K8sScheduler, Options
from ckrun.scheduler.k8s_group import RDZV_ENDPOINT_ENV
from ckrun.supervisor.torchrun import rendezvous_args

kv = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
SUPPORTED = [f"1.{m}" for m in range(29, 38)]
JOBSET_VERSIONS = ["v0.10.0", "v0.12.0"]


def _spec(kind: str = "job", storage: str = "s3://acme-ckpt/runs", **kw: Any) -> JobSpec:
    return JobSpec(
        run="llm-2node",
        command=("python", "train.py", "--lr", "3e-4"),
        storage=storage,
        nnodes=kw.pop("nnodes", 2),
        nproc_per_node=8,
        env={"NCCL_DEBUG": "WARN"},
        options=Options(
            image="ghcr.io/acme/train:1.4",
            namespace="ml",
            gpus=8,
            shm_size="64Gi",
            node_selector=("cloud.google.com/gke-spot=true",),
            k8s_kind=kind,
            **kw,
        ),
    )


CASES = {
    "group-2node-s3": lambda: _spec(),
    "group-jobset-pvc": lambda: _spec("jobset", "pvc:ckpt-claim/llm"),
}


def _docs(spec: JobSpec) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(K8sScheduler().render(spec)))


def _k8s_errors(doc: dict[str, Any]) -> dict[str, str]:
    out = {}
    for v in SUPPORTED:
        try:
            kv.validate(doc, v, strict=True)
        except kv.ValidationError as e:
            out[v] = str(e).splitlines()[0]
    return out


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected wherever it lists the fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def _jobset_validator(version: str) -> Any:
    path = HERE / "schemas" / f"jobset.x-k8s.io_jobsets-{version}.yaml.gz"
    crd = yaml.safe_load(gzip.decompress(path.read_bytes()))
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    return jsonschema.Draft4Validator(_strict(ver["schema"]["openAPIV3Schema"]))


def _jobset_errors(doc: dict[str, Any]) -> dict[str, str]:
    out = {}
    for v in JOBSET_VERSIONS:
        err = jsonschema.exceptions.best_match(_jobset_validator(v).iter_errors(doc))
        if err is not None:
            out[v] = f"{'.'.join(map(str, err.absolute_path))}: {err.message}"
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_render(case: str) -> None:
    text = K8sScheduler().render(CASES[case]())
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("CKRUN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"render changed; CKRUN_UPDATE_GOLDEN=1 rewrites {path}"


def test_indexed_job_and_service_are_valid_on_every_supported_version() -> None:
    docs = _docs(_spec())
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for doc in docs:
        assert _k8s_errors(doc) == {}, doc["kind"]
    bad = copy.deepcopy(docs[0])
    bad["spec"]["clusterIp"] = "None"  # not vacuous: a misspelt field fails everywhere
    assert set(_k8s_errors(bad)) == set(SUPPORTED)


def test_jobset_is_valid_against_the_published_crd_schemas() -> None:
    (doc,) = _docs(_spec("jobset"))
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert _jobset_errors(doc) == {}
    # the child Job's spec is a batch/v1 JobSpec: valid on every supported version too
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}}
    job["spec"] = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert _k8s_errors(job) == {}
    for path, value in (
        (("spec", "failurePolicy", "restartStrategie"), "Recreate"),
        (("spec", "failurePolicy", "restartStrategy"), "Sometimes"),
        (("spec", "replicatedJobs", 0, "template", "spec", "completion"), 2),
    ):
        bad = copy.deepcopy(doc)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert set(_jobset_errors(bad)) == set(JOBSET_VERSIONS), path


def test_indexed_job_shape() -> None:
    svc, job = _docs(_spec())
    name = job["metadata"]["name"]
    js, pod = job["spec"], job["spec"]["template"]["spec"]
    assert js["completionMode"] == "Indexed" and js["completions"] == js["parallelism"] == 2
    assert js["maxFailedIndexes"] == 0 and js["backoffLimitPerIndex"] == 3
    assert js["podReplacementPolicy"] == "Failed"  # never two generations of one index
    assert svc["metadata"]["name"] == pod["subdomain"] == name
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    first = js["podFailurePolicy"]["rules"][0]  # every index requeues, uncounted
    assert first["action"] == "Ignore" and first["onExitCodes"]["values"] == [75, 76]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[RDZV_ENDPOINT_ENV] == f"{name}-0.{name}:29500"
    assert env["CKRUN_NNODES"] == "2" and env["CKRUN_NPROC_PER_NODE"] == "8"
    assert c["command"][0] == "ckrun"  # exec form: ckrun is PID 1 in every pod


@pytest.mark.parametrize("kind", ["job", "jobset"])
def test_each_pod_rendezvous_at_index_0_with_its_own_name(kind: str) -> None:
    """torchrun's c10d arguments from the rendered env, as each pod's supervisor builds
    them: index 0 hosts the store, every node gives its stable host name (the one the
    controller gives the pod) as its address, so node rank = JOB_COMPLETION_INDEX."""
    doc = _docs(_spec(kind, nnodes=3))[-1]
    js = doc["spec"]["replicatedJobs"][0]["template"]["spec"] if kind == "jobset" else doc["spec"]
    (c,) = js["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    name = doc["metadata"]["name"]
    prefix = f"{name}-node-0" if kind == "jobset" else name  # the pods' host names
    for index in range(3):
        args = rendezvous_args(3, index, env)
        flags = dict(zip(args[::2], args[1::2], strict=True))
        assert flags["--rdzv-backend"] == "c10d"
        assert flags["--rdzv-endpoint"] == f"{prefix}-0.{name}:29500"
        assert flags["--local-addr"] == f"{prefix}-{index}.{name}"
        conf = f"is_host={str(index == 0).lower()},join_timeout=900,read_timeout=900"
        assert flags["--rdzv-conf"] == conf
    addrs = [f"{prefix}-{i}.{name}" for i in range(12)]
    assert sorted(addrs)[0] == addrs[0]  # index 0 is node rank 0 for any N


def test_jobset_restarts_the_group_on_preemption_and_fails_on_3_or_4() -> None:
    (doc,) = _docs(_spec("jobset"))
    fp = doc["spec"]["failurePolicy"]
    assert fp["restartStrategy"] == "BlockingRecreate" and fp["maxRestarts"] == 3
    fail, restart = fp["rules"]
    assert fail["action"] == "FailJobSet" and restart["action"] == (
        "RestartJobSetAndIgnoreMaxRestarts"
    )
    # the Job controller's FailJob message (pkg/controller/job/pod_failure_policy.go)
    msg = "Container ckrun for pod ml/p-0 failed with exit code {} matching FailJob rule at index 1"
    (pattern,) = fail["onJobFailureMessagePatterns"]
    assert [bool(re.search(pattern, msg.format(c))) for c in (3, 4, 75, 76, 1, 33)] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0 and "backoffLimitPerIndex" not in job
    actions = {
        tuple((r.get("onExitCodes") or {}).get("values", ["cond"])): r["action"]
        for r in job["podFailurePolicy"]["rules"]
    }
    requeue = (int(ExitCode.PREEMPTED), int(ExitCode.PREEMPTED_NO_CHECKPOINT))
    assert actions == {requeue: "FailJob", (3, 4): "FailJob", ("cond",): "FailJob"}
    assert doc["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "llm-2node"}


def test_one_node_renders_as_before() -> None:
    single = _docs(_spec(nnodes=1))
    assert [d["kind"] for d in single] == ["Job"]
    assert "subdomain" not in single[0]["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"k8s_kind": "deployment"}, "k8s_kind"),
        ({"rdzv_port": 70000}, "rdzv_port"),
        ({"rdzv_timeout_s": 0}, "rdzv_timeout_s"),
    ],
)
def test_options_refuse(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Options(image="i", **kw)


def test_host_names_longer_than_a_dns_label_are_refused() -> None:
    spec = JobSpec(
        run="r" * 52,
        command=("python", "t.py"),
        storage="s3://b/r",
        nnodes=1001,  # "<52 chars>-node-0-1000": 64 characters
        options=Options(image="i", k8s_kind="jobset"),
    )
    with pytest.raises(ConfigError, match="63 characters"):
        K8sScheduler().render(spec)


def test_rendezvous_endpoint_must_name_index_0() -> None:
    with pytest.raises(ConfigError, match="<prefix>-0"):
        rendezvous_args(2, 1, {RDZV_ENDPOINT_ENV: "grp-1.grp:29500"})


def test_cli_dry_run_of_the_readme_example_is_schema_valid(tmp_path: Path) -> None:
    """`kubectl apply --dry-run=client` at the schema level: the README's two-node run."""
    env = dict(os.environ, CKRUN_STATE_DIR=str(tmp_path / "state"))
    for key in ("KUBERNETES_SERVICE_HOST", "SLURM_JOB_ID", "CKRUN_STORAGE_BASE", "CKRUN_IMAGE"):
        env.pop(key, None)
    # README.md's Kubernetes section, word for word (plus --run)
    argv = [str(Path(sys.executable).with_name("ckrun")), "submit", "train.py", "--profile"]
    argv += ["k8s", "--set", "image=ghcr.io/me/train:1", "--gpus", "8", "--nnodes", "2"]
    argv += ["--nproc-per-node", "8", "--storage", "s3://bucket/runs", "--dry-run"]
    argv += ["--run", "llm"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all(r.stdout[r.stdout.index("# ckrun Service + Job") :]))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for doc in docs:
        assert _k8s_errors(doc) == {}, doc["kind"]
    assert docs[1]["spec"]["completions"] == 2
    readme = (HERE.parents[1] / "README.md").read_text().replace("\\\n    ", "")
    assert "ckrun submit " + " ".join(argv[2:-2]) in readme  # the example is this command
    r = subprocess.run(
        [*argv, "--set", "k8s_kind=jobset"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (doc,) = yaml.safe_load_all(r.stdout[r.stdout.index("# ckrun JobSet") :])
    assert _jobset_errors(doc) == {}
