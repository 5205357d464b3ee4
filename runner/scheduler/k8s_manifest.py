"""Pure rendering of the Kubernetes backend's ``batch/v1`` Job.

:func:`manifest` fills ``k8s/job.yaml`` (the template: restartPolicy, podFailurePolicy,
Downward API env) with a run's values; :func:`render_yaml` prints it.  No side effects:
the output is golden-tested and validated offline against the official OpenAPI schemas
of Kubernetes 1.29-1.37 (``tests/k8s``).  Why the Job looks the way it does:
``k8s/README.md``.  ``Options`` lives in :mod:`ckrun.scheduler.k8s_options`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.resources
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from ckrun.errors import ConfigError, ExitCode
from ckrun.scheduler.base import JobSpec
from ckrun.scheduler.k8s_options import Options

log = logging.getLogger(__name__)

#: The container ckrun runs in; podFailurePolicy's ``onExitCodes`` names it.
CONTAINER = "ckrun"
#: Oldest Kubernetes whose API accepts the rendered Job with every feature used enabled
#: by default (podFailurePolicy rules without ``onPodConditions`` need 1.29; GA versions:
#: podFailurePolicy 1.31, backoffLimitPerIndex 1.33, podReplacementPolicy 1.34).
MIN_KUBERNETES_VERSION = "1.29"
#: Exit codes the Job controller must not count as failures (requeue).
REQUEUE_EXIT_CODES = (int(ExitCode.PREEMPTED), int(ExitCode.PREEMPTED_NO_CHECKPOINT))
#: Exit codes that end the Job at once: a retry cannot help.
FAIL_JOB_EXIT_CODES = (int(ExitCode.CONFIG_INVALID), int(ExitCode.INCOMPATIBLE))
#: Pod-local state directory (``CKRUN_STATE_DIR``) when the storage is remote.
STATE_DIR = "/ckrun-state"
#: Label and annotation carrying the run name.
RUN_LABEL = "ckrun/run"
#: The Job controller's label on its pods (Kubernetes 1.27+).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
_MAX_JOB_NAME = 52  # pods get "<job>-<index>-<5 chars>"; the job-name label is <= 63


def job_name(run: str) -> str:
    """The Job's name for ``run``: a DNS-1123 label of at most 52 characters.

    The run name is used as it is when it already fits; otherwise it is lower-cased,
    reduced to ``[a-z0-9-]`` and shortened, and a hash of the original keeps distinct
    runs distinct (``"My_Run"`` → ``"my-run-1c8c47b5"``).

    Raises:
        ConfigError: ``run`` is empty.
    """
    if not run:
        raise ConfigError("the run name is empty: give --run NAME")
    if re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", run) and len(run) <= _MAX_JOB_NAME:
        return run
    base = re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")[: _MAX_JOB_NAME - 9]
    digest = hashlib.sha256(run.encode()).hexdigest()[:8]
    return f"{base.rstrip('-')}-{digest}" if base else f"ckrun-{digest}"


def label_value(run: str) -> str:
    """``run`` made a valid label value (<= 63 of ``[A-Za-z0-9_.-]``, alphanumeric ends)."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", run)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def load_template() -> dict[str, Any]:
    """Parse ``k8s/job.yaml`` (the wheel's ``ckrun.templates.k8s`` data package, or the
    source tree's ``k8s/`` in a development checkout)."""
    try:
        text = (importlib.resources.files("ckrun.templates.k8s") / "job.yaml").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        text = (Path(__file__).resolve().parents[2] / "k8s" / "job.yaml").read_text()
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ConfigError("k8s/job.yaml is not a YAML mapping; reinstall ckrun")
    return doc


