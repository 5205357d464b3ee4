"""GCP instance/preempted poller against the loopback metadata server."""

from __future__ import annotations

import http.client
import time

from ckrun.cloud import GcpPreemptionSource
from ckrun.notices import PREEMPTION, utcnow
from metaservers import GcpMetadata, free_port, wait_notice, wait_until


def test_stub_requires_metadata_flavor(gcp: GcpMetadata) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", gcp.port, timeout=2)
    conn.request("GET", GcpMetadata.PATH)
    assert conn.getresponse().status == 403


def test_hanging_get_sees_preemption_at_once(gcp: GcpMetadata, closing) -> None:
    src = closing(GcpPreemptionSource(f"127.0.0.1:{gcp.port}", interval_s=30.0, lead_s=30))
    wait_until(lambda: gcp.hanging == 1)  # start-up GET done, hanging GET open
    assert src.poll() is None
    t0 = time.monotonic()
    gcp.preempt()
    n = wait_notice(src, timeout_s=10)
    assert time.monotonic() - t0 < 10  # not the 30 s polling interval
    assert (n.kind, n.source, n.detail["preempted"]) == (PREEMPTION, "gcp", "TRUE")
    assert 29 < n.seconds_left() <= 30
    assert gcp.count("GET", GcpMetadata.PATH) <= 3  # no busy polling


def test_preempted_already_at_start(closing) -> None:
    srv = GcpMetadata(preempted=True)
    try:
        t0 = utcnow()
        src = closing(GcpPreemptionSource(f"127.0.0.1:{srv.port}", interval_s=30.0))
        n = wait_notice(src, timeout_s=2)
        assert (n.detected_at - t0).total_seconds() < 1.0  # the start-up round saw it
    finally:
        srv.close()


def test_change_while_disconnected_not_missed(closing) -> None:
    """Endpoint down (refused), flips to TRUE while down: seen once it answers again."""
    port = free_port()
    src = closing(GcpPreemptionSource(f"127.0.0.1:{port}", interval_s=0.05))
    wait_until(lambda: src.stats["errors"] >= 2)
    srv = GcpMetadata(port, preempted=True)
    try:
        wait_notice(src)
        assert src.stats["consecutive_errors"] == 0
    finally:
        srv.close()


def test_5xx_burst_then_notice(gcp: GcpMetadata, closing) -> None:
    gcp.fail_next(5, status=500)
    src = closing(GcpPreemptionSource(f"127.0.0.1:{gcp.port}", interval_s=0.05))
    wait_until(lambda: src.stats["errors"] >= 5)
    gcp.preempt()
    wait_notice(src)


def test_polling_mode(gcp: GcpMetadata, closing) -> None:
    src = closing(
        GcpPreemptionSource(f"127.0.0.1:{gcp.port}", wait_for_change=False, interval_s=0.05)
    )
    wait_until(lambda: src.stats["rounds"] >= 3)
    assert gcp.hanging == 0
    gcp.preempt()
    wait_notice(src)


def test_close_aborts_hanging_get(gcp: GcpMetadata) -> None:
    src = GcpPreemptionSource(f"127.0.0.1:{gcp.port}", hang_s=60)
    wait_until(lambda: gcp.hanging == 1)
    t0 = time.monotonic()
    src.close()
    assert time.monotonic() - t0 < 10  # not the 60 s hanging GET
    assert src._thread is not None and not src._thread.is_alive()


def test_host_from_google_auth_env(gcp: GcpMetadata, closing, monkeypatch) -> None:
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{gcp.port}")
    gcp.preempt()
    wait_notice(closing(GcpPreemptionSource()))
