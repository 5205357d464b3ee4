"""Multi-node runs on Kubernetes (``--nnodes N`` > 1): one pod per node, restarted as a group.

Pure rendering, like :mod:`ckrun.scheduler.k8s_manifest` (whose single-pod Job it turns
into a group).  Two shapes, chosen by the ``k8s_kind`` profile key:

``job`` (default; any Kubernetes 1.29-1.37)
    an Indexed ``batch/v1`` Job (``completionMode: Indexed``, ``completions =
    parallelism = N``) plus a headless Service of the Job's name.  The Job controller
    names each pod's host ``<job>-<index>`` and, with the pod template's ``subdomain``
    set to the Service, every pod resolves ``<job>-<index>.<service>`` (Kubernetes docs,
    "Indexed Job for Parallel Processing with Pod-to-Pod Communication").
``jobset`` (JobSet v0.10+ installed)
    a ``jobset.x-k8s.io/v1alpha2`` JobSet with one replicated Job of N indexed pods;
    JobSet creates the headless Service itself (``network.enableDNSHostnames``), pods are
    ``<jobset>-node-0-<index>.<jobset>``.

In both, each pod runs ``ckrun run`` as PID 1; the supervisor starts torchrun with the
c10d rendezvous at index 0's stable name (``CKRUN_RDZV_ENDPOINT`` below;
:func:`ckrun.supervisor.torchrun.rendezvous_args`), node rank ``JOB_COMPLETION_INDEX``,
world size N x ``nproc_per_node``.

Which mechanism restarts the whole group (the gang) after a preemption
-----------------------------------------------------------------------
ckrun makes the group *stop* together: the preempted pod's supervisor gets the kubelet's
SIGTERM (``DisruptionTarget``), writes ``notice.json``; its ranks' flag reaches every rank
through ``preemption_requested(sync=True)`` (one all-reduce MAX: the agreed step, as
under Slurm), every rank saves that step in one collective commit, and each rank that
learnt of the notice only through the all-reduce leaves a peer notice
(:func:`ckrun.control.write_peer_notice`) so its own supervisor drains too.  Every
supervisor then finds the commit in storage and exits 75.  What Kubernetes must do is
start all N pods again:

* ``job``: ``podFailurePolicy`` *Ignore* on exit 75/76 and on ``DisruptionTarget``:
  every index whose pod failed that way gets a new pod, uncounted; since every pod exits
  75, every index is replaced, and ``podReplacementPolicy: Failed`` keeps the new
  generation from starting before the old pod of that index is gone.  This is the same
  on every version 1.29-1.37 (podFailurePolicy beta-on from 1.26 and GA in 1.31,
  podReplacementPolicy beta-on 1.29 and GA 1.34, backoffLimitPerIndex beta-on 1.29 and
  GA 1.33).  It is not a controller-side gang: a pod lost *without* a drain (node gone,
  SIGKILL) is replaced alone, and the survivors' collectives fail; their supervisors
  restart torchrun in place (a counted failure, ``max_failures``) and the group forms
  again at the rendezvous.  ``backoffLimitPerIndex`` (with ``maxFailedIndexes: 0``)
  bounds counted failures per index and fails the whole Job (every pod stopped) as soon
  as one index runs out; on its own it restarts one index, never the group.  The Job
  ``successPolicy`` (alpha 1.30, beta-on 1.31, GA 1.33) only declares success early;
  it restarts nothing and is absent from the 1.29 schema, so it is not used: every
  index ends with the same collective outcome and the Job completes with all N.
* ``jobset``: the child Job's ``podFailurePolicy`` turns exit 75/76 and
  ``DisruptionTarget`` into *FailJob*; JobSet's ``failurePolicy`` rule
  ``RestartJobSetAndIgnoreMaxRestarts`` (reason ``PodFailurePolicy``) then deletes and
  recreates every child Job (``restartStrategy: BlockingRecreate``: all old pods are
  gone before new ones start), uncounted.  Exit 3/4 fail the JobSet (a message-pattern
  rule, JobSet v0.10+); other failures (``backoffLimit: 0``) restart the group, counted
  against ``maxRestarts`` = ``backoff_limit``.  This is a true gang restart, also for a
  pod lost without a drain.

The simplest correct choice is ``job``: built-in on every supported version, and a
complete group restart because ckrun stops every pod at one agreed step.  ``jobset`` is
offered where the cluster has JobSet (``--set k8s_kind=jobset``).

Only index 0 decides the run's outcome: it hosts global rank 0 (c10d orders nodes by
their address and ``<name>-0.`` sorts first), which alone commits manifests and writes
``COMPLETE.json``; ``K8sScheduler.requeue`` makes no call on any index, and supervisors
of other indexes keep their own lock, control directory and event log
(:class:`ckrun.supervisor.rundir.RunDir` with ``rank``).
"""