def storage_volume(
    storage: str, opts: Options
) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Map the run's storage URL onto the pod.

    Args:
        storage: ``s3://BUCKET[/PREFIX]`` (passed through; credentials come from
            ``env_from_secret``, the service account or the node; an ``emptyDir`` at
            :data:`STATE_DIR` holds the pod's local state) or
            ``pvc:CLAIM[/SUBPATH]`` (the claim is mounted at ``opts.pvc_mount_path``).
        opts: the backend options.

    Returns:
        ``(storage argument for ckrun run, pod volumes, container volumeMounts)``.

    Raises:
        ConfigError: a local path (a replacement pod would not see its checkpoints).
    """
    if storage.startswith("s3://"):
        # run.json, events and the control channel need a local directory (RunConfig
        # .state_dir); it lives as long as the pod.
        volume = {"name": "ckrun-state", "emptyDir": {}}
        return storage, [volume], [{"name": "ckrun-state", "mountPath": STATE_DIR}]
    if storage.startswith("pvc:"):
        claim, _, sub = storage[4:].partition("/")
        if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", claim):
            raise ConfigError(
                f"storage {storage!r}: {claim!r} is not a valid PVC name; "
                "write pvc:CLAIM or pvc:CLAIM/SUBDIR"
            )
        path = opts.pvc_mount_path.rstrip("/") + ("/" + sub.strip("/") if sub.strip("/") else "")
        volume = {"name": "ckrun-storage", "persistentVolumeClaim": {"claimName": claim}}
        mount = {"name": "ckrun-storage", "mountPath": opts.pvc_mount_path}
        return path, [volume], [mount]
    raise ConfigError(
        f"storage {storage!r} is a path inside one pod: the pod that replaces a preempted "
        "one would not see its checkpoints; use --storage s3://BUCKET/PREFIX or "
        "--storage pvc:CLAIM (a ReadWriteOnce or ReadWriteMany PersistentVolumeClaim)"
    )


def split_storage(spec: JobSpec) -> tuple[str, tuple[str, ...]]:
    """The storage *base* ``ckrun run --storage`` needs, and the other supervisor args.

    ``launch.submit`` passes the base as ``--storage BASE`` in ``spec.supervisor_args``
    and the run root (``BASE/RUN``) as ``spec.storage``; without the former the base is
    ``spec.storage`` less a trailing ``/RUN``.
    """
    args, rest, base = list(spec.supervisor_args), [], None
    while args:
        arg = args.pop(0)
        if arg == "--storage" and args:
            base = args.pop(0)
        elif arg.startswith("--storage="):
            base = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if base is None:
        base = spec.storage.rstrip("/")
        base = base.removesuffix("/" + spec.run) if base != spec.run else base
    return base, tuple(rest)


def grace_s(spec: JobSpec, opts: Options) -> float:
    """The supervisor's drain budget after SIGTERM (``CKRUN_GRACE_S`` in the pod).

    ``spec.env["CKRUN_GRACE_S"]`` when given, else ``termination_grace_period_s -
    grace_margin_s``: the kubelet's SIGKILL comes ``termination_grace_period_s`` after its
    SIGTERM, and the supervisor still needs the margin to stop the child, verify the
    commit and exit.

    Raises:
        ConfigError: the budget does not fit (``grace + grace_margin_s >
            termination_grace_period_s``), or a measured save does not fit in it.
    """
    tgps, margin = opts.termination_grace_period_s, opts.grace_margin_s
    given = spec.env.get("CKRUN_GRACE_S")
    try:
        grace = float(given) if given else tgps - margin
    except ValueError as exc:
        raise ConfigError(f"CKRUN_GRACE_S={given!r} is not a number of seconds") from exc
    if grace < 5 or grace + margin > tgps:
        raise ConfigError(
            f"a drain budget of {grace:g} s plus grace_margin_s {margin:g} s does not fit in "
            f"termination_grace_period_s={tgps}: the kubelet would SIGKILL ckrun first; set "
            f"termination_grace_period_s: {int(max(grace, 5) + margin + 0.999)} or more"
        )
    if opts.save_time_s > grace:
        raise ConfigError(
            f"the measured save time {opts.save_time_s:g} s exceeds the drain budget "
            f"{grace:g} s (termination_grace_period_s={tgps} - grace_margin_s {margin:g}): "
            "the kubelet would SIGKILL ckrun mid-save; set termination_grace_period_s: "
            f"{int(opts.save_time_s + margin + 0.999)} or more"
        )
    return grace


#: Environment the submitting machine passes that names *its* paths; meaningless in a pod.
_SUBMITTER_ENV = ("CKRUN_SUPERVISOR_LOG", "CKRUN_STATE_DIR")


def _env(spec: JobSpec, opts: Options, base: str, template_env: list[Any]) -> list[Any]:
    fixed = {"CKRUN_K8S_TERMINATION_GRACE_S", "CKRUN_GRACE_S", "CKRUN_STATE_DIR"}
    env = [e for e in template_env if e["name"] not in fixed]
    env.append(
        {"name": "CKRUN_K8S_TERMINATION_GRACE_S", "value": str(opts.termination_grace_period_s)}
    )
    env.append({"name": "CKRUN_GRACE_S", "value": f"{grace_s(spec, opts):g}"})
    if base.startswith("s3://"):
        env.append({"name": "CKRUN_STATE_DIR", "value": STATE_DIR})
    skip = {*_SUBMITTER_ENV, "CKRUN_GRACE_S"}
    return env + [{"name": k, "value": v} for k, v in sorted(spec.env.items()) if k not in skip]


def _resources(opts: Options) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if opts.cpu:
        requests["cpu"] = opts.cpu
    if opts.memory:
        requests["memory"] = limits["memory"] = opts.memory
    if opts.gpus:
        requests[opts.gpu_resource] = limits[opts.gpu_resource] = str(opts.gpus)
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def pod_command(command: tuple[str, ...]) -> list[str]:
    """``command`` for the image: the submitting machine's own interpreter path (what
    ``ckrun submit train.py`` puts first) becomes ``python``, found on the image's PATH."""
    argv = list(command)
    if argv and argv[0] in {sys.executable, os.path.realpath(sys.executable)}:
        argv[0] = "python"
    return argv


