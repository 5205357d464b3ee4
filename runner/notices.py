"""Interruption notices and the sources that produce them.

A :class:`Notice` is the one shape every interruption takes on its way to the supervisor:
a signal (SIGTERM, Slurm's ``--signal`` lead-time USR1), a cloud metadata notice (AWS
``spot/instance-action``, GCP ``instance/preempted``, Azure Scheduled Events ``Preempt``),
a time limit read from the scheduler, or a ``ckrun preempt`` drill.

The deadline comes from the notice's own time field when it has one (AWS ``time``, Azure
``NotBefore``), else detection time plus the configured lead time.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ckrun.enums import StrEnum


class NoticeKind(StrEnum):
    """What a notice announces."""

    PREEMPTION = "preemption"  # capacity is being taken away (spot, Slurm preemption, drain)
    TIME_LIMIT = "time_limit"  # the allocation's time limit approaches
    TERMINATION = "termination"  # a plain SIGTERM from whoever owns the process
    DRILL = "drill"  # `ckrun preempt`: a test of the resume path
    REBALANCE = "rebalance"  # early warning (AWS rebalance recommendation)


PREEMPTION = NoticeKind.PREEMPTION
TIME_LIMIT = NoticeKind.TIME_LIMIT
TERMINATION = NoticeKind.TERMINATION
DRILL = NoticeKind.DRILL
REBALANCE = NoticeKind.REBALANCE

KINDS = tuple(NoticeKind)


def utcnow() -> dt.datetime:
    """Timezone-aware current UTC time."""
    return dt.datetime.now(dt.timezone.utc)


def iso_utc(t: dt.datetime) -> str:
    """ISO-8601 UTC with a ``Z`` suffix, millisecond precision."""
    return t.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_utc(s: str) -> dt.datetime:
    """Parse an ISO-8601 timestamp (``Z`` or offset); naive values are taken as UTC."""
    t = dt.datetime.fromisoformat(s.strip().replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class Notice:
    """One interruption notice.

    Attributes:
        kind: a :class:`NoticeKind`.
        source: where it came from, e.g. ``"signal:SIGTERM"``, ``"aws"``, ``"gcp"``,
            ``"azure"``, ``"slurm:time_limit"``, ``"cli"``.
        detected_at: UTC time the notice was seen.
        deadline_utc: UTC time after which the process may be killed.
        detail: source-specific fields (the raw document, signal number, ...).
    """

    kind: NoticeKind
    source: str
    detected_at: dt.datetime
    deadline_utc: dt.datetime
    detail: dict[str, Any] = field(default_factory=dict)

    def seconds_left(self, now: dt.datetime | None = None) -> float:
        """Seconds until the deadline (negative once it has passed)."""
        return (self.deadline_utc - (now or utcnow())).total_seconds()

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the ``notice.json`` body)."""
        return {
            "kind": self.kind,
            "source": self.source,
            "detected_at": iso_utc(self.detected_at),
            "deadline_utc": iso_utc(self.deadline_utc),
            "detail": self.detail,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Notice:
        """Inverse of :meth:`to_json`; raises ``KeyError``/``ValueError`` on bad input
        (an unknown kind is a ``ValueError``)."""
        return cls(
            kind=NoticeKind(d["kind"]),
            source=str(d["source"]),
            detected_at=parse_utc(d["detected_at"]),
            deadline_utc=parse_utc(d["deadline_utc"]),
            detail=dict(d.get("detail") or {}),
        )

    @classmethod
    def with_lead(
        cls, kind: str, source: str, lead_s: float, detail: dict[str, Any] | None = None
    ) -> Notice:
        """A notice of ``kind`` (a :class:`NoticeKind` or its value) detected now whose
        deadline is ``lead_s`` seconds away.

        Raises:
            ValueError: an unknown kind.
        """
        now = utcnow()
        return cls(
            NoticeKind(kind), source, now, now + dt.timedelta(seconds=lead_s), dict(detail or {})
        )


#: A stated lead this much shorter than the provider's window is implausible by the local
#: clock (detection lags the notice by a poll interval, not by most of the window).
MIN_PLAUSIBLE_FRACTION = 0.25
#: Stated leads up to this many seconds beyond the window are still believed (rounding).
WINDOW_TOLERANCE_S = 5.0


def believed_lead(notice: Notice, window_s: float | None) -> tuple[float, str | None]:
    """Seconds from detection to the deadline that the supervisor believes.

    A cloud notice states its deadline in UTC; a skewed local clock (or a late
    detection) can make it look already past or implausibly close, which would leave no
    time to save.  The stated lead ``deadline_utc - detected_at`` is believed only when
    it lies within the provider's documented window ``window_s`` (AWS spot: 120 s, GCP:
    30 s, Azure: the configured ``NotBefore`` lead), between
    ``MIN_PLAUSIBLE_FRACTION * window_s`` and ``window_s + WINDOW_TOLERANCE_S``;
    otherwise the window counts from detection and the skew is reported.

    Args:
        notice: the notice (its ``detected_at`` is the local detection time).
        window_s: the provider's documented window, seconds; None believes any lead
            (signals and requests, whose deadline is set locally).

    Returns:
        ``(lead_s, skew_message)``; the message is None when the stated time was believed.
    """
    stated = (notice.deadline_utc - notice.detected_at).total_seconds()
    if window_s is None or window_s <= 0:
        return max(0.0, stated), None
    if MIN_PLAUSIBLE_FRACTION * window_s <= stated <= window_s + WINDOW_TOLERANCE_S:
        return stated, None
    return float(window_s), (
        f"notice {notice.source} states a deadline {stated:+.1f} s from its detection "
        f"(local clock skewed or detection late); using the documented {window_s:g} s "
        "window from detection"
    )


@runtime_checkable
class NoticeSource(Protocol):
    """Something the supervisor polls for notices.

    ``poll`` must return quickly (it runs on the supervisor's loop, which ticks a few
    times a second); a source that does network I/O rate-limits itself with
    ``interval_s`` and never raises on transient errors (it counts and logs them).
    """

    name: str
    interval_s: float

    def poll(self) -> Notice | None:
        """Return a new notice, or None. A source reports each notice once."""
        ...

    def close(self) -> None:
        """Release resources (threads, sockets)."""
        ...