from __future__ import annotations

import copy
from typing import Any

from ckrun.errors import ConfigError, ExitCode
from ckrun.scheduler.base import JobSpec
from ckrun.scheduler.k8s_options import Options

#: Pod env: ``HOST:PORT`` of the c10d rendezvous (index 0's stable name).
RDZV_ENDPOINT_ENV = "CKRUN_RDZV_ENDPOINT"
#: Pod env: the rendezvous id (the Job's or JobSet's name).
RDZV_ID_ENV = "CKRUN_RDZV_ID"
#: Pod env: seconds torchrun waits for every node (``join_timeout``).
RDZV_TIMEOUT_ENV = "CKRUN_RDZV_TIMEOUT_S"
#: JobSet API version and the replicated Job's name.
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "node"
#: JobSet's label on its pods counting the JobSet's restarts.
RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"
#: The oldest JobSet whose CRD has every field used (``onJobFailureMessagePatterns``).
MIN_JOBSET_VERSION = "v0.10.0"
_JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
#: Message of the Job controller's FailJob on an exit code (pkg/controller/job,
#: pod_failure_policy.go: "Container %s for pod %s/%s failed with exit code %v matching
#: %v rule at index %d").
_FAILJOB_EXIT_PATTERN = "failed with exit code ({codes}) matching FailJob rule"


def _check_hostnames(prefix: str, n: int) -> None:
    longest = f"{prefix}-{n - 1}"
    if len(longest) > 63:
        raise ConfigError(
            f"pod host name {longest!r} is longer than 63 characters (a DNS label): "
            "choose a shorter --run name"
        )


def _set_env(container: dict[str, Any], values: dict[str, str]) -> None:
    env = [e for e in container.get("env", []) if e["name"] not in values]
    container["env"] = env + [{"name": k, "value": v} for k, v in values.items()]


def _group_env(spec: JobSpec, opts: Options, host0: str, rdzv_id: str) -> dict[str, str]:
    return {
        "CKRUN_NNODES": str(spec.nnodes),
        "CKRUN_NPROC_PER_NODE": str(spec.nproc_per_node),
        RDZV_ENDPOINT_ENV: f"{host0}:{opts.rdzv_port}",
        RDZV_ID_ENV: rdzv_id,
        RDZV_TIMEOUT_ENV: str(opts.rdzv_timeout_s),
    }


def _ckrun_container(pod: dict[str, Any]) -> dict[str, Any]:
    from ckrun.scheduler.k8s_manifest import CONTAINER

    container: dict[str, Any] = next(c for c in pod["containers"] if c["name"] == CONTAINER)
    return container


def service(job: dict[str, Any], opts: Options) -> dict[str, Any]:
    """The headless Service giving the pods of ``job`` their stable names.

    ``clusterIP: None`` (DNS records per pod, no virtual IP), selecting the Job
    controller's ``batch.kubernetes.io/job-name`` label, ``publishNotReadyAddresses`` so
    a pod resolves as soon as it runs (the rendezvous starts before any readiness).
    ``ckrun submit`` sets the created Job as its owner, so it goes with the Job.
    """
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": dict(meta["labels"]),
            "annotations": dict(meta["annotations"]),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {_JOB_NAME_LABEL: meta["name"]},
            "ports": [{"name": "rdzv", "port": opts.rdzv_port, "targetPort": opts.rdzv_port}],
        },
    }


