"""GCP spot / preemptible VM notices from the metadata server (see :mod:`ckrun.cloud`)."""

from __future__ import annotations

import os
import urllib.parse

from ckrun.notices import PREEMPTION, Notice

from .poller import Poller, Transient, Unexpected, request


class GcpPreemptionSource(Poller):
    """GCP spot / preemptible VM notice from ``instance/preempted`` (module docstring).

    Args:
        host: metadata ``host[:port]``; default ``GCE_METADATA_HOST``,
            ``GCE_METADATA_ROOT``, then ``metadata.google.internal``.
        lead_s: deadline = detection + ``lead_s`` (GCP gives about 30 s).
        wait_for_change: use the hanging GET (one request open at a time, instant
            detection); else poll every ``interval_s``.
        hang_s: ``timeout_sec`` of each hanging GET, seconds.
        interval_s: polling period, and back-off after a failure (seconds).
        timeout_s: connect/read timeout of plain requests (seconds).
    """

    name = "gcp"
    _HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(
        self,
        host: str | None = None,
        *,
        lead_s: float = 30.0,
        wait_for_change: bool = True,
        hang_s: float = 60.0,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        start: bool = True,
    ) -> None:
        h = host or os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_ROOT")
        h = (h or "metadata.google.internal").removeprefix("http://").rstrip("/")
        self.url = f"http://{h}/computeMetadata/v1/instance/preempted"
        self.lead_s = lead_s
        self.wait_for_change = wait_for_change
        self.hang_s = hang_s
        self._etag: str | None = None
        super().__init__(interval_s=interval_s, timeout_s=timeout_s, start=start)

    def _round(self) -> float:
        hanging = self.wait_for_change and self._etag is not None
        url, timeout = self.url, self.timeout_s
        if hanging:
            q = urllib.parse.urlencode(
                {
                    "wait_for_change": "true",
                    "last_etag": self._etag,
                    "timeout_sec": int(self.hang_s),
                }
            )
            url, timeout = f"{url}?{q}", self.hang_s + self.timeout_s + 1.0
        try:
            status, headers, body = request(
                url, headers=self._HEADERS, timeout_s=timeout, conn_holder=self._conn
            )
        except Transient:
            self._etag = None  # re-learn the current value with a plain GET first
            raise
        if status != 200:
            raise Unexpected(f"instance/preempted answered HTTP {status}: is this a GCE VM?")
        if headers.get("Metadata-Flavor") != "Google":
            raise Unexpected("instance/preempted answer lacks 'Metadata-Flavor: Google'")
        self._etag = headers.get("ETag")
        if body.decode().strip().upper() == "TRUE":
            self._emit(
                "preempted",
                Notice.with_lead(PREEMPTION, self.name, self.lead_s, {"preempted": "TRUE"}),
            )
        return 0.0 if (self.wait_for_change and self._etag) else self.interval_s
