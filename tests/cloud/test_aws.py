"""AWS IMDSv2 spot notice poller against the loopback IMDS (tests/cloud/metaservers.py)."""

from __future__ import annotations

import http.client
import time

import pytest
from ckrun.cloud import AwsSpotSource
from ckrun.notices import PREEMPTION, REBALANCE
from metaservers import AwsImds, free_port, wait_notice, wait_until


def test_stub_refuses_imdsv1_and_missing_ttl(aws: AwsImds) -> None:
    """The stub behaves like IMDS with HttpTokens=required, so passing tests mean v2."""
    conn = http.client.HTTPConnection("127.0.0.1", aws.port, timeout=2)
    conn.request("GET", "/latest/meta-data/spot/instance-action")
    assert conn.getresponse().status == 401
    conn = http.client.HTTPConnection("127.0.0.1", aws.port, timeout=2)
    conn.request("PUT", "/latest/api/token")
    assert conn.getresponse().status == 400


def test_notice_once_with_deadline_from_time_field(aws: AwsImds, closing) -> None:
    src = closing(AwsSpotSource(aws.url, interval_s=0.05))
    wait_until(lambda: src.stats["rounds"] >= 3)
    assert src.poll() is None  # 404: nothing scheduled
    deadline = aws.arm(deadline_s=120, action="stop")
    n = wait_notice(src)
    assert (n.kind, n.source) == (PREEMPTION, "aws")
    assert n.deadline_utc == deadline
    assert n.detail["action"] == "stop"
    assert 115 < n.seconds_left() <= 120
    rounds = src.stats["rounds"]
    wait_until(lambda: src.stats["rounds"] >= rounds + 3)
    assert src.poll() is None  # reported once
    assert src.stats["errors"] == 0


def test_notice_already_pending_at_start(aws: AwsImds, closing) -> None:
    aws.arm(deadline_s=90)
    t0 = time.monotonic()
    src = closing(AwsSpotSource(aws.url, interval_s=60.0))  # only the start-up round counts
    n = wait_notice(src, timeout_s=10)
    assert time.monotonic() - t0 < 10  # the start-up round, not the 60 s interval
    assert src.stats["rounds"] == 1
    assert 85 < n.seconds_left() <= 90


def test_token_refreshed_before_expiry_and_on_401(aws: AwsImds, closing) -> None:
    aws.expiry_grace_s = 0.5  # tokens live 1.5 s: a client that waited for its 401 gets one
    src = closing(AwsSpotSource(aws.url, interval_s=0.05, token_ttl_s=1))
    wait_until(lambda: src.stats["token_fetches"] >= 3, timeout_s=6)  # ~every 0.9 s
    assert aws.unauthorized == 0  # refreshed before the server expired it
    aws.revoke_tokens()  # token dies mid-run: 401, refresh, same round continues
    deadline = aws.arm(deadline_s=120)
    assert wait_notice(src).deadline_utc == deadline
    assert aws.unauthorized >= 1
    assert src.stats["unauthorized"] >= 1
    assert src.stats["errors"] == 0


def test_5xx_burst_counted_then_notice(aws: AwsImds, closing) -> None:
    aws.fail_next(8, status=503)
    src = closing(AwsSpotSource(aws.url, interval_s=0.05))
    wait_until(lambda: src.stats["errors"] >= 3)
    deadline = aws.arm(deadline_s=120)
    assert wait_notice(src).deadline_utc == deadline
    assert src.stats["errors"] >= 3
    assert src.stats["consecutive_errors"] == 0
    assert "503" in (src.stats["last_error"] or "")


def test_slow_endpoint_never_blocks_poll(aws: AwsImds, closing) -> None:
    aws.delay_s = 0.6  # slower than the client's timeout
    src = closing(AwsSpotSource(aws.url, interval_s=0.05, timeout_s=0.2))
    wait_until(lambda: src.stats["errors"] >= 2)
    t0 = time.perf_counter()
    for _ in range(100):
        assert src.poll() is None
    assert time.perf_counter() - t0 < 0.5  # poll() only drains a queue: no 0.6 s request
    aws.delay_s = 0.0
    aws.arm(deadline_s=120)
    wait_notice(src)


def test_connection_refused_until_endpoint_appears(closing) -> None:
    port = free_port()
    src = closing(AwsSpotSource(f"http://127.0.0.1:{port}", interval_s=0.05))
    wait_until(lambda: src.stats["errors"] >= 2)
    srv = AwsImds(port)
    try:
        srv.arm(deadline_s=100)
        n = wait_notice(src)
        assert 95 < n.seconds_left() <= 100
    finally:
        srv.close()


def test_rebalance_recommendation_when_enabled(aws: AwsImds, closing) -> None:
    src = closing(AwsSpotSource(aws.url, interval_s=0.05, rebalance=True))
    aws.arm_rebalance()
    n = wait_notice(src)
    assert n.kind == REBALANCE and n.detail["noticeTime"]
    aws.arm(deadline_s=120)
    assert wait_notice(src).kind == PREEMPTION


def test_endpoint_from_botocore_env(aws: AwsImds, closing, monkeypatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", aws.url + "/")
    aws.arm(deadline_s=120)
    src = closing(AwsSpotSource(interval_s=0.05))
    assert src.endpoint == aws.url
    wait_notice(src)


def test_invalid_ttl_rejected() -> None:
    from ckrun.errors import ConfigError

    with pytest.raises(ConfigError, match="21600"):
        AwsSpotSource("http://127.0.0.1:1", token_ttl_s=0, start=False)