def _container(spec: JobSpec, opts: Options, template: dict[str, Any]) -> dict[str, Any]:
    """Fill the template's ``ckrun`` container for ``spec``."""
    c = copy.deepcopy(template)
    base, args = split_storage(spec)
    storage_arg, _, mounts = storage_volume(base, opts)
    c["image"] = opts.image
    c["command"] = [
        *opts.ckrun_command,
        "run",
        "--run",
        spec.run,
        "--storage",
        storage_arg,
        *args,
        "--",
        *pod_command(spec.command),
    ]
    c["env"] = _env(spec, opts, base, c.get("env", []))
    if opts.env_from_secret:
        c["envFrom"] = [{"secretRef": {"name": opts.env_from_secret}}]
    if opts.image_pull_policy:
        c["imagePullPolicy"] = opts.image_pull_policy
    if resources := _resources(opts):
        c["resources"] = resources
    if opts.shm_size:
        mounts = [*mounts, {"name": "dshm", "mountPath": "/dev/shm"}]
    if mounts:
        c["volumeMounts"] = mounts
    return c


def _pod_spec(spec: JobSpec, opts: Options, template: dict[str, Any]) -> dict[str, Any]:
    pod = copy.deepcopy(template)
    containers = pod["containers"]
    idx = next(i for i, c in enumerate(containers) if c["name"] == CONTAINER)
    containers[idx] = _container(spec, opts, containers[idx])
    pod["terminationGracePeriodSeconds"] = opts.termination_grace_period_s
    _, volumes, _ = storage_volume(split_storage(spec)[0], opts)
    if opts.shm_size:
        volumes = [
            *volumes,
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}},
        ]
    if volumes:
        pod["volumes"] = volumes
    if opts.node_selector:
        pod["nodeSelector"] = opts.node_selector_map()
    if opts.tolerations:
        pod["tolerations"] = opts.toleration_list()
    if opts.priority_class:
        pod["priorityClassName"] = opts.priority_class
    if opts.service_account:
        pod["serviceAccountName"] = opts.service_account
    if opts.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in opts.image_pull_secrets]
    return pod


