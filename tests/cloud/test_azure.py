"""Azure Scheduled Events poller against the loopback IMDS."""

from __future__ import annotations

import http.client

from ckrun.cloud import AzureScheduledEventsSource
from ckrun.notices import PREEMPTION, TERMINATION
from metaservers import AzureImds, wait_notice, wait_until


def test_stub_requires_metadata_header(azure: AzureImds) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", azure.port, timeout=2)
    conn.request("GET", "/metadata/scheduledevents?api-version=2020-07-01")
    assert conn.getresponse().status == 400


def test_preempt_deadline_is_not_before(azure: AzureImds, closing) -> None:
    src = closing(AzureScheduledEventsSource(azure.url, interval_s=0.05))
    wait_until(lambda: src.stats["rounds"] >= 2)
    assert src.poll() is None
    nb = azure.schedule("Preempt", not_before_s=30)
    n = wait_notice(src)
    assert (n.kind, n.source, n.deadline_utc) == (PREEMPTION, "azure", nb)
    assert n.detail["EventType"] == "Preempt" and n.detail["EventId"]
    rounds = src.stats["rounds"]
    wait_until(lambda: src.stats["rounds"] >= rounds + 3)
    assert src.poll() is None  # each EventId once


def test_other_vms_and_other_event_types_ignored(azure: AzureImds, closing) -> None:
    src = closing(AzureScheduledEventsSource(azure.url, interval_s=0.05))
    azure.schedule("Preempt", resources=["some-other-vm"])
    azure.schedule("Freeze")
    wait_until(lambda: src.stats["rounds"] >= 4)
    assert src.vm_name == "vm-0"  # learnt from instance/compute/name
    assert src.poll() is None
    azure.schedule("Terminate", not_before_s=60)
    assert wait_notice(src).kind == TERMINATION


def test_pending_at_start_and_5xx_burst(azure: AzureImds, closing) -> None:
    azure.schedule("Preempt", not_before_s=45)
    azure.fail_next(3, status=502)
    src = closing(AzureScheduledEventsSource(azure.url, interval_s=0.05))
    n = wait_notice(src)
    assert 40 < n.seconds_left() <= 45
    assert src.stats["errors"] >= 1


def test_endpoint_from_env(azure: AzureImds, closing, monkeypatch) -> None:
    monkeypatch.setenv("CKRUN_AZURE_METADATA_ENDPOINT", azure.url)
    azure.schedule("Preempt")
    wait_notice(closing(AzureScheduledEventsSource(interval_s=0.05)))
