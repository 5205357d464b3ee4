"""submit / status / cancel through the official ``kubernetes`` client against a STUB.

No real Kubernetes API server can run on these machines.  These tests run the real
client (kubeconfig loading, serialization, HTTP, error classes) against
``k8s_stub_api.StubApi``, a small http.server on 127.0.0.1 that speaks just enough of
the batch/v1 Jobs and core/v1 Pods REST API and runs no Job controller: pod phases and
Job conditions are seeded by the tests.  What a real cluster does with the Job
(podFailurePolicy, replacement pods) is not exercised here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from ckrun.errors import SchedulerError  # noqa: E402
from ckrun.scheduler.base import JobSpec, JobState  # noqa: E402
from ckrun.scheduler.k8s import K8sScheduler, Options  # noqa: E402
from k8s_stub_api import StubApi  # noqa: E402


@pytest.fixture
def stub() -> Iterator[StubApi]:
    with StubApi() as s:
        yield s


def _sched(stub: StubApi, tmp_path: Path, **kw: Any) -> K8sScheduler:
    kubeconfig = stub.write_kubeconfig(tmp_path / "kubeconfig")
    return K8sScheduler(Options(image="img:1", kubeconfig=str(kubeconfig), **kw))


def _spec(run: str = "demo", **kw: Any) -> JobSpec:
    return JobSpec(run=run, command=("python", "train.py"), storage="s3://b/runs", **kw)


def _pod(
    name: str, phase: str, created: str, exit_code: int | None = None, disrupted: bool = False
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [
            {"name": "ckrun", "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}
        ]
    if disrupted:
        status["conditions"] = [
            {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
        ]
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"nodeName": "spot-node-1"},
        "status": status,
    }


def test_submit_sends_exactly_the_rendered_job(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path, namespace="ml")
    job_id = sched.submit(_spec())
    assert job_id == "ml/demo"
    (req,) = stub.requests
    assert (req["method"], req["path"]) == ("POST", "/apis/batch/v1/namespaces/ml/jobs")
    assert req["authorization"] == "Bearer stub-token"  # the kubeconfig was used
    # the client's serialization loses or renames nothing of the manifest
    assert req["body"] == sched.manifest(_spec())


def test_submit_twice_is_a_clear_409(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path)
    sched.submit(_spec())
    with pytest.raises(SchedulerError) as err:
        sched.submit(_spec())
    msg = str(err.value)
    assert "already exists in namespace 'default'" in msg
    assert "`ckrun cancel demo --storage s3://b/runs`" in msg and "another --run name" in msg


def test_status_follows_job_and_pods(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path)
    job_id = sched.submit(_spec())
    assert sched.status(job_id) == JobState.PENDING  # no pod yet
    stub.set_pods("default", "demo", [_pod("demo-0-aaaaa", "Running", "2026-11-29T08:00:00Z")])
    assert sched.status("demo") == JobState.RUNNING  # bare name: the options' namespace
    stub.set_pods(
        "default", "demo", [_pod("demo-0-aaaaa", "Running", "2026-11-29T08:00:00Z", disrupted=True)]
    )
    assert sched.status(job_id) == JobState.PREEMPTED  # draining within the grace period
    stub.set_pods(
        "default",
        "demo",
        [_pod("demo-0-aaaaa", "Failed", "2026-11-29T08:00:00Z", exit_code=75, disrupted=True)],
    )
    assert sched.status(job_id) == JobState.REQUEUED
    stub.set_pods(
        "default",
        "demo",
        [
            _pod("demo-0-bbbbb", "Pending", "2026-11-29T08:05:00Z"),
            _pod("demo-0-aaaaa", "Failed", "2026-11-29T08:00:00Z", exit_code=75),
        ],
    )
    assert sched.status(job_id) == JobState.PENDING  # the newest pod decides
    info = sched.describe(job_id)
    assert [(p["name"], p["phase"], p["exit_code"]) for p in info["pods"]] == [
        ("demo-0-aaaaa", "Failed", 75),
        ("demo-0-bbbbb", "Pending", None),
    ]
    stub.patch_job(
        "default",
        "demo",
        {
            "failed": 1,
            "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}],
        },
    )
    assert sched.status(job_id) == JobState.FAILED
    assert sched.describe(job_id)["conditions"] == ["Failed: PodFailurePolicy"]
    stub.patch_job(
        "default", "demo", {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    )
    assert sched.status(job_id) == JobState.COMPLETED


def test_cancel_deletes_and_is_idempotent(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path)
    job_id = sched.submit(_spec())
    sched.cancel(job_id)
    delete = stub.requests[-1]
    assert (delete["method"], delete["path"]) == (
        "DELETE",
        "/apis/batch/v1/namespaces/default/jobs/demo",
    )
    assert delete["query"].get("propagationPolicy") == ["Foreground"] or (
        (delete["body"] or {}).get("propagationPolicy") == "Foreground"
    )
    assert sched.status(job_id) == JobState.UNKNOWN  # 404 after delete
    assert sched.describe(job_id)["found"] is False
    sched.cancel(job_id)  # 404: fine
    assert stub.requests[-1]["method"] == "DELETE"
    sched.submit(_spec())  # the name is free again


def test_forbidden_names_rbac(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path, namespace="forbidden")
    with pytest.raises(SchedulerError, match=r"403 .*k8s/rbac.yaml"):
        sched.submit(_spec())


def test_unreachable_server(tmp_path: Path) -> None:
    with StubApi() as dead:
        path = dead.write_kubeconfig(tmp_path / "kubeconfig")
    sched = K8sScheduler(Options(image="img:1", kubeconfig=str(path)))
    with pytest.raises(SchedulerError, match="unreachable"):
        sched.status("default/demo")


def test_no_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SchedulerError, match="no Kubernetes configuration"):
        K8sScheduler(Options(image="i")).status("demo")


def _verb(req: dict[str, Any]) -> tuple[str, str, str]:
    """(apiGroup, resource, verb) of one recorded request, as RBAC sees it."""
    parts = req["path"].strip("/").split("/")
    group = parts[1] if parts[0] == "apis" else ""
    resource = parts[5] if group else parts[4]
    named = len(parts) == (7 if group else 6)
    verb = {"POST": "create", "DELETE": "delete"}.get(req["method"], "get" if named else "list")
    return group, resource, verb


def test_rbac_example_allows_every_call(stub: StubApi, tmp_path: Path) -> None:
    """Every request of a submit/status/cancel cycle is allowed by k8s/rbac.yaml's Role."""
    import yaml

    docs = list(
        yaml.safe_load_all((Path(__file__).resolve().parents[2] / "k8s" / "rbac.yaml").read_text())
    )
    (role,) = [d for d in docs if d["kind"] == "Role"]
    allowed = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    sched = _sched(stub, tmp_path)
    job_id = sched.submit(_spec())
    sched.status(job_id)
    sched.cancel(job_id)
    used = {_verb(r) for r in stub.requests}
    assert used == {
        ("batch", "jobs", "create"),
        ("batch", "jobs", "get"),
        ("", "pods", "list"),
        ("batch", "jobs", "delete"),
    }
    assert used <= allowed


