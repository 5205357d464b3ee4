"""Azure Scheduled Events (spot eviction ``Preempt``) notices (see :mod:`ckrun.cloud`)."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Sequence

from ckrun.notices import PREEMPTION, TERMINATION, Notice, utcnow

from .poller import Poller, Unexpected, parse_time, request


class AzureScheduledEventsSource(Poller):
    """Azure Scheduled Events (``Preempt`` / ``Terminate``) for this VM (module docstring).

    Args:
        endpoint: IMDS base URL; default ``CKRUN_AZURE_METADATA_ENDPOINT`` or
            ``http://169.254.169.254``.
        event_types: EventType values that become notices (``Preempt`` → preemption,
            ``Terminate`` → termination, others → preemption).
        vm_name: keep only events whose ``Resources`` name this VM; default: asked once
            from ``/metadata/instance/compute/name`` (no filter if that is unavailable).
        lead_s: deadline when ``NotBefore`` is empty (event already started), seconds.
    """

    name = "azure"
    API = "2020-07-01"
    _HEADERS = {"Metadata": "true"}

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        event_types: Sequence[str] = ("Preempt", "Terminate"),
        vm_name: str | None = None,
        lead_s: float = 30.0,
        start: bool = True,
    ) -> None:
        ep = endpoint or os.environ.get("CKRUN_AZURE_METADATA_ENDPOINT") or "http://169.254.169.254"
        self.endpoint = ep.rstrip("/")
        self.event_types = tuple(event_types)
        self.vm_name = vm_name
        self._vm_name_known = vm_name is not None
        self.lead_s = lead_s
        super().__init__(interval_s=interval_s, timeout_s=timeout_s, start=start)

    def _lookup_vm_name(self) -> None:
        status, _, body = request(
            f"{self.endpoint}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
            headers=self._HEADERS,
            timeout_s=self.timeout_s,
        )
        self._vm_name_known = True
        name = body.decode().strip() if status == 200 else ""
        self.vm_name = name or None

    def _round(self) -> float:
        if not self._vm_name_known:
            self._lookup_vm_name()
        status, _, body = request(
            f"{self.endpoint}/metadata/scheduledevents?api-version={self.API}",
            headers=self._HEADERS,
            timeout_s=self.timeout_s,
        )
        if status != 200:
            raise Unexpected(f"scheduledevents answered HTTP {status}")
        doc = json.loads(body)
        for ev in doc.get("Events") or []:
            etype = str(ev.get("EventType", ""))
            resources = [str(r) for r in ev.get("Resources") or []]
            if etype not in self.event_types:
                continue
            if self.vm_name and resources and self.vm_name not in resources:
                continue
            now = utcnow()
            deadline = parse_time(
                str(ev.get("NotBefore") or ""), now + dt.timedelta(seconds=self.lead_s)
            )
            kind = TERMINATION if etype == "Terminate" else PREEMPTION
            detail = {k: ev.get(k) for k in ("EventId", "EventType", "NotBefore", "EventStatus")}
            detail["DocumentIncarnation"] = doc.get("DocumentIncarnation")
            self._emit(f"event:{ev.get('EventId')}", Notice(kind, self.name, now, deadline, detail))
        return self.interval_s
