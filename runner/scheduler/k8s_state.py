"""What a Kubernetes Job (or JobSet) and its pods say about a run: wire JSON → JobState.

Pure functions over the raw API objects (camelCase wire format, as
:mod:`ckrun.scheduler.k8s_api` reads them), so the mapping tolerates fields newer than the
client and is tested without a server.  Sources: the Kubernetes API reference (Job and
Pod ``status.conditions``, ``containerStatuses``; the ``DisruptionTarget`` pod condition;
the Job controller's ``batch.kubernetes.io/job-completion-index`` annotation) and the
JobSet API (``Completed``/``Failed`` conditions, ``jobset.sigs.k8s.io/job-index`` label).
"""

from __future__ import annotations

from typing import Any

from ckrun.scheduler.base import JobState


def _true_conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    conds = (obj.get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in conds if c.get("status") == "True" and "type" in c}


def exit_code(pod: dict[str, Any], container: str = "ckrun") -> int | None:
    """Exit code of ``container`` in ``pod`` once it has terminated, else None."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container:
            term = (cs.get("state") or {}).get("terminated") or {}
            code = term.get("exitCode")
            return int(code) if code is not None else None
    return None


def pod_state(pod: dict[str, Any], requeue_codes: tuple[int, ...]) -> JobState:
    """What one pod says about the run (pods listed oldest first; the newest decides)."""
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    disrupted = "DisruptionTarget" in _true_conditions(pod)
    terminating = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
    if phase in ("Pending", "Running") and (disrupted or terminating):
        return JobState.PREEMPTED  # SIGTERM sent: checkpointing within the grace period
    if phase == "Running":
        return JobState.RUNNING
    if phase == "Succeeded":
        return JobState.COMPLETED
    if phase == "Failed":
        if disrupted or exit_code(pod) in requeue_codes:
            return JobState.REQUEUED  # podFailurePolicy Ignore: a new pod follows
        return JobState.PENDING  # a counted failure; the controller retries after backoff
    return JobState.PENDING


#: How one pod's state weighs in a group's (first wins): a draining pod means the group
#: is being preempted; a replaced or unscheduled index holds the whole group back.
_GROUP_ORDER = (
    JobState.PREEMPTED,
    JobState.REQUEUED,
    JobState.PENDING,
    JobState.RUNNING,
    JobState.COMPLETED,
)
_INDEX_KEYS = ("jobset.sigs.k8s.io/job-index", "batch.kubernetes.io/job-completion-index")


def _index(pod: dict[str, Any]) -> tuple[str, ...]:
    meta = pod.get("metadata") or {}
    tags = {**(meta.get("labels") or {}), **(meta.get("annotations") or {})}
    return tuple(str(tags.get(k, "")) for k in _INDEX_KEYS)


def _pod_count(job: dict[str, Any]) -> int:
    """Pods of one generation: a Job's ``completions``, a JobSet's sum over its Jobs."""
    spec = job.get("spec") or {}
    if "replicatedJobs" in spec:
        return sum(
            int(r.get("replicas", 1)) * int((r["template"].get("spec") or {}).get("completions", 1))
            for r in spec["replicatedJobs"]
        )
    return int(spec.get("completions") or 1)


def group_state(
    pods: list[dict[str, Any]], requeue_codes: tuple[int, ...], expected: int = 1
) -> JobState:
    """The state of a run's pods (oldest first): the newest pod of each index decides for
    its index (:func:`pod_state`), the indexes' states combine by :data:`_GROUP_ORDER`;
    fewer indexes than ``expected`` have a pod: PENDING at best.  One pod per run (one
    index) is the single-node case."""
    newest: dict[tuple[str, ...], dict[str, Any]] = {}
    for pod in pods:
        newest[_index(pod)] = pod
    states = {pod_state(p, requeue_codes) for p in newest.values()}
    if len(newest) < expected:
        states.add(JobState.PENDING)
    return next(s for s in _GROUP_ORDER if s in states)


def job_state(
    job: dict[str, Any] | None, pods: list[dict[str, Any]], requeue_codes: tuple[int, ...]
) -> JobState:
    """Map a Job or JobSet and its pods (wire JSON) onto a :class:`JobState`.

    Conditions decide once it has finished (``Complete``/``SuccessCriteriaMet``, JobSet
    ``Completed`` → COMPLETED; ``Failed``/``FailureTarget`` → FAILED, or TIMEOUT for
    ``DeadlineExceeded``); one being deleted is CANCELLED; otherwise the pods decide
    (:func:`group_state`).  A missing Job (None) is UNKNOWN.
    """
    if job is None:
        return JobState.UNKNOWN
    if (job.get("metadata") or {}).get("deletionTimestamp"):
        return JobState.CANCELLED
    conds = _true_conditions(job)
    if {"Complete", "Completed", "SuccessCriteriaMet"} & conds.keys():
        return JobState.COMPLETED
    for kind in ("Failed", "FailureTarget"):
        if kind in conds:
            deadline = conds[kind].get("reason") == "DeadlineExceeded"
            return JobState.TIMEOUT if deadline else JobState.FAILED
    if "Suspended" in conds or not pods:
        return JobState.PENDING
    return group_state(pods, requeue_codes, _pod_count(job))


def describe(
    job: dict[str, Any] | None, pods: list[dict[str, Any]], requeue_codes: tuple[int, ...]
) -> dict[str, Any]:
    """A JSON-ready summary for ``ckrun status``: Job counters and conditions, pod phases.

    Returns:
        ``{"found", "state", "active", "succeeded", "failed", "conditions": [..],
        "pods": [{"name", "phase", "exit_code", "reason", "node", "disrupted", "index"}]}``.
    """
    status = (job or {}).get("status") or {}
    out: dict[str, Any] = {
        "found": job is not None,
        "state": job_state(job, pods, requeue_codes).value,
        "active": status.get("active", 0),
        "succeeded": status.get("succeeded", 0),
        "failed": status.get("failed", 0),
        "conditions": [
            f"{t}: {c.get('reason', '')}".rstrip(": ")
            for t, c in _true_conditions(job or {}).items()
        ],
        "pods": [],
    }
    for pod in pods:
        pst = pod.get("status") or {}
        out["pods"].append(
            {
                "name": (pod.get("metadata") or {}).get("name", ""),
                "phase": pst.get("phase", "Pending"),
                "exit_code": exit_code(pod),
                "reason": pst.get("reason", ""),
                "node": (pod.get("spec") or {}).get("nodeName", ""),
                "disrupted": "DisruptionTarget" in _true_conditions(pod),
                "index": _index(pod)[-1],
            }
        )
    return out
