"""Golden renders of the k8s Job and offline validation against the official schemas.

No Kubernetes cluster or API server can run on these machines: every rendered Job is
validated offline with ``kubernetes-validate`` (the OpenAPI schemas of Kubernetes 1.25-1.37
it ships), in strict mode (unknown fields rejected).  The rendered Jobs are valid for
exactly 1.29-1.37: the 1.25-1.28 schemas require ``onPodConditions`` in every
podFailurePolicy rule, and ckrun's exit-code rules have none.

Regenerate the golden files after an intended change with ``CKRUN_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from ckrun import config
from ckrun.errors import ConfigError, ExitCode
from ckrun.scheduler.base import JobSpec, get_scheduler
from ckrun.scheduler.k8s import K8sScheduler, Options, job_name
from ckrun.scheduler.k8s_manifest import (
    MIN_KUBERNETES_VERSION,
    dump_yaml,
    grace_s,
    load_template,
    split_storage,
)

kv = pytest.importorskip("kubernetes_validate")
from kubernetes_validate.utils import all_versions, major_minor  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
SUPPORTED = [f"1.{m}" for m in range(29, 38)]
UNSUPPORTED = ["1.25", "1.26", "1.27", "1.28"]


def _profile_case() -> JobSpec:
    cfg = config.resolve(
        "k8s",
        cli={"image": "ghcr.io/acme/train:1.4"},
        env={},
        run="demo",
        command=("python", "train.py"),
    )
    return JobSpec(run=cfg.run, command=cfg.command, storage=cfg.storage, options=cfg.options)


CASES: dict[str, Any] = {
    "profile-k8s": _profile_case,
    "gke-spot-gpu-pvc": lambda: JobSpec(
        run="llm-7b",
        command=("torchrun", "--nproc_per_node=8", "train.py", "--lr", "3e-4"),
        storage="pvc:ckpt-claim/llm-7b",
        env={"NCCL_DEBUG": "WARN"},
        supervisor_args=("--storage", "pvc:ckpt-claim", "--allow-change", "world_size"),
        options=Options(
            image="us-docker.pkg.dev/acme/ml/train:2026-11",
            namespace="ml",
            gpus=8,
            cpu="90",
            memory="600Gi",
            shm_size="64Gi",
            priority_class="spot-batch",
            node_selector=("cloud.google.com/gke-spot=true",),
            tolerations=("cloud.google.com/gke-spot=true:NoSchedule", "nvidia.com/gpu:NoSchedule"),
            termination_grace_period_s=150,
            save_time_s=60,
        ),
    ),
    "eks-spot-s3-secret": lambda: JobSpec(
        run="resnet50",
        command=("python", "-m", "train", "--epochs", "90"),
        storage="s3://acme-ckpt/runs",
        env={"AWS_REGION": "us-east-1"},
        options=Options(
            image="123456789012.dkr.ecr.us-east-1.amazonaws.com/train:7",
            namespace="vision",
            gpus=1,
            env_from_secret="ckrun-s3",
            service_account="trainer",
            node_selector=("eks.amazonaws.com/capacityType=SPOT",),
            image_pull_policy="IfNotPresent",
            image_pull_secrets=("ecr-pull",),
            backoff_limit=5,
            ckrun_command=("/opt/venv/bin/ckrun",),
        ),
    ),
    "odd-names-and-args": lambda: JobSpec(
        run="My_Run.v2",
        command=("sh", "-c", "python train.py --x yes"),
        storage="s3://b",
        options=Options(image="img:1.0"),
        env={"FLAG": "on", "RATE": "3e-4", "TIME": "1:30"},
    ),
}


def _validate(doc: dict[str, Any], version: str) -> str | None:
    """None when ``doc`` is valid for ``version`` in strict mode, else the first error."""
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as e:
        return str(e).splitlines()[0]
    return None


def _versions() -> list[str]:
    return sorted({major_minor(v) for v in all_versions()}, key=lambda v: int(v.split(".")[1]))


def test_shipped_schemas_cover_the_claimed_versions() -> None:
    assert set(SUPPORTED + UNSUPPORTED) <= set(_versions())


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_render(case: str) -> None:
    text = get_scheduler("k8s").render(CASES[case]())
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("CKRUN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"render changed; CKRUN_UPDATE_GOLDEN=1 rewrites {path}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_valid_exactly_on_supported_versions(case: str) -> None:
    doc = yaml.safe_load(get_scheduler("k8s").render(CASES[case]()))
    results = {v: _validate(doc, v) for v in _versions()}
    assert [v for v, err in results.items() if err is None] == SUPPORTED
    for v in UNSUPPORTED:
        assert "onPodConditions" in str(results[v]), (v, results[v])
    assert doc["metadata"]["annotations"]["ckrun/min-kubernetes-version"] == "1.29"
    assert MIN_KUBERNETES_VERSION == SUPPORTED[0]


def test_template_itself_is_a_valid_job() -> None:
    doc = yaml.safe_load((REPO / "k8s" / "job.yaml").read_text())
    assert [v for v in _versions() if _validate(doc, v) is None] == SUPPORTED


def test_strict_validation_rejects_unknown_fields() -> None:
    """The validator is not vacuous: a misspelt field fails every version."""
    doc = yaml.safe_load(get_scheduler("k8s").render(CASES["profile-k8s"]()))
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    assert all(_validate(bad, v) for v in SUPPORTED)
    bad = copy.deepcopy(doc)
    bad["spec"]["podFailurePolicy"]["rules"][0]["onExitCode"] = {}
    assert all(_validate(bad, v) for v in SUPPORTED)


def test_rendered_yaml_parses_back_to_the_manifest() -> None:
    """Ambiguous strings (3e-4, on, 1:30, yes) are quoted, so the Job's types survive."""
    for case in CASES:
        spec = CASES[case]()
        sched = K8sScheduler()
        assert yaml.safe_load(sched.render(spec)) == sched.manifest(spec)
    text = dump_yaml({"a": ["3e-4", "on", "1:30", "y", "0x1f", "1_000", ".inf", "train.py"]})
    quoted = ["'3e-4'", "'on'", "'1:30'", "'y'", "'0x1f'", "'1_000'", "'.inf'", "train.py"]
    assert text == "a:\n" + "".join(f"- {q}\n" for q in quoted)


