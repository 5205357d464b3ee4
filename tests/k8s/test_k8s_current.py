"""K8sScheduler inside a pod: current() from the environment, requeue(), state mapping.

No cluster runs here: the environment a pod would get (the rendered Job's Downward API
variables, ``JOB_COMPLETION_INDEX``, ``HOSTNAME``) is written out by hand, and the
Job/pod objects fed to the state mapping are hand-written wire JSON.
"""

from __future__ import annotations

from typing import Any

import pytest
from ckrun.scheduler.base import JobInfo, JobState, RequeueOutcome, get_scheduler
from ckrun.scheduler.k8s import K8sScheduler, current_from_env
from ckrun.scheduler.k8s_api import job_state
from ckrun.scheduler.k8s_manifest import REQUEUE_EXIT_CODES


def test_outside_kubernetes() -> None:
    assert current_from_env({"HOSTNAME": "laptop"}) is None


def test_from_downward_api_env() -> None:
    env = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "HOSTNAME": "demo-0",
        "JOB_COMPLETION_INDEX": "0",
        "CKRUN_K8S_JOB_NAME": "demo",
        "CKRUN_K8S_NAMESPACE": "ml",
        "CKRUN_K8S_POD_NAME": "demo-0-x7k2p",
        "CKRUN_K8S_NODE_NAME": "spot-1",
        "CKRUN_K8S_POD_UID": "u-1",
        "CKRUN_K8S_FAILURE_COUNT": "1",
        "CKRUN_K8S_IGNORED_FAILURE_COUNT": "3",
        "CKRUN_K8S_TERMINATION_GRACE_S": "150",
    }
    info = current_from_env(env)
    assert info == JobInfo(
        backend="k8s",
        job_id="ml/demo",
        attempt=4,
        rank=0,
        detail={
            "namespace": "ml",
            "pod": "demo-0-x7k2p",
            "node": "spot-1",
            "pod_uid": "u-1",
            "termination_grace_period_s": 150,
        },
    )


def test_first_pod_has_no_annotations() -> None:
    """Absent annotations reach the Downward API env as empty strings: attempt 0."""
    info = current_from_env(
        {
            "CKRUN_K8S_JOB_NAME": "demo",
            "CKRUN_K8S_NAMESPACE": "d",
            "CKRUN_K8S_FAILURE_COUNT": "",
            "CKRUN_K8S_IGNORED_FAILURE_COUNT": "",
        }
    )
    assert info is not None and info.attempt == 0


def test_attempt_override() -> None:
    info = current_from_env(
        {
            "CKRUN_K8S_JOB_NAME": "j",
            "CKRUN_K8S_NAMESPACE": "d",
            "CKRUN_K8S_ATTEMPT": "7",
            "CKRUN_K8S_FAILURE_COUNT": "1",
        }
    )
    assert info is not None and info.attempt == 7


@pytest.mark.parametrize(
    ("hostname", "index", "job"),
    [
        ("demo-0", "0", "demo"),  # Indexed Job: hostname <job>-<index>
        ("my-job-0-abc12", "0", "my-job"),  # pod name with the index
        ("trainer-x9z2q", None, "trainer"),  # NonIndexed Job: <job>-<5 chars>
    ],
)
def test_hand_written_job_falls_back_to_hostname(
    hostname: str, index: str | None, job: str
) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": hostname, "CKRUN_K8S_NAMESPACE": "ns"}
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = index
    info = current_from_env(env)
    assert info is not None and info.job_id == f"ns/{job}" and info.attempt == 0


def test_requeue_is_the_job_controllers_work() -> None:
    class NoApi:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError("requeue must not call the API")

    sched = K8sScheduler(api=NoApi())
    assert sched.requeue(JobInfo(backend="k8s", job_id="d/j")) == RequeueOutcome.REQUEUED
    assert sched.notice_sources(None) == []
    assert get_scheduler("k8s").name == "k8s"


def _pod(phase: str, code: int | None = None, **kw: Any) -> dict[str, Any]:
    st: dict[str, Any] = {"phase": phase}
    if code is not None:
        st["containerStatuses"] = [{"name": "ckrun", "state": {"terminated": {"exitCode": code}}}]
    if kw.get("disrupted"):
        st["conditions"] = [{"type": "DisruptionTarget", "status": "True"}]
    meta = {"deletionTimestamp": "2026-11-29T08:00:00Z"} if kw.get("deleting") else {}
    return {"metadata": meta, "status": st}


def _job(*conds: tuple[str, str], deleting: bool = False) -> dict[str, Any]:
    meta = {"deletionTimestamp": "x"} if deleting else {}
    return {
        "metadata": meta,
        "status": {"conditions": [{"type": t, "status": "True", "reason": r} for t, r in conds]},
    }


@pytest.mark.parametrize(
    ("job", "pods", "state"),
    [
        (None, [], JobState.UNKNOWN),
        (_job(), [], JobState.PENDING),
        (_job(), [_pod("Pending")], JobState.PENDING),
        (_job(), [_pod("Running")], JobState.RUNNING),
        (_job(), [_pod("Running", deleting=True)], JobState.PREEMPTED),
        (_job(), [_pod("Running", disrupted=True)], JobState.PREEMPTED),
        (_job(), [_pod("Failed", 75)], JobState.REQUEUED),
        (_job(), [_pod("Failed", 76)], JobState.REQUEUED),
        (_job(), [_pod("Failed", 137, disrupted=True)], JobState.REQUEUED),
        (_job(), [_pod("Failed", 1)], JobState.PENDING),  # counted; retried after backoff
        (_job(), [_pod("Failed", 75), _pod("Running")], JobState.RUNNING),
        (_job(("Suspended", "")), [], JobState.PENDING),
        (_job(("Complete", "")), [_pod("Succeeded", 0)], JobState.COMPLETED),
        (_job(("SuccessCriteriaMet", "")), [_pod("Succeeded", 0)], JobState.COMPLETED),
        (_job(("Failed", "BackoffLimitExceeded")), [_pod("Failed", 1)], JobState.FAILED),
        (_job(("FailureTarget", "PodFailurePolicy")), [_pod("Failed", 4)], JobState.FAILED),
        (_job(("Failed", "DeadlineExceeded")), [_pod("Failed", 137)], JobState.TIMEOUT),
        (_job(deleting=True), [_pod("Running")], JobState.CANCELLED),
    ],
)
def test_job_state(job: dict[str, Any] | None, pods: list[dict[str, Any]], state: JobState) -> None:
    assert job_state(job, pods, REQUEUE_EXIT_CODES) == state
