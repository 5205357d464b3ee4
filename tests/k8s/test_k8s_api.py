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
    assert "ckrun cancel default/demo" in msg and "another --run name" in msg


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
