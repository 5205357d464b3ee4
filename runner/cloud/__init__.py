"""Cloud interruption notices: AWS IMDSv2, GCP metadata and Azure Scheduled Events.

Each source implements :class:`ckrun.notices.NoticeSource`.  Network I/O runs on one
daemon thread per source, so :meth:`poll` on the supervisor's loop only drains a queue
and never blocks; the thread's first round runs at construction, so a notice that is
already pending when ckrun starts is seen at once.  Transient failures (timeouts,
connection refused, 5xx, 429) are counted in ``Poller.stats`` and logged, never
raised; the next round simply asks again, so a notice is not missed once the endpoint
answers again.  Each notice is reported once.

Protocols (public cloud documentation):

* AWS IMDSv2 ("Use instance metadata service v2", "Spot Instance interruption
  notices"): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
  gives a token sent as ``X-aws-ec2-metadata-token``; a 401 means the token is invalid or
  expired.  ``GET /latest/meta-data/spot/instance-action`` is 404 until an interruption
  is scheduled, then 200 ``{"action": "terminate|stop|hibernate", "time": ISO-8601}``;
  the deadline is ``time`` (about 120 s after the notice).  AWS asks for a check every
  5 s.  ``events/recommendations/rebalance`` (200 ``{"noticeTime"}``) is an early
  warning with no deadline of its own.  Endpoint override as botocore:
  ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (and ``..._ENDPOINT_MODE=IPv6``).
* GCP ("Detect if a VM was preempted"): ``GET /computeMetadata/v1/instance/preempted``
  with ``Metadata-Flavor: Google`` answers ``TRUE``/``FALSE``; ``wait_for_change=true``
  with ``last_etag`` hangs until the value differs from that ETag, so a change that
  happened while we were not connected is returned at once.  No deadline field: the
  deadline is detection + ``gcp_notice_lead_s`` (30 s).  Host override as google-auth:
  ``GCE_METADATA_HOST`` (then the older ``GCE_METADATA_ROOT``).
* Azure ("Scheduled Events for Linux VMs"): ``GET
  /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``; a
  ``Preempt`` event (spot eviction, >= 30 s notice) carries ``NotBefore`` (RFC 1123) as
  the deadline.  Events of every VM in the availability set / scale-set placement group
  are listed, so events are filtered on ``Resources`` containing this VM's name
  (``/metadata/instance/compute/name``).  Override: ``CKRUN_AZURE_METADATA_ENDPOINT``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from ckrun.errors import ConfigError
from ckrun.notices import NoticeSource
from ckrun.options import coerce_fields

from .aws import AwsSpotSource, aws_default_endpoint
from .azure import AzureScheduledEventsSource
from .gcp import GcpPreemptionSource

__all__ = [
    "CLOUD_SOURCES",
    "AwsSpotSource",
    "AzureScheduledEventsSource",
    "CloudOptions",
    "GcpPreemptionSource",
    "aws_default_endpoint",
    "build_sources",
]

#: Source names :func:`build_sources` accepts (profile key ``notice_sources``).
CLOUD_SOURCES = ("aws", "gcp", "azure")


@dataclass(frozen=True)
class CloudOptions:
    """Profile keys of the cloud notice sources (flat YAML, all optional).

    Endpoints: the ecosystem's environment variable wins over the profile key, which wins
    over the default (DESIGN.md §4 precedence: env > profile > default).
    """

    aws_metadata_endpoint: str | None = None
    aws_poll_interval_s: float = 5.0
    aws_token_ttl_s: int = 21600
    checkpoint_on_rebalance: bool = False
    gcp_metadata_host: str | None = None
    gcp_notice_lead_s: float = 30.0
    gcp_wait_for_change: bool = True
    gcp_poll_interval_s: float = 1.0
    azure_metadata_endpoint: str | None = None
    azure_poll_interval_s: float = 1.0
    azure_event_types: tuple[str, ...] = ("Preempt", "Terminate")
    azure_vm_name: str | None = None
    metadata_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        """Coerce every value to its field's type (:func:`ckrun.options.coerce`).

        Raises:
            ConfigError: a value that does not convert, naming its key.
        """
        coerce_fields(self)

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> CloudOptions:
        """Pick this dataclass's keys out of a (larger) resolved config mapping.

        Raises:
            ConfigError: a poll interval under the floor (AWS 5 s, others 1 s) or a
                non-positive timeout.
        """
        names = {f.name for f in fields(cls)}
        opts = cls(**{k: v for k, v in config.items() if k in names and v is not None})
        for key, floor in (
            ("aws_poll_interval_s", 5.0),
            ("gcp_poll_interval_s", 1.0),
            ("azure_poll_interval_s", 1.0),
        ):
            if float(getattr(opts, key)) < floor:
                raise ConfigError(
                    f"{key}={getattr(opts, key)} is below {floor} s: the "
                    f"metadata services rate-limit callers; use >= {floor}"
                )
        if opts.metadata_timeout_s <= 0:
            raise ConfigError("metadata_timeout_s must be > 0 (seconds)")
        return opts


def build_sources(names: Sequence[str], config: Mapping[str, Any]) -> list[NoticeSource]:
    """Create and start the cloud notice sources named in ``notice_sources``.

    Args:
        names: subset of :data:`CLOUD_SOURCES` (case-insensitive, duplicates ignored).
        config: the resolved run config; the :class:`CloudOptions` keys are read from it,
            other keys ignored.

    Returns:
        Started sources, in the order named; each has already begun its first poll.

    Raises:
        ConfigError: an unknown source name or an invalid option.
    """
    opts = CloudOptions.from_mapping(config)
    t = opts.metadata_timeout_s
    out: list[NoticeSource] = []
    for name in dict.fromkeys(n.strip().lower() for n in names):
        if name == "aws":
            out.append(
                AwsSpotSource(
                    os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT")
                    or opts.aws_metadata_endpoint,
                    interval_s=opts.aws_poll_interval_s,
                    timeout_s=t,
                    token_ttl_s=opts.aws_token_ttl_s,
                    rebalance=opts.checkpoint_on_rebalance,
                )
            )
        elif name == "gcp":
            out.append(
                GcpPreemptionSource(
                    os.environ.get("GCE_METADATA_HOST") or opts.gcp_metadata_host,
                    lead_s=opts.gcp_notice_lead_s,
                    wait_for_change=opts.gcp_wait_for_change,
                    interval_s=opts.gcp_poll_interval_s,
                    timeout_s=t,
                )
            )
        elif name == "azure":
            out.append(
                AzureScheduledEventsSource(
                    os.environ.get("CKRUN_AZURE_METADATA_ENDPOINT") or opts.azure_metadata_endpoint,
                    interval_s=opts.azure_poll_interval_s,
                    timeout_s=t,
                    event_types=opts.azure_event_types,
                    vm_name=opts.azure_vm_name,
                )
            )
        else:
            for src in out:
                src.close()
            raise ConfigError(
                f"unknown notice source {name!r} in notice_sources: "
                f"valid are {', '.join(CLOUD_SOURCES)}"
            )
    return out