# -- multi-node runs (--nnodes N): the Indexed Job + its Service, or a JobSet ------------


def _group_pod(name: str, index: int, phase: str, created: str, **kw: Any) -> dict[str, Any]:
    pod = _pod(name, phase, created, **kw)
    pod["metadata"]["annotations"] = {"batch.kubernetes.io/job-completion-index": str(index)}
    return pod


def test_group_submit_creates_the_job_then_its_owned_service(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path, namespace="ml")
    spec = _spec("grp", nnodes=2, nproc_per_node=4)
    assert sched.submit(spec) == "ml/grp"
    job_req, svc_req = stub.requests
    assert (job_req["method"], job_req["path"]) == ("POST", "/apis/batch/v1/namespaces/ml/jobs")
    assert (svc_req["method"], svc_req["path"]) == ("POST", "/api/v1/namespaces/ml/services")
    svc, job = sched.manifests(spec)
    assert job_req["body"] == job  # exactly the rendered documents
    owner = svc_req["body"]["metadata"].pop("ownerReferences")
    assert svc_req["body"] == svc
    assert owner == [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "grp",
            "uid": stub.jobs[("ml", "grp")]["metadata"]["uid"],
        }
    ]


def test_group_status_combines_the_indexes(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path)
    job_id = sched.submit(_spec("grp", nnodes=2))
    t0, t1 = "2026-11-29T08:00:00Z", "2026-11-29T08:05:00Z"
    stub.set_pods("default", "grp", [_group_pod("grp-0-a", 0, "Running", t0)])
    assert sched.status(job_id) == JobState.PENDING  # index 1 has no pod yet
    stub.set_pods(
        "default",
        "grp",
        [_group_pod("grp-0-a", 0, "Running", t0), _group_pod("grp-1-a", 1, "Running", t0)],
    )
    assert sched.status(job_id) == JobState.RUNNING
    stub.set_pods(
        "default",
        "grp",
        [
            _group_pod("grp-0-a", 0, "Running", t0),
            _group_pod("grp-1-a", 1, "Running", t0, disrupted=True),
        ],
    )
    assert sched.status(job_id) == JobState.PREEMPTED  # one pod draining: the group is
    stub.set_pods(
        "default",
        "grp",
        [
            _group_pod("grp-0-a", 0, "Failed", t0, exit_code=75),
            _group_pod("grp-1-a", 1, "Failed", t0, exit_code=75, disrupted=True),
            _group_pod("grp-0-b", 0, "Running", t1),
        ],
    )
    assert sched.status(job_id) == JobState.REQUEUED  # index 1's replacement is not there yet
    info = sched.describe(job_id)
    assert [(p["name"], p["index"], p["exit_code"]) for p in info["pods"]] == [
        ("grp-0-a", "0", 75),
        ("grp-1-a", "1", 75),
        ("grp-0-b", "0", None),
    ]
    stub.set_pods(
        "default",
        "grp",
        [_group_pod("grp-0-b", 0, "Succeeded", t1), _group_pod("grp-1-b", 1, "Running", t1)],
    )
    assert sched.status(job_id) == JobState.RUNNING


