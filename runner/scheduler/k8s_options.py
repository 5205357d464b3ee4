"""``Options``: the profile keys of the Kubernetes backend (``profiles/k8s.yaml``).

Validated on construction (``ConfigError`` naming the key and the fix); YAML lists are
normalised to tuples so an instance stays immutable in practice.  Re-exported by
:mod:`ckrun.scheduler.k8s`, where ``config.py`` finds it as the backend's ``Options``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckrun.errors import ConfigError
from ckrun.options import coerce_fields

#: Values of ``k8s_kind``.
KINDS = ("job", "jobset")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
#: ``[prefix/]name`` label key (prefix: DNS subdomain; name: <= 63 characters).
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")


@dataclass(frozen=True)
class Options:
    """Profile keys of the ``k8s`` backend (``profiles/k8s.yaml``).

    Attributes:
        image: container image with ckrun and the training code installed (required;
            ``--image``).
        namespace: namespace of the Job (``--namespace``).
        gpus: GPUs per pod (``--gpus``), requested as ``gpu_resource``.
        gpu_resource: extended resource name of a GPU.
        cpu: CPU request (a Kubernetes quantity such as ``"8"`` or ``"7500m"``); no CPU
            limit is set, so the trainer is never throttled.  Empty: none.
        memory: memory request and limit (quantity such as ``"64Gi"``).  Empty: none.
        shm_size: size of a memory-backed ``/dev/shm`` (DataLoader workers).  Empty: the
            runtime's default (often 64 MiB).
        node_selector: node labels the pod must match, each ``KEY=VALUE``, e.g. a spot
            pool's ``cloud.google.com/gke-spot=true`` (profiles are flat: a list of
            strings, or one comma-separated string from the environment).
        tolerations: taints the pod tolerates, each ``KEY[=VALUE][:EFFECT]``
            (``kubernetes.azure.com/scalesetpriority=spot:NoSchedule``): operator
            ``Equal`` with a value, ``Exists`` without; no effect matches every effect.
        priority_class: ``priorityClassName`` of the pod.  Empty: none.
        service_account: ``serviceAccountName`` of the pod (for cloud storage identity,
            e.g. IRSA or GKE Workload Identity).  Empty: the namespace's default.
        env_from_secret: name of a Secret whose keys become environment variables (for
            example ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``).  Empty: none.
        termination_grace_period_s: seconds between the kubelet's SIGTERM and SIGKILL;
            must be at least ``save_time_s + grace_margin_s``.
        save_time_s: measured time of one checkpoint save, seconds (0: not measured).
        grace_margin_s: seconds kept beyond ``save_time_s`` (verify, exit, slow disks).
        backoff_limit: counted pod failures before the Job fails (preemptions are not
            counted).
        ttl_after_finished_s: seconds a finished Job is kept before it is deleted.
        pvc_mount_path: where a ``pvc:NAME`` storage is mounted in the container.
        image_pull_policy: ``Always``, ``IfNotPresent`` or ``Never``; empty: default.
        image_pull_secrets: names of Secrets used to pull ``image``.
        ckrun_command: argv that starts ckrun in the image (PID 1), e.g. ``["ckrun"]``.
        kubeconfig: kubeconfig file for submit/status/cancel; empty: ``$KUBECONFIG``,
            ``~/.kube/config``, then the in-cluster service account.
        context: kubeconfig context; empty: the current context.
        k8s_kind: what a run of ``--nnodes N`` > 1 is rendered as: ``job`` (an Indexed
            ``batch/v1`` Job plus a headless Service; any Kubernetes 1.29+) or ``jobset``
            (a ``jobset.x-k8s.io/v1alpha2`` JobSet, JobSet v0.10+ installed): see
            :mod:`ckrun.scheduler.k8s_group` for which mechanism restarts the group.
        rdzv_port: TCP port of torchrun's c10d rendezvous store on index 0's pod.
        rdzv_timeout_s: seconds torchrun waits for every node of the group to join the
            rendezvous (``join_timeout``): the slowest pod's scheduling and image pull.
    """

    image: str = ""
    namespace: str = "default"
    gpus: int = 0
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str = ""
    memory: str = ""
    shm_size: str = ""
    node_selector: tuple[str, ...] = ()
    tolerations: tuple[str, ...] = ()
    priority_class: str = ""
    service_account: str = ""
    env_from_secret: str = ""
    termination_grace_period_s: int = 120
    save_time_s: float = 0.0
    grace_margin_s: float = 20.0
    backoff_limit: int = 3
    ttl_after_finished_s: int = 604800
    pvc_mount_path: str = "/ckrun-storage"
    image_pull_policy: str = ""
    image_pull_secrets: tuple[str, ...] = ()
    ckrun_command: tuple[str, ...] = ("ckrun",)
    kubeconfig: str = ""
    context: str = ""
    k8s_kind: str = "job"
    rdzv_port: int = 29500
    rdzv_timeout_s: int = 900

    def __post_init__(self) -> None:
        """Normalise YAML lists to tuples and check every value.

        Raises:
            ConfigError: a value has the wrong type or is out of range; the message
                names the profile key and the fix.
        """
        coerce_fields(self)  # YAML lists and comma-separated strings -> tuples, "8" -> 8
        self.node_selector_map()
        self.toleration_list()
        _check_int("gpus", self.gpus, 0)
        _check_int("termination_grace_period_s", self.termination_grace_period_s, 1)
        _check_int("backoff_limit", self.backoff_limit, 0)
        _check_int("ttl_after_finished_s", self.ttl_after_finished_s, 0)
        for key in ("cpu", "memory", "shm_size"):
            value = getattr(self, key)
            if value and not _QUANTITY.match(str(value)):
                raise ConfigError(
                    f"{key}={value!r} is not a Kubernetes quantity; write e.g. '8', "
                    "'7500m' or '64Gi'"
                )
        if self.image_pull_policy not in ("", "Always", "IfNotPresent", "Never"):
            raise ConfigError(
                f"image_pull_policy={self.image_pull_policy!r}: use Always, IfNotPresent "
                "or Never (or leave it empty)"
            )
        if not self.ckrun_command:
            raise ConfigError("ckrun_command is empty: set it to the argv of ckrun, ['ckrun']")
        if self.k8s_kind not in KINDS:
            raise ConfigError(
                f"k8s_kind={self.k8s_kind!r}: use 'job' (an Indexed Job and a headless "
                "Service, any Kubernetes 1.29+) or 'jobset' (needs JobSet v0.10+ installed)"
            )
        _check_int("rdzv_port", self.rdzv_port, 1)
        if self.rdzv_port > 65535:
            raise ConfigError(f"rdzv_port must be a TCP port (1-65535), got {self.rdzv_port}")
        _check_int("rdzv_timeout_s", self.rdzv_timeout_s, 1)
        if not self.pvc_mount_path.startswith("/"):
            raise ConfigError(f"pvc_mount_path={self.pvc_mount_path!r} must be absolute")

    def node_selector_map(self) -> dict[str, str]:
        """:attr:`node_selector` as the pod's ``nodeSelector``. Raises ``ConfigError``."""
        return parse_node_selector(self.node_selector)

    def toleration_list(self) -> list[dict[str, str]]:
        """:attr:`tolerations` as the pod's ``tolerations``. Raises ``ConfigError``."""
        return [parse_toleration(t) for t in self.tolerations]


