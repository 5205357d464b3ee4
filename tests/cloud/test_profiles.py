"""The shipped spot profiles resolve and start their notice source (loopback servers)."""

from __future__ import annotations

from ckrun.config import build_notice_sources, resolve
from metaservers import AwsImds, AzureImds, GcpMetadata, wait_notice


def test_aws_spot_profile(aws: AwsImds, closing, monkeypatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", aws.url)
    cfg = resolve(profile="aws-spot", run="r", command=("true",))
    assert cfg.storage.startswith("s3://") and cfg.notice_sources == ("aws",)
    assert cfg.grace_s + cfg.margin_s <= 120  # AWS's notice window
    aws.arm(deadline_s=120)  # armed before the source starts: its first round must see it
    (src,) = [closing(s) for s in build_notice_sources(cfg)]
    assert src.interval_s == 5.0
    # The real event, with a bound that only fails the test: the notice comes from the
    # start-up round (one request), not the 5 s period.  (Arming after the start raced the
    # first round: on a loaded machine the round came first and the notice 5 s later.)
    n = wait_notice(src, timeout_s=60)
    assert n.source == "aws"
    assert aws.count("GET", "spot/instance-action") == 1 and src.stats["rounds"] == 1


def test_gcp_spot_profile(gcp: GcpMetadata, closing, monkeypatch) -> None:
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{gcp.port}")
    cfg = resolve(profile="gcp-spot", run="r", command=("true",))
    assert cfg.notice_sources == ("gcp",) and cfg.grace_s + cfg.margin_s <= 30
    (src,) = [closing(s) for s in build_notice_sources(cfg)]
    gcp.preempt()
    assert wait_notice(src).source == "gcp"


def test_azure_spot_profile(azure: AzureImds, closing, monkeypatch) -> None:
    # issue 12: shipped beside aws-spot and gcp-spot
    monkeypatch.setenv("CKRUN_AZURE_METADATA_ENDPOINT", azure.url)
    cfg = resolve(profile="azure-spot", run="r", command=("true",))
    assert cfg.storage.startswith("s3://") and cfg.notice_sources == ("azure",)
    assert cfg.grace_s + cfg.margin_s <= 30 and not cfg.state_dir  # Azure: >= 30 s
    (src,) = [closing(s) for s in build_notice_sources(cfg)]
    azure.schedule("Preempt", not_before_s=30)
    n = wait_notice(src)
    assert n.source == "azure" and n.detail["EventType"] == "Preempt"