def test_group_cancel_deletes_the_job_and_so_its_service(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path)
    job_id = sched.submit(_spec("grp", nnodes=2))
    assert ("default", "grp") in stub.services
    sched.cancel(job_id)
    assert [(r["method"], r["path"]) for r in stub.requests[-1:]] == [
        ("DELETE", "/apis/batch/v1/namespaces/default/jobs/grp")
    ]
    assert stub.services == {} and stub.jobs == {}  # the Service went with its owner
    assert sched.status(job_id) == JobState.UNKNOWN
    sched.submit(_spec("grp", nnodes=2))  # both names are free again


def test_group_service_conflict_rolls_the_job_back(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path)
    stub.services[("default", "grp")] = {"metadata": {"name": "grp", "uid": "x"}}
    with pytest.raises(SchedulerError, match="Service named 'grp' already exists"):
        sched.submit(_spec("grp", nnodes=2))
    assert stub.jobs == {}  # no Job left without its Service


def test_jobset_submit_status_cancel(stub: StubApi, tmp_path: Path) -> None:
    sched = _sched(stub, tmp_path, namespace="ml", k8s_kind="jobset")
    spec = _spec("grp", nnodes=2)
    job_id = sched.submit(spec)
    assert job_id == "ml/jobset/grp"
    (req,) = stub.requests
    assert (req["method"], req["path"]) == (
        "POST",
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets",
    )
    assert req["body"] == sched.manifest(spec)
    with pytest.raises(SchedulerError, match="`ckrun cancel grp --storage s3://b/runs`"):
        sched.submit(spec)
    label = "jobset.sigs.k8s.io/jobset-name"
    t0 = "2026-11-29T08:00:00Z"
    stub.set_pods(
        "ml",
        "grp",
        [
            _group_pod("grp-node-0-0-a", 0, "Running", t0),
            _group_pod("grp-node-0-1-a", 1, "Running", t0),
        ],
        label=label,
    )
    assert sched.status(job_id) == JobState.RUNNING
    assert stub.requests[-1]["query"]["labelSelector"] == [f"{label}=grp"]
    stub.jobsets[("ml", "grp")]["status"] = {
        "conditions": [{"type": "Completed", "status": "True"}]
    }
    assert sched.status(job_id) == JobState.COMPLETED
    sched.cancel(job_id)
    assert (stub.requests[-1]["method"], stub.requests[-1]["path"]) == (
        "DELETE",
        "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets/grp",
    )
    assert sched.status(job_id) == JobState.UNKNOWN
    sched.cancel(job_id)  # idempotent


def test_jobset_not_installed_says_so(stub: StubApi, tmp_path: Path) -> None:
    stub.jobset_installed = False
    sched = _sched(stub, tmp_path, k8s_kind="jobset")
    with pytest.raises(SchedulerError, match="install JobSet v0.10"):
        sched.submit(_spec("grp", nnodes=2))


def test_rbac_example_allows_every_group_call(stub: StubApi, tmp_path: Path) -> None:
    """The multi-node cycles (Job + Service, JobSet) are allowed by k8s/rbac.yaml too."""
    import yaml

    docs = yaml.safe_load_all(
        (Path(__file__).resolve().parents[2] / "k8s" / "rbac.yaml").read_text()
    )
    (role,) = [d for d in docs if d["kind"] == "Role"]
    allowed = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    for kind in ("job", "jobset"):
        sched = _sched(stub, tmp_path, k8s_kind=kind)
        job_id = sched.submit(_spec("grp", nnodes=2))
        sched.status(job_id)
        sched.cancel(job_id)
    used = {_verb(r) for r in stub.requests}
    assert ("", "services", "create") in used and ("jobset.x-k8s.io", "jobsets", "delete") in used
    assert used <= allowed, used - allowed
