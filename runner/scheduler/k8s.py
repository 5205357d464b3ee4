"""Kubernetes backend (DESIGN.md §3 "Scheduler", §6 "Kubernetes"; ``k8s/README.md``).

Requeue here is the Job controller's work: ckrun runs as the container's PID 1
(exec-form ``command``), checkpoints on the kubelet's SIGTERM within
``terminationGracePeriodSeconds`` and exits 75/76; the Job's ``podFailurePolicy``
Ignores those exit codes and the ``DisruptionTarget`` pod condition, so the controller
creates a new pod without counting a failure.  :meth:`K8sScheduler.requeue` therefore
makes no API call.

* rendering (pure, golden-tested): :mod:`ckrun.scheduler.k8s_manifest`; a multi-node run
  (``--nnodes N``) is an Indexed Job of N pods plus a headless Service, or a JobSet
  (``k8s_kind: jobset``): :mod:`ckrun.scheduler.k8s_group` says how the group restarts;
* API calls (official ``kubernetes`` client, imported lazily): :mod:`ckrun.scheduler.k8s_api`;
* :meth:`K8sScheduler.current` reads the Downward API environment the rendered Job sets
  (``CKRUN_K8S_*``), falling back to ``KUBERNETES_SERVICE_HOST`` + ``HOSTNAME``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from ckrun.errors import ConfigError, SchedulerError
from ckrun.notices import NoticeSource
from ckrun.scheduler.base import JobInfo, JobSpec, JobState, RequeueOutcome
from ckrun.scheduler.k8s_group import documents
from ckrun.scheduler.k8s_manifest import (
    JOB_NAME_LABEL,
    MIN_KUBERNETES_VERSION,
    REQUEUE_EXIT_CODES,
    job_name,
    manifest,
    render_yaml,
)
from ckrun.scheduler.k8s_options import Options

__all__ = ["K8sScheduler", "Options", "MIN_KUBERNETES_VERSION", "job_name", "manifest"]

log = logging.getLogger(__name__)


class K8sScheduler:
    """The ``k8s`` backend: a ``batch/v1`` Job per run, requeued by ``podFailurePolicy``.

    Args:
        options: backend options; ``spec.options`` wins in :meth:`render`/:meth:`submit`.
        api: a prepared :class:`ckrun.scheduler.k8s_api.ApiHandle` (tests); by default
            one is built from ``options.kubeconfig``/``context`` on first use.

    Job ids are ``"NAMESPACE/NAME"`` (a Job; a bare ``NAME`` means
    ``options.namespace``) or ``"NAMESPACE/jobset/NAME"`` (a JobSet).
    """

    name = "k8s"

    def __init__(self, options: Options | None = None, api: Any = None) -> None:
        self.options = options or Options()
        self._api = api

    # -- rendering ------------------------------------------------------------------
    def _opts(self, spec: JobSpec) -> Options:
        opts = spec.options if spec.options is not None else self.options
        if not isinstance(opts, Options):
            raise ConfigError(f"k8s needs ckrun.scheduler.k8s.Options, got {type(opts).__name__}")
        return opts

    def manifest(self, spec: JobSpec) -> dict[str, Any]:
        """The workload for ``spec`` as wire JSON: the Job (one pod, or the Indexed Job of
        a multi-node run) or the JobSet (see :func:`k8s_manifest.manifest`)."""
        return self.manifests(spec)[-1]

    def manifests(self, spec: JobSpec) -> list[dict[str, Any]]:
        """Every document ``submit`` creates, in order: ``[Job]``, ``[Service, Job]``
        (``--nnodes N`` > 1) or ``[JobSet]`` (``k8s_kind: jobset``); see
        :func:`ckrun.scheduler.k8s_group.documents`."""
        opts = self._opts(spec)
        return documents(manifest(spec, opts), spec, opts)

    def render(self, spec: JobSpec) -> str:
        """The exact YAML ``submit`` would create (a stream of :meth:`manifests`); no side
        effects.

        Raises:
            ConfigError: no image, local-path storage, a grace period shorter than
                the measured save time plus margin, or a pod name over 63 characters.
        """
        text: str = render_yaml(self.manifests(spec), spec.run)
        return text

    # -- API ------------------------------------------------------------------------
    def api(self) -> Any:
        """The API handle, built on first use (imports ``kubernetes``)."""
        if self._api is None:
            from ckrun.scheduler.k8s_api import ApiHandle

            self._api = ApiHandle(self.options.kubeconfig, self.options.context)
        return self._api

    def _ref(self, job_id: str) -> tuple[str, str, str]:
        """``(namespace, kind, name)`` of ``job_id``; kind is ``job`` or ``jobset``."""
        parts = job_id.split("/")
        if len(parts) == 3 and parts[1] == "jobset":
            ns, kind, name = parts
        elif len(parts) == 2:
            (ns, name), kind = parts, "job"
        elif len(parts) == 1:
            ns, kind, name = self.options.namespace, "job", parts[0]
        else:
            ns, kind, name = "", "job", ""
        if not ns or not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", name or "-"):
            raise ConfigError(
                f"job id {job_id!r}: write NAMESPACE/NAME or NAME (a Job), or "
                "NAMESPACE/jobset/NAME (a JobSet)"
            )
        return ns, kind, name

    def submit(self, spec: JobSpec) -> str:
        """Create the run's documents (:meth:`manifests`); return the job id.

        A multi-node Job is created first, then its headless Service owned by it (so
        the Service goes with the Job); when the Service cannot be created the Job is
        deleted again and the error raised.

        Raises:
            ConfigError: see :meth:`render`.
            SchedulerError: a Job (JobSet) of that name exists (409: the message says how
                to resume or start over), RBAC denies it, JobSet is not installed, or the
                server is unreachable.
        """
        from ckrun.scheduler import k8s_api

        docs = self.manifests(spec)
        api = self.api()
        if docs[-1]["kind"] == "JobSet":
            job_id = k8s_api.create_jobset(api, docs[-1], storage=spec.storage_base)
            log.info("created JobSet %s (failurePolicy restarts the group)", job_id)
            return job_id
        job_id, uid = k8s_api.create_job_uid(api, docs[-1], storage=spec.storage_base)
        for doc in docs[:-1]:
            try:
                k8s_api.create_service(api, doc, uid)
            except SchedulerError:
                ns, _, name = self._ref(job_id)
                k8s_api.delete_job(api, ns, name)
                raise
        log.info("created Job %s (podFailurePolicy requeues on exit 75/76)", job_id)
        return job_id

    def describe(self, job_id: str) -> dict[str, Any]:
        """Job (JobSet) counters and conditions and each pod's phase and exit code
        (``ckrun status``).

        Returns:
            see :func:`ckrun.scheduler.k8s_api.describe`, plus ``"job_id"``.
        """
        from ckrun.scheduler import k8s_api

        ns, kind, name = self._ref(job_id)
        api = self.api()
        if kind == "jobset":
            job = k8s_api.read_jobset(api, ns, name)
            label = k8s_api.JOBSET_NAME_LABEL
            ref = f"{ns}/jobset/{name}"
        else:
            job = k8s_api.read_job(api, ns, name)
            label, ref = JOB_NAME_LABEL, f"{ns}/{name}"
        pods = k8s_api.list_pods(api, ns, name, label) if job is not None else []
        return {"job_id": ref, **k8s_api.describe(job, pods, REQUEUE_EXIT_CODES)}

    def status(self, job_id: str) -> JobState:
        """The run's state; UNKNOWN when no such Job exists (deleted or never created)."""
        info = self.describe(job_id)
        if not info["found"]:
            log.warning(
                "no Job %s: cancelled, removed after ttlSecondsAfterFinished, or never submitted",
                info["job_id"],
            )
        return JobState(info["state"])

    def cancel(self, job_id: str) -> None:
        """Delete the Job (JobSet) and its pods; idempotent (a missing one is fine).

        The pods get SIGTERM, so a running ckrun still checkpoints; with the Job gone no
        replacement pod is created.  A multi-node Job's Service is owned by the Job and
        goes with it.
        """
        from ckrun.scheduler import k8s_api

        ns, kind, name = self._ref(job_id)
        delete = k8s_api.delete_jobset if kind == "jobset" else k8s_api.delete_job
        if not delete(self.api(), ns, name):
            log.info("%s %s/%s does not exist; nothing to cancel", kind, ns, name)

    # -- inside the pod -------------------------------------------------------------
    def current(self) -> JobInfo | None:
        """The Job this process runs in, from the environment (no API call).

        Sources: ``CKRUN_K8S_*`` (the rendered Job's Downward API env: job name,
        namespace, pod, node, the Job controller's failure-count annotations), else
        ``KUBERNETES_SERVICE_HOST`` + ``HOSTNAME`` (pod name ``<job>-<index>-<suffix>``
        or ``<job>-<suffix>``) and the service account's namespace file.

        Returns:
            None outside Kubernetes.  ``rank`` is ``JOB_COMPLETION_INDEX`` (the node
            rank of a multi-node run; 0 decides the run).  ``attempt`` is the number of
            earlier pods of this index: ``job-index-failure-count +
            job-index-ignored-failure-count``, or ``CKRUN_K8S_ATTEMPT`` when set (a
            JobSet's ``restart-attempt`` label); 0 when unknown.
        """
        return current_from_env(os.environ)

    def requeue(self, job: JobInfo) -> RequeueOutcome:
        """Nothing to call: the Job controller starts a new pod once ckrun exits 75/76.

        The same on every index of a multi-node run: no pod's supervisor requeues
        anything; every pod exits 75 and the Job (JobSet) controller replaces each
        (:mod:`ckrun.scheduler.k8s_group`)."""
        return RequeueOutcome.REQUEUED

    def notice_sources(self, job: JobInfo | None) -> list[NoticeSource]:
        """None: the notice is the kubelet's SIGTERM to PID 1 (the supervisor's signal
        source); its deadline is ``terminationGracePeriodSeconds`` (``JobInfo.detail``)."""
        return []


_SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return max(0, int(env.get(key, "") or 0))
    except ValueError:
        return 0


def _job_from_hostname(hostname: str, index: str | None) -> str:
    if index is not None and hostname.endswith(f"-{index}"):
        return hostname[: -len(index) - 1]  # Indexed Job: hostname is <job>-<index>
    if index is not None and re.search(rf"-{re.escape(index)}-[a-z0-9]{{5}}$", hostname):
        return re.sub(rf"-{re.escape(index)}-[a-z0-9]{{5}}$", "", hostname)
    return re.sub(r"-[a-z0-9]{5}$", "", hostname)  # NonIndexed: <job>-<5 chars>


def current_from_env(env: Mapping[str, str]) -> JobInfo | None:
    """:meth:`K8sScheduler.current` on an explicit environment (tests)."""
    name = env.get("CKRUN_K8S_JOB_NAME", "")
    if not name and not env.get("KUBERNETES_SERVICE_HOST"):
        return None
    index = env.get("JOB_COMPLETION_INDEX")
    pod = env.get("CKRUN_K8S_POD_NAME") or env.get("HOSTNAME", "")
    if not name:
        name = _job_from_hostname(env.get("HOSTNAME", ""), index)
    if not name:
        return None
    ns = env.get("CKRUN_K8S_NAMESPACE", "")
    if not ns:
        try:
            with open(_SA_NAMESPACE) as f:
                ns = f.read().strip()
        except OSError:
            ns = "default"
    if env.get("CKRUN_K8S_ATTEMPT"):
        attempt = _int_env(env, "CKRUN_K8S_ATTEMPT")
    else:
        attempt = _int_env(env, "CKRUN_K8S_FAILURE_COUNT") + _int_env(
            env, "CKRUN_K8S_IGNORED_FAILURE_COUNT"
        )
    detail: dict[str, Any] = {
        "namespace": ns,
        "pod": pod,
        "node": env.get("CKRUN_K8S_NODE_NAME", ""),
        "pod_uid": env.get("CKRUN_K8S_POD_UID", ""),
    }
    if env.get("CKRUN_K8S_TERMINATION_GRACE_S"):
        detail["termination_grace_period_s"] = _int_env(env, "CKRUN_K8S_TERMINATION_GRACE_S")
    rank = _int_env(env, "JOB_COMPLETION_INDEX")
    return JobInfo(backend="k8s", job_id=f"{ns}/{name}", attempt=attempt, rank=rank, detail=detail)