def test_policy_mirrors_exit_codes() -> None:
    rules = load_template()["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {
        "action": "Ignore",
        "onExitCodes": {
            "containerName": "ckrun",
            "operator": "In",
            "values": [ExitCode.PREEMPTED, ExitCode.PREEMPTED_NO_CHECKPOINT],
        },
    }
    assert rules[1]["action"] == "FailJob"
    assert rules[1]["onExitCodes"]["values"] == [ExitCode.CONFIG_INVALID, ExitCode.INCOMPATIBLE]
    assert rules[2] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert len(rules) == 3  # everything else is counted against backoffLimit


def test_job_shape() -> None:
    spec = CASES["gke-spot-gpu-pvc"]()
    doc = K8sScheduler().manifest(spec)
    job, pod = doc["spec"], doc["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and job["podReplacementPolicy"] == "Failed"
    assert job["completions"] == job["parallelism"] == 1
    assert pod["terminationGracePeriodSeconds"] == 150
    (c,) = pod["containers"]
    # exec form: ckrun itself is PID 1, the training command follows "--"
    assert c["command"][:4] == ["ckrun", "run", "--run", "llm-7b"]
    assert c["command"][c["command"].index("--") + 1 :] == list(spec.command)
    assert "args" not in c and "shareProcessNamespace" not in pod
    assert c["command"][c["command"].index("--storage") + 1] == "/ckrun-storage"
    assert pod["volumes"][0] == {
        "name": "ckrun-storage",
        "persistentVolumeClaim": {"claimName": "ckpt-claim"},
    }
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert doc["metadata"]["labels"]["ckrun/run"] == "llm-7b"


def test_s3_storage_gets_a_pod_local_state_dir() -> None:
    c = K8sScheduler().manifest(CASES["eks-spot-s3-secret"]())["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in c["containers"][0]["env"]}
    assert env["CKRUN_STATE_DIR"] == "/ckrun-state"
    assert {"name": "ckrun-state", "emptyDir": {}} in c["volumes"]


@pytest.mark.parametrize(
    ("kwargs", "spec_kw", "needle"),
    [
        ({}, {}, "--image"),
        ({"image": "i"}, {"storage": "/mnt/ckpt"}, "pvc:CLAIM"),
        ({"image": "i"}, {"storage": "pvc:Bad_Claim"}, "not a valid PVC name"),
        ({"image": "i", "save_time_s": 200}, {}, "termination_grace_period_s: 220"),
        ({"image": "i"}, {"env": {"CKRUN_GRACE_S": "110"}}, "termination_grace_period_s: 130"),
        ({"image": "i", "termination_grace_period_s": 22}, {}, "termination_grace_period_s: 25"),
        ({"image": "i"}, {"command": ()}, "training command"),
    ],
)
def test_render_refuses(kwargs: dict[str, Any], spec_kw: dict[str, Any], needle: str) -> None:
    base: dict[str, Any] = {"run": "r", "command": ("python", "t.py"), "storage": "s3://b"}
    spec = JobSpec(**{**base, **spec_kw, "options": Options(**kwargs)})
    with pytest.raises(ConfigError, match=needle.replace("|", r"\|")):
        K8sScheduler().render(spec)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"gpus": -1}, "gpus"),
        ({"memory": "64 GB"}, "quantity"),
        ({"tolerations": ("spot=yes:Sometimes",)}, "EFFECT"),
        ({"node_selector": ("no-equals-sign",)}, "KEY=VALUE"),
        ({"image_pull_policy": "Sometimes"}, "IfNotPresent"),
        ({"termination_grace_period_s": 0}, "termination_grace_period_s"),
        ({"pvc_mount_path": "rel"}, "absolute"),
    ],
)
def test_options_refuse(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Options(**kwargs)


def test_job_names_are_dns_labels() -> None:
    assert job_name("llm-7b") == "llm-7b"
    odd = job_name("My_Run.v2")
    assert odd.startswith("my-run-v2-") and len(odd) == len("my-run-v2-") + 8
    long = job_name("x" * 80)
    assert len(long) <= 52 and long != job_name("x" * 81)
    for name in (odd, long, job_name("___")):
        assert name[0].isalnum() and name[-1].isalnum()
        assert set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")


def test_render_needs_no_cluster() -> None:
    """render is pure: it never touches the API handle."""

    class NoApi:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"render used the API ({name})")

    sched = K8sScheduler(api=NoApi())
    assert sched.render(CASES["profile-k8s"]()) == sched.render(CASES["profile-k8s"]())