def manifest(spec: JobSpec, opts: Options | None = None) -> dict[str, Any]:
    """The Job for ``spec`` as a JSON-ready dict (wire format, camelCase keys).

    Args:
        spec: the run; ``spec.options`` (an :class:`Options`) is used unless ``opts``
            is given.
        opts: backend options overriding ``spec.options``.

    Raises:
        ConfigError: no image, an unusable storage, or a grace period that does not fit
            the drain (see :func:`grace_s`).
    """
    opts = opts or spec.options or Options()
    if not isinstance(opts, Options):
        raise ConfigError(f"k8s needs ckrun.scheduler.k8s.Options, got {type(opts).__name__}")
    if not opts.image:
        raise ConfigError(
            "no container image: pass --image IMAGE or set image: in the "
            "profile (an image with ckrun and your training code installed)"
        )
    if not spec.command:
        raise ConfigError("no training command: give it after the options, e.g. train.py")
    doc = load_template()
    name = job_name(spec.run)
    labels = {
        "app.kubernetes.io/name": "ckrun",
        "app.kubernetes.io/managed-by": "ckrun",
        RUN_LABEL: label_value(spec.run),
    }
    doc["metadata"] = {
        "name": name,
        "namespace": opts.namespace,
        "labels": labels,
        "annotations": {
            RUN_LABEL: spec.run,
            "ckrun/min-kubernetes-version": MIN_KUBERNETES_VERSION,
        },
    }
    job = doc["spec"]
    job["backoffLimit"] = job["backoffLimitPerIndex"] = opts.backoff_limit
    job["ttlSecondsAfterFinished"] = opts.ttl_after_finished_s
    job["template"]["metadata"] = {"labels": dict(labels)}
    job["template"]["spec"] = _pod_spec(spec, opts, job["template"]["spec"])
    return doc


#: Plain scalars that some YAML parser reads as something other than a string: YAML 1.1
#: booleans (go-yaml v2, which kubectl uses, includes y/n/on/off), exponent floats without a
#: dot (YAML 1.2: ``3e-4``), hex/octal/binary, sexagesimal, ``.inf``/``.nan``, digits with
#: ``_``.  PyYAML quotes only what *its* resolver would misread, so these are forced.
_AMBIGUOUS = re.compile(
    r"^(?:[yYnN]|yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF|true|True|TRUE|false|False|FALSE"
    r"|~|null|Null|NULL|[-+]?\.?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?0[xXoObB][0-9a-fA-F_]+|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


def _represent_str(dumper: Any, value: str) -> Any:
    style = "'" if _AMBIGUOUS.match(value) else None
    node = dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)
    return node


#: SafeDumper that single-quotes every string a YAML 1.1 or 1.2 parser could misread
#: (built with ``type`` so that ``yaml.SafeDumper`` itself is left untouched).
_Dumper: Any = type("_Dumper", (yaml.SafeDumper,), {})
_Dumper.add_representer(str, _represent_str)


def dump_yaml(doc: dict[str, Any]) -> str:
    """Block-style YAML of ``doc``, keys in insertion order, ambiguous strings quoted."""
    text: str = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    return text


def render_yaml(doc: dict[str, Any] | list[dict[str, Any]], run: str) -> str:
    """YAML text of ``doc`` with a header naming the run and the Kubernetes versions.

    A list (``K8sScheduler.manifests``: a multi-node run's Service and Job, or its
    JobSet) becomes one YAML stream, documents separated by ``---``, in creation order.
    """
    docs = doc if isinstance(doc, list) else [doc]
    kinds = " + ".join(str(d.get("kind", "?")) for d in docs)
    what = "Job" if kinds == "Job" else kinds
    header = (
        f"# ckrun {what} for run {run!r}, rendered from k8s/job.yaml.  Submit with\n"
        "#   kubectl create -f THIS_FILE   (or: ckrun submit ... without --dry-run)\n"
        f"# min_kubernetes_version: {MIN_KUBERNETES_VERSION} (valid for the 1.29-1.37 "
        "schemas; <= 1.28 rejects\n#   podFailurePolicy rules without onPodConditions)\n"
    )
    if any(d.get("kind") == "JobSet" for d in docs):
        header += "# needs JobSet v0.10+ installed in the cluster (jobset.x-k8s.io/v1alpha2)\n"
    return header + "---\n".join(dump_yaml(d) for d in docs)
