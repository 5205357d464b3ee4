"""Kubernetes API calls of the k8s backend, through the official ``kubernetes`` client.

The client is imported lazily (``pip install 'ckrun[k8s]'``) and configured from, in
order: ``Options.kubeconfig``, ``$KUBECONFIG`` / ``~/.kube/config`` (with
``Options.context``), or the in-cluster service account when ``KUBERNETES_SERVICE_HOST``
is set and no kubeconfig exists.  Credentials are never part of ckrun's config.

Reads ask for the raw JSON (``_preload_content=False``) so the state mapping works on the
wire format (camelCase) and tolerates fields newer than the client.  API errors are
mapped at this boundary onto :class:`~ckrun.errors.SchedulerError` with a message that
names the fix, chained with ``from``.

REST paths used (Kubernetes API reference, batch/v1 Job, core/v1 Pod and Service, and
the JobSet CRD):
``POST /apis/batch/v1/namespaces/{ns}/jobs``, ``GET|DELETE .../jobs/{name}``,
``GET /api/v1/namespaces/{ns}/pods?labelSelector=batch.kubernetes.io/job-name={name}``;
multi-node: ``POST /api/v1/namespaces/{ns}/services`` (owned by the Job, so deleting
the Job deletes it), ``POST|GET|DELETE /apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/
jobsets[/{name}]`` and pods by ``jobset.sigs.k8s.io/jobset-name={name}``.
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

from ckrun.errors import SchedulerError
from ckrun.scheduler.k8s_state import describe, exit_code, group_state, job_state, pod_state

#: Seconds one API call may take (connect, read).
REQUEST_TIMEOUT_S = (10.0, 30.0)
__all__ = [
    "ApiHandle",
    "JOBSET_NAME_LABEL",
    "REQUEST_TIMEOUT_S",
    "create_job",
    "create_job_uid",
    "create_jobset",
    "create_service",
    "delete_job",
    "delete_jobset",
    "list_pods",
    "map_api_error",
    "read_job",
    "read_jobset",
    # the state mapping (pure, in k8s_state), re-exported for this module's callers
    "describe",
    "exit_code",
    "group_state",
    "job_state",
    "pod_state",
]

_JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
#: JobSet's label on its pods.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
_JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")


class ApiHandle:
    """A configured ``ApiClient`` with the two API groups ckrun uses.

    Args:
        kubeconfig: kubeconfig path; empty: the client's defaults.
        context: kubeconfig context; empty: the current one.

    Raises:
        SchedulerError: the ``kubernetes`` package is missing or no configuration is found.
    """

    def __init__(self, kubeconfig: str = "", context: str = "") -> None:
        try:
            from kubernetes import client, config
        except ImportError as exc:
            raise SchedulerError(
                "the k8s backend needs the kubernetes client: pip install 'ckrun[k8s]'"
            ) from exc
        cfg = client.Configuration()
        path = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
        path = os.path.expanduser(path or "~/.kube/config")
        try:
            if os.path.exists(path) or kubeconfig:
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=path,
                    context=context or None,
                    client_configuration=cfg,
                    persist_config=False,
                )
            elif os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
            else:
                raise config.ConfigException(f"{path} does not exist")
        except config.ConfigException as exc:
            raise SchedulerError(
                f"no Kubernetes configuration: {exc}; set KUBECONFIG (or kubeconfig: in "
                "the profile) or run inside a pod with a service account (k8s/rbac.yaml)"
            ) from exc
        self.host: str = str(cfg.host)
        self.client: Any = client.ApiClient(cfg)
        self.batch: Any = client.BatchV1Api(self.client)
        self.core: Any = client.CoreV1Api(self.client)
        self.custom: Any = client.CustomObjectsApi(self.client)
        import urllib3

        #: what a failed call raises: API errors (``.status``) and transport errors.
        self.errors: tuple[type[BaseException], ...] = (
            client.exceptions.ApiException,
            urllib3.exceptions.HTTPError,
            OSError,
        )

    def close(self) -> None:
        """Release the connection pool."""
        self.client.close()


def map_api_error(exc: BaseException, *, what: str, host: str) -> SchedulerError:
    """Map a client exception onto a :class:`SchedulerError` naming the fix.

    Args:
        exc: an ``ApiException`` (has ``.status``) or a urllib3 connection error.
        what: the operation, e.g. ``"create Job ns/name"``.
        host: the API server URL.
    """
    status = getattr(exc, "status", None)
    if status is None or status == 0:
        return SchedulerError(
            f"cannot {what}: the Kubernetes API server at {host} is unreachable ({exc}); "
            "check the kubeconfig context and the network"
        )
    reason = _status_message(exc)
    if status in (401, 403):
        return SchedulerError(
            f"cannot {what}: {status} {reason}; the user or service account needs "
            "create/get/list/delete on jobs.batch and get/list on pods in that namespace "
            "(see k8s/rbac.yaml)"
        )
    return SchedulerError(f"cannot {what}: HTTP {status} {reason}")


def _status_message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    try:
        return str(json.loads(body)["message"]) if body else str(getattr(exc, "reason", ""))
    except (ValueError, KeyError, TypeError):
        return str(getattr(exc, "reason", "") or body)


def _is_status(exc: BaseException, code: int) -> bool:
    return getattr(exc, "status", None) == code


def _exists_error(doc: dict[str, Any], storage: str | None) -> SchedulerError:
    """The 409 of a create: the run was submitted before; the message names a working
    ``ckrun cancel`` (it takes the run name and ``--storage``, never ``ns/name``)."""
    meta = doc["metadata"]
    ns, name, kind = meta["namespace"], meta["name"], doc.get("kind", "Job")
    run = str(meta.get("annotations", {}).get("ckrun/run", name))
    cancel = shlex.join(["ckrun", "cancel", run, "--storage", storage or "STORAGE"])
    where = "" if storage else " (STORAGE: the --storage it was submitted with)"
    return SchedulerError(
        f"a {kind} named {name!r} already exists in namespace {ns!r}: run {run!r} was "
        "submitted before.  It requeues itself after a preemption, so there is nothing to "
        f"resubmit; to start it again: `{cancel}`{where} (or `kubectl delete "
        f"{kind.lower()} {name} -n {ns}`) and submit again, or choose another --run name"
    )


def create_job(api: ApiHandle, doc: dict[str, Any], *, storage: str | None = None) -> str:
    """Create the Job ``doc``; return ``"namespace/name"``.

    Raises:
        SchedulerError: 409 (a Job of that name exists; the message says how to resume
            or start over), 401/403 (RBAC), unreachable server, or any other API error.
    """
    return create_job_uid(api, doc, storage=storage)[0]


def create_job_uid(
    api: ApiHandle, doc: dict[str, Any], *, storage: str | None = None
) -> tuple[str, str]:
    """:func:`create_job`, also returning the created Job's ``metadata.uid``; ``storage``
    (the run's storage base) goes into the 409 message's ``ckrun cancel`` command."""
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    try:  # a plain dict: every client version serializes it as it is
        created = api.batch.create_namespaced_job(ns, doc, _request_timeout=REQUEST_TIMEOUT_S)
    except api.errors as exc:
        if _is_status(exc, 409):
            raise _exists_error(doc, storage) from exc
        raise map_api_error(exc, what=f"create Job {ns}/{name}", host=api.host) from exc
    uid = getattr(getattr(created, "metadata", None), "uid", None) or ""
    return f"{ns}/{name}", str(uid)


def create_service(api: ApiHandle, doc: dict[str, Any], owner_uid: str) -> None:
    """Create the headless Service ``doc``, owned by the Job of the same name.

    The owner reference (the Job's ``uid``) makes the garbage collector delete the
    Service with the Job (cancel, ``ttlSecondsAfterFinished``).

    Raises:
        SchedulerError: any API error (409: a Service of that name exists).
    """
    meta = doc["metadata"]
    ns, name = meta["namespace"], meta["name"]
    body = dict(doc, metadata=dict(meta))
    if owner_uid:
        body["metadata"]["ownerReferences"] = [
            {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": owner_uid}
        ]
    try:
        api.core.create_namespaced_service(ns, body, _request_timeout=REQUEST_TIMEOUT_S)
    except api.errors as exc:
        if _is_status(exc, 409):
            raise SchedulerError(
                f"a Service named {name!r} already exists in namespace {ns!r} (left by an "
                f"earlier `kubectl create` of this run?): kubectl delete service {name} "
                f"-n {ns}, then submit again"
            ) from exc
        raise map_api_error(exc, what=f"create Service {ns}/{name}", host=api.host) from exc


def create_jobset(api: ApiHandle, doc: dict[str, Any], *, storage: str | None = None) -> str:
    """Create the JobSet ``doc``; return ``"namespace/jobset/name"`` (``storage``: as for
    :func:`create_job_uid`).

    Raises:
        SchedulerError: 409, 404 (JobSet is not installed: the message says so), RBAC,
            unreachable server, or any other API error.
    """
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    group, version, plural = _JOBSET
    try:
        api.custom.create_namespaced_custom_object(
            group, version, ns, plural, doc, _request_timeout=REQUEST_TIMEOUT_S
        )
    except api.errors as exc:
        if _is_status(exc, 409):
            raise _exists_error(doc, storage) from exc
        if _is_status(exc, 404):
            raise SchedulerError(
                f"cannot create JobSet {ns}/{name}: the cluster has no {group}/{version} "
                "API; install JobSet v0.10+ (https://jobset.sigs.k8s.io) or drop "
                "k8s_kind=jobset (an Indexed Job and a headless Service need nothing extra)"
            ) from exc
        raise map_api_error(exc, what=f"create JobSet {ns}/{name}", host=api.host) from exc
    return f"{ns}/jobset/{name}"


def read_jobset(api: ApiHandle, ns: str, name: str) -> dict[str, Any] | None:
    """The JobSet as wire JSON, or None when it does not exist (404)."""
    group, version, plural = _JOBSET
    try:
        resp = api.custom.get_namespaced_custom_object(
            group, version, ns, plural, name, _request_timeout=REQUEST_TIMEOUT_S
        )
    except api.errors as exc:
        if _is_status(exc, 404):
            return None
        raise map_api_error(exc, what=f"read JobSet {ns}/{name}", host=api.host) from exc
    return dict(resp)


def delete_jobset(api: ApiHandle, ns: str, name: str) -> bool:
    """Delete the JobSet, its Jobs, Service and pods (foreground); idempotent.

    Returns:
        True when a JobSet was deleted, False when none existed (404).
    """
    group, version, plural = _JOBSET
    try:
        api.custom.delete_namespaced_custom_object(
            group,
            version,
            ns,
            plural,
            name,
            propagation_policy="Foreground",
            _request_timeout=REQUEST_TIMEOUT_S,
        )
    except api.errors as exc:
        if _is_status(exc, 404):
            return False
        raise map_api_error(exc, what=f"delete JobSet {ns}/{name}", host=api.host) from exc
    return True


def read_job(api: ApiHandle, ns: str, name: str) -> dict[str, Any] | None:
    """The Job as wire JSON, or None when it does not exist (404)."""
    try:
        resp = api.batch.read_namespaced_job(
            name, ns, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
        )
    except api.errors as exc:
        if _is_status(exc, 404):
            return None
        raise map_api_error(exc, what=f"read Job {ns}/{name}", host=api.host) from exc
    job: dict[str, Any] = json.loads(resp.data)
    return job


def list_pods(
    api: ApiHandle, ns: str, name: str, label: str = _JOB_NAME_LABEL
) -> list[dict[str, Any]]:
    """The pods labelled ``label=name`` (default: the Job's pods) as wire JSON, oldest first."""
    try:
        resp = api.core.list_namespaced_pod(
            ns,
            label_selector=f"{label}={name}",
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
    except api.errors as exc:
        raise map_api_error(exc, what=f"list pods of Job {ns}/{name}", host=api.host) from exc
    items: list[dict[str, Any]] = json.loads(resp.data).get("items") or []
    return sorted(items, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "")


def delete_job(api: ApiHandle, ns: str, name: str) -> bool:
    """Delete the Job and its pods (foreground propagation); idempotent.

    Returns:
        True when a Job was deleted, False when none existed (404).
    """
    try:
        api.batch.delete_namespaced_job(
            name, ns, propagation_policy="Foreground", _request_timeout=REQUEST_TIMEOUT_S
        )
    except api.errors as exc:
        if _is_status(exc, 404):
            return False
        raise map_api_error(exc, what=f"delete Job {ns}/{name}", host=api.host) from exc
    return True
