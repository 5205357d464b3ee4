"""The run's lease as ``ckrun status`` shows it: who holds the run, read-only.

Reads ``locks/lease.json`` from the run's storage (:func:`ckrun.checkpoint.lease_record.
read_lease`; the protocol is in :mod:`ckrun.checkpoint.lease`) and reports the holder
(host, pid, job id, attempt), the epoch, the TTL, how long ago the holder last renewed
and whether the lease has expired.

Clocks.  A takeover never compares wall clocks across machines (an acquirer watches the
version for a TTL on its own monotonic clock), but a one-shot ``status`` cannot watch
for a TTL; the lease's ``renewed_utc``/``expires_utc`` are written for exactly this
(people reading ``status``).  So ``since_renewal_s`` is this machine's clock minus the
holder's ``renewed_utc`` ("as observed" here: a skew between the two clocks shifts it),
and the lease is reported expired when it is released (no holder), when its holder ran on
this machine and its process is gone (the same rule that lets a local successor take over
at once), or when this machine's clock is past ``expires_utc`` (silent for its TTL).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from ckrun.checkpoint.lease_record import LeaseRecord, read_lease
from ckrun.errors import CkrunError
from ckrun.notices import parse_utc, utcnow
from ckrun.storage.base import Storage


def lease_numbers(rec: LeaseRecord, now: dt.datetime | None = None) -> dict[str, Any]:
    """The lease record as numbers and names (``status --json``'s ``lease``).

    Keys: ``epoch``; ``holder`` (``host``, ``pid``, ``job_id``, ``attempt``, ``machine``)
    or None when released; ``ttl_s``; ``renewals``; ``renewed_utc``; ``expires_utc``;
    ``since_renewal_s`` (seconds, this machine's clock minus ``renewed_utc``; None when
    unparsable); ``expired`` (bool); ``expired_by`` (``released``, ``holder_gone``,
    ``ttl`` or None).
    """
    t = now or utcnow()
    since: float | None
    past_expiry = False
    try:
        since = round((t - parse_utc(rec.renewed_utc)).total_seconds(), 3)
        past_expiry = t > parse_utc(rec.expires_utc)
    except ValueError:
        since = None
    h = rec.holder
    if h is None:
        by: str | None = "released"
    elif h.provably_dead():
        by = "holder_gone"
    elif past_expiry:
        by = "ttl"
    else:
        by = None
    return {
        "epoch": rec.epoch,
        "holder": None
        if h is None
        else {
            "host": h.host,
            "pid": h.pid,
            "job_id": h.job_id,
            "attempt": h.attempt,
            "machine": h.machine,
        },
        "ttl_s": rec.ttl_s,
        "renewals": rec.renewals,
        "renewed_utc": rec.renewed_utc,
        "expires_utc": rec.expires_utc,
        "since_renewal_s": since,
        "expired": by is not None,
        "expired_by": by,
    }


def lease_view(storage: Storage, now: dt.datetime | None = None) -> dict[str, Any] | None:
    """:func:`lease_numbers` of the run's lease; None when the run has no lease object;
    ``{"error": message}`` when it cannot be read (``status`` never fails on it)."""
    try:
        found = read_lease(storage)
    except (CkrunError, OSError) as e:
        return {"error": str(e)}
    return None if found is None else lease_numbers(found[0], now)


def lease_line(v: dict[str, Any] | None) -> str | None:
    """One line for the terminal ``status`` (None when the run has no lease)."""
    if v is None:
        return None
    if "error" in v:
        return f"lease: cannot be read ({v['error']})"
    h = v["holder"]
    if h is None:
        return f"lease: epoch {v['epoch']}, released (no holder)"
    job = f", job {h['job_id']}" if h["job_id"] else ""
    since = "?" if v["since_renewal_s"] is None else f"{v['since_renewal_s']:.1f} s"
    state = {
        None: "live",
        "ttl": "EXPIRED (silent for longer than its TTL)",
        "holder_gone": "EXPIRED (its process on this machine is gone)",
    }[v["expired_by"]]
    return (
        f"lease: epoch {v['epoch']}, held by host {h['host']} pid {h['pid']}{job} "
        f"attempt {h['attempt']}; renewed {since} ago by this machine's clock "
        f"(TTL {v['ttl_s']:g} s, {v['renewals']} renewals): {state}"
    )