def indexed_job(job: dict[str, Any], spec: JobSpec, opts: Options) -> dict[str, Any]:
    """``job`` (the single-pod Job) as the group's Indexed Job of ``spec.nnodes`` pods.

    Raises:
        ConfigError: a pod host name would exceed 63 characters.
    """
    doc = copy.deepcopy(job)
    name, n = doc["metadata"]["name"], spec.nnodes
    _check_hostnames(name, n)
    js = doc["spec"]
    js["completions"] = js["parallelism"] = n
    # one gang failure fails every index once: the Job-wide limit is per index x N
    js["backoffLimit"] = opts.backoff_limit * n
    js["backoffLimitPerIndex"] = opts.backoff_limit
    js["maxFailedIndexes"] = 0  # an index out of retries fails the Job: no pod left
    pod = js["template"]["spec"]
    pod["subdomain"] = name
    _set_env(_ckrun_container(pod), _group_env(spec, opts, f"{name}-0.{name}", name))
    return doc


def jobset(job: dict[str, Any], spec: JobSpec, opts: Options) -> dict[str, Any]:
    """The group as a JobSet (module docstring); ``job`` is the single-pod Job.

    Raises:
        ConfigError: a pod host name would exceed 63 characters.
    """
    meta = job["metadata"]
    name, n = meta["name"], spec.nnodes
    prefix = f"{name}-{REPLICATED_JOB}-0"  # JobSet: <jobset>-<replicatedJob>-<jobIndex>
    _check_hostnames(prefix, n)
    js = copy.deepcopy(job["spec"])
    ttl = js.pop("ttlSecondsAfterFinished", None)
    for key in ("backoffLimitPerIndex", "maxFailedIndexes"):
        js.pop(key, None)
    js["completions"] = js["parallelism"] = n
    js["backoffLimit"] = 0  # any counted failure fails the Job: JobSet restarts the group
    requeue = [int(ExitCode.PREEMPTED), int(ExitCode.PREEMPTED_NO_CHECKPOINT)]
    for rule in js["podFailurePolicy"]["rules"]:
        codes = (rule.get("onExitCodes") or {}).get("values")
        if codes == requeue or rule.get("onPodConditions"):
            rule["action"] = "FailJob"  # the JobSet's failurePolicy restarts the group
    pod = js["template"]["spec"]
    container = _ckrun_container(pod)
    _set_env(container, _group_env(spec, opts, f"{prefix}-0.{name}", name))
    # the group's restarts (JobSet recreates the Jobs, so their failure counts restart)
    container["env"].append(
        {
            "name": "CKRUN_K8S_ATTEMPT",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{RESTART_LABEL}']"}},
        }
    )
    fail_codes = "|".join(str(int(c)) for c in (ExitCode.CONFIG_INVALID, ExitCode.INCOMPATIBLE))
    body: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "subdomain": name},
        "failurePolicy": {
            "maxRestarts": opts.backoff_limit,
            "restartStrategy": "BlockingRecreate",
            "rules": [
                {
                    "name": "ConfigOrIncompatible",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                    "onJobFailureMessagePatterns": [_FAILJOB_EXIT_PATTERN.format(codes=fail_codes)],
                },
                {
                    "name": "Preempted",
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                },
            ],
        },
        "replicatedJobs": [
            {
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": js},
            }
        ],
    }
    if ttl is not None:
        body["ttlSecondsAfterFinished"] = ttl
    annotations = dict(meta["annotations"], **{"ckrun/min-jobset-version": MIN_JOBSET_VERSION})
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {**meta, "annotations": annotations},
        "spec": body,
    }


def documents(job: dict[str, Any], spec: JobSpec, opts: Options) -> list[dict[str, Any]]:
    """Every document ``submit`` creates for ``spec``, in creation order.

    One node: ``[job]``.  Several: ``[Service, Indexed Job]`` (``k8s_kind: job``) or
    ``[JobSet]`` (``k8s_kind: jobset``).

    Raises:
        ConfigError: see :func:`indexed_job`; ``nnodes``/``nproc_per_node`` below 1.
    """
    if spec.nnodes < 1 or spec.nproc_per_node < 1:
        raise ConfigError(
            f"--nnodes ({spec.nnodes}) and --nproc-per-node ({spec.nproc_per_node}) must be >= 1"
        )
    if spec.nnodes == 1:
        return [job]
    if opts.k8s_kind == "jobset":
        return [jobset(job, spec, opts)]
    group = indexed_job(job, spec, opts)
    return [service(group, opts), group]
