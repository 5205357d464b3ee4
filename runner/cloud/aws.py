"""AWS EC2 spot interruption notices over IMDSv2 (see :mod:`ckrun.cloud`)."""

from __future__ import annotations

import datetime as dt
import json
import os
import time

from ckrun.errors import ConfigError
from ckrun.notices import PREEMPTION, REBALANCE, Notice, utcnow

from .poller import Poller, Transient, Unexpected, parse_time, request


class AwsSpotSource(Poller):
    """AWS EC2 spot interruption notice over IMDSv2 (see the module docstring).

    Args:
        endpoint: IMDS base URL; default ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` or
            ``http://169.254.169.254`` (``http://[fd00:ec2::254]`` in IPv6 mode).
        interval_s: seconds between checks (AWS's guidance: 5).
        timeout_s: per-request timeout, seconds.
        token_ttl_s: requested token lifetime, seconds (1..21600); refreshed at 90 % of
            it and on any 401.
        rebalance: also report ``events/recommendations/rebalance`` as a ``rebalance``
            notice (deadline detection + ``lead_s``: the interruption could follow).
        lead_s: deadline when the document has no usable ``time`` (seconds).
    """

    name = "aws"

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 1.0,
        token_ttl_s: int = 21600,
        rebalance: bool = False,
        lead_s: float = 120.0,
        start: bool = True,
    ) -> None:
        self.endpoint = (endpoint or aws_default_endpoint()).rstrip("/")
        self.token_ttl_s = int(token_ttl_s)
        if not 1 <= self.token_ttl_s <= 21600:
            raise ConfigError("aws_token_ttl_s must be within 1..21600 (IMDSv2's limits)")
        self.rebalance = rebalance
        self.lead_s = lead_s
        self._token: str | None = None
        self._token_refresh_at = 0.0
        super().__init__(interval_s=interval_s, timeout_s=timeout_s, start=False)
        self.stats.update(token_fetches=0, unauthorized=0)
        if start:
            self.start()

    def _fetch_token(self) -> str:
        status, _, body = request(
            f"{self.endpoint}/latest/api/token",
            method="PUT",
            timeout_s=self.timeout_s,
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
        )
        if status != 200 or not body:
            raise Unexpected(
                f"IMDSv2 token PUT answered HTTP {status}: IMDS may be disabled on this "
                "instance or the hop limit too low for a container (set "
                "HttpPutResponseHopLimit >= 2) -- or drop 'aws' from notice_sources"
            )
        self.stats["token_fetches"] += 1
        self._token = body.decode().strip()
        self._token_refresh_at = time.monotonic() + 0.9 * self.token_ttl_s
        return self._token

    def _get(self, path: str) -> tuple[int, bytes]:
        """GET a meta-data path with a valid token; on 401 refresh once and retry."""
        for attempt in (0, 1):
            token = self._token
            if token is None or time.monotonic() >= self._token_refresh_at:
                token = self._fetch_token()
            status, _, body = request(
                f"{self.endpoint}/latest/meta-data/{path}",
                timeout_s=self.timeout_s,
                headers={"X-aws-ec2-metadata-token": token},
            )
            if status != 401:
                return status, body
            self.stats["unauthorized"] += 1
            self._token = None
            if attempt:
                raise Transient(f"IMDSv2 {path}: 401 with a fresh token")
        raise AssertionError("unreachable")

    def _round(self) -> float:
        status, body = self._get("spot/instance-action")
        if status == 200:
            doc = json.loads(body)
            now = utcnow()
            fallback = now + dt.timedelta(seconds=self.lead_s)
            deadline = parse_time(str(doc.get("time", "")), fallback)
            detail = {"action": doc.get("action"), "time": doc.get("time")}
            self._emit(
                f"action:{doc.get('action')}:{doc.get('time')}",
                Notice(PREEMPTION, self.name, now, deadline, detail),
            )
        elif status != 404:
            raise Unexpected(f"spot/instance-action answered HTTP {status}")
        if self.rebalance:
            status, body = self._get("events/recommendations/rebalance")
            if status == 200:
                doc = json.loads(body)
                self._emit(
                    f"rebalance:{doc.get('noticeTime')}",
                    Notice.with_lead(
                        REBALANCE, self.name, self.lead_s, {"noticeTime": doc.get("noticeTime")}
                    ),
                )
            elif status != 404:
                raise Unexpected(f"events/recommendations/rebalance answered HTTP {status}")
        return self.interval_s


def aws_default_endpoint() -> str:
    """The IMDS base URL botocore would use (``AWS_EC2_METADATA_SERVICE_ENDPOINT[_MODE]``)."""
    ep = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT")
    if ep:
        return ep
    if os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE", "").lower() == "ipv6":
        return "http://[fd00:ec2::254]"
    return "http://169.254.169.254"
