"""One typed coercer (ckrun.options) for every options class: the same value means the
same thing in RunConfig, the Slurm and Kubernetes Options, CloudOptions and S3Options."""

from __future__ import annotations

import pytest
from ckrun.cloud import CloudOptions
from ckrun.config import resolve
from ckrun.errors import ConfigError
from ckrun.options import coerce
from ckrun.scheduler.k8s_options import Options as K8sOptions
from ckrun.scheduler.slurm_options import Options as SlurmOptions
from ckrun.storage.s3_options import S3Options


def test_every_options_class_coerces_strings_to_its_field_types() -> None:
    assert SlurmOptions(nodes="2", gpus_per_node="", requeue="no").nodes == 2  # type: ignore[arg-type]
    assert SlurmOptions(gpus_per_node="").gpus_per_node is None  # type: ignore[arg-type]
    assert SlurmOptions(requeue="no").requeue is False  # type: ignore[arg-type]
    k8s = K8sOptions(gpus="2", save_time_s="1m", node_selector="a=b, c=d")  # type: ignore[arg-type]
    assert (k8s.gpus, k8s.save_time_s, k8s.node_selector) == (2, 60.0, ("a=b", "c=d"))
    cloud = CloudOptions(aws_poll_interval_s="10s", checkpoint_on_rebalance="yes")  # type: ignore[arg-type]
    assert (cloud.aws_poll_interval_s, cloud.checkpoint_on_rebalance) == (10.0, True)
    assert CloudOptions(azure_event_types="Preempt").azure_event_types == ("Preempt",)  # type: ignore[arg-type]
    s3 = S3Options(s3_max_attempts="3", s3_timeout_s="2m")  # type: ignore[arg-type]
    assert (s3.s3_max_attempts, s3.s3_timeout_s) == (3, 120.0)
    cfg = resolve("local", env={"CKRUN_MAX_FAILURES": "5", "CKRUN_GRACE_S": "2m"})
    assert (cfg.max_failures, cfg.grace_s) == (5, 120.0)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: SlurmOptions(nodes="two"), "for nodes: expected a whole number"),
        (lambda: K8sOptions(gpus="1.5"), "for gpus: expected a whole number"),
        (lambda: S3Options(s3_max_attempts="x"), "for s3_max_attempts: expected a whole number"),
        (lambda: CloudOptions(gcp_wait_for_change="maybe"), "gcp_wait_for_change: expected true"),
        (lambda: CloudOptions(aws_poll_interval_s="soon"), "aws_poll_interval_s: invalid duration"),
        (lambda: resolve("local", env={"CKRUN_MAX_FAILURES": "x"}), "for max_failures"),
    ],
)
def test_a_bad_value_is_refused_naming_its_key(make: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        make()  # type: ignore[operator]


def test_coerce_rules() -> None:
    assert coerce("n", True, "bool") is True and coerce("n", "off", "bool") is False
    assert coerce("n", 8.0, "int") == 8 and coerce("n", " 8 ", "int") == 8
    with pytest.raises(ConfigError):
        coerce("n", True, "int")
    assert coerce("n", "", "str | None") is None and coerce("n", None, "int | None") is None
    assert coerce("n", ["a", 1], "tuple[str, ...]") == ("a", "1")
    assert coerce("x", {"k": 1}, "Mapping[str, Any]") == {"k": 1}  # other types: as given