def test_rbac_example_is_valid() -> None:
    docs = list(yaml.safe_load_all((REPO / "k8s" / "rbac.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Role", "RoleBinding", "ServiceAccount"]
    for doc in docs:
        assert [v for v in SUPPORTED if _validate(doc, v)] == [], doc["kind"]


@pytest.mark.parametrize(
    ("storage", "args", "base"),
    [
        ("s3://b/runs/demo", ("--storage", "s3://b/runs", "--allow-change", "x"), "s3://b/runs"),
        ("s3://b/runs/demo", ("--storage=pvc:c/runs",), "pvc:c/runs"),
        ("s3://b/runs/demo", (), "s3://b/runs"),  # the run root less /RUN
        ("pvc:claim", (), "pvc:claim"),
    ],
)
def test_storage_base(storage: str, args: tuple[str, ...], base: str) -> None:
    spec = JobSpec(run="demo", command=("t",), storage=storage, supervisor_args=args)
    assert split_storage(spec) == (base, tuple(a for a in args if a in ("--allow-change", "x")))


def test_cli_shaped_spec() -> None:
    """What launch.submit passes: run root as storage, base in --storage, submitter paths."""
    spec = JobSpec(
        run="demo",
        command=("python", "t.py"),
        storage="pvc:ckpt/runs/demo",
        supervisor_args=("--storage", "pvc:ckpt/runs", "--allow-change", "lr"),
        env={
            "CKRUN_SUPERVISOR_LOG": "/home/me/st/demo/supervisor.log",
            "CKRUN_STATE_DIR": "/home/me/st",
            "WANDB_MODE": "offline",
        },
        options=Options(image="i", termination_grace_period_s=90),
    )
    c = K8sScheduler().manifest(spec)["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == [
        "ckrun",
        "run",
        "--run",
        "demo",
        "--storage",
        "/ckrun-storage/runs",
        "--allow-change",
        "lr",
        "--",
        "python",
        "t.py",
    ]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "CKRUN_SUPERVISOR_LOG" not in env and "CKRUN_STATE_DIR" not in env
    assert env["WANDB_MODE"] == "offline"
    assert env["CKRUN_GRACE_S"] == "70" and env["CKRUN_K8S_TERMINATION_GRACE_S"] == "90"
    assert grace_s(spec, spec.options) == 70.0