def _check_int(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")


def parse_node_selector(items: tuple[str, ...]) -> dict[str, str]:
    """``("k=v", ...)`` -> ``{"k": "v"}``.

    Raises:
        ConfigError: an item is not ``KEY=VALUE`` with a valid label key and value.
    """
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value):
            raise ConfigError(
                f"node_selector item {item!r}: write KEY=VALUE with a label key and value, "
                "e.g. cloud.google.com/gke-spot=true"
            )
        out[key] = value
    return out


def parse_toleration(item: str) -> dict[str, str]:
    """``KEY[=VALUE][:EFFECT]`` -> a Kubernetes ``Toleration`` (wire format).

    Raises:
        ConfigError: bad key, value or effect.
    """
    rest, colon, effect = item.rpartition(":") if ":" in item else (item, "", "")
    key, eq, value = rest.partition("=")
    if (
        not _LABEL_KEY.match(key)
        or not _LABEL_VALUE.match(value)
        or (colon and effect not in _EFFECTS)
    ):
        raise ConfigError(
            f"toleration {item!r}: write KEY[=VALUE][:EFFECT] with EFFECT one of "
            f"{', '.join(_EFFECTS)}, e.g. kubernetes.azure.com/scalesetpriority=spot:NoSchedule"
        )
    tol = {"key": key, "operator": "Equal" if eq else "Exists"}
    if eq:
        tol["value"] = value
    if effect:
        tol["effect"] = effect
    return tol
