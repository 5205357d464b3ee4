"""build_sources: the supervisor's entry point for `notice_sources: [aws, gcp, azure]`."""

from __future__ import annotations

import pytest
from ckrun.cloud import CLOUD_SOURCES, build_sources
from ckrun.errors import ConfigError
from ckrun.notices import NoticeSource
from metaservers import AwsImds, AzureImds, GcpMetadata, wait_notice


def test_builds_all_three_from_profile_keys(
    aws: AwsImds, gcp: GcpMetadata, azure: AzureImds, closing, monkeypatch
) -> None:
    for var in (
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        "GCE_METADATA_HOST",
        "CKRUN_AZURE_METADATA_ENDPOINT",
    ):
        monkeypatch.delenv(var, raising=False)
    cfg = {
        "aws_metadata_endpoint": aws.url,
        "gcp_metadata_host": f"127.0.0.1:{gcp.port}",
        "azure_metadata_endpoint": azure.url,
        "scheduler": "local",  # other keys are ignored
    }
    aws.arm(120)
    gcp.preempt()
    azure.schedule("Preempt")
    sources = [closing(s) for s in build_sources(["AWS", "gcp", "azure", "aws"], cfg)]
    assert [s.name for s in sources] == list(CLOUD_SOURCES)
    for s in sources:
        assert isinstance(s, NoticeSource)
        assert wait_notice(s).source == s.name


def test_env_wins_over_profile_key(aws: AwsImds, closing, monkeypatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", aws.url)
    (src,) = build_sources(["aws"], {"aws_metadata_endpoint": "http://127.0.0.1:9"})
    closing(src)
    assert src.endpoint == aws.url


@pytest.mark.parametrize(
    ("names", "cfg", "match"),
    [
        (["aws", "oracle"], {}, "unknown notice source 'oracle'"),
        (["aws"], {"aws_poll_interval_s": 1}, "below 5"),
        (["azure"], {"azure_poll_interval_s": 0.1}, "below 1"),
        (["gcp"], {"metadata_timeout_s": 0}, "must be > 0"),
    ],
)
def test_config_errors(names, cfg, match, monkeypatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=match):
        for s in build_sources(names, cfg):
            s.close()
