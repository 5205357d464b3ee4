"""The run's lease: one owner per run across machines, and fencing (DESIGN.md §7).

The lease is the object ``locks/lease.json`` in the run's storage (for a two-tier
storage, in its durable remote tier), strict JSON::

    {"format": "ckrun.lease", "format_version": 1, "run": "r1", "epoch": 7,
     "holder": {"host", "pid", "job_id", "attempt", "machine", "started", "token"} | null,
     "ttl_s": 60.0, "renewals": 12, "acquired_utc", "renewed_utc", "expires_utc"}

Protocol, on every backend through the Storage protocol's conditional writes:

* **acquire**: no lease object → conditional create with epoch 1 (``If-None-Match: *``,
  ``link(2)``); a released lease (``holder`` null) → compare-and-swap to ``epoch + 1`` at
  once; a held lease → taken over with ``epoch + 1`` only once it *expired* (below), by a
  compare-and-swap on the version that was watched.  Losing any of these races (another
  acquirer, or the holder renewing) re-reads and starts over: exactly one wins.
* **renew** (the holder's heartbeat, every ``heartbeat_s``): compare-and-swap from the
  holder's last version (``renewals + 1``); refused → another owner took over: lost.
* **release**: compare-and-swap to ``holder: null``, keeping the epoch.

Expiry and clocks.  No wall clock is compared across machines.  An observer decides that
a holder is silent when the lease's *version token* has not changed for ``ttl_s`` seconds
of the observer's own monotonic clock (the holder's ``ttl_s``, from the record); the
holder renews on its monotonic clock every ``heartbeat_s`` (default ``ttl_s / 4``).  The
assumption is only that clock *rates* agree closely (NTP slews at most 500 ppm) and that
a live holder's renewal reaches the storage within ``ttl_s - heartbeat_s``; a holder
paused longer (SIGSTOP, a frozen VM, a long GC) loses the lease and is fenced off.
``expires_utc`` is written for people (``ckrun status``), never used for a takeover.  A
holder on *this* machine whose process is provably gone (same machine id, its pid absent
or started at another time) is expired at once: a crashed local supervisor does not
block its successor for a TTL.  The machine id is ``CKRUN_MACHINE_ID`` when set (tests
that simulate several machines on one host set it), else the kernel's boot id and this
process's pid namespace.

Fencing.  The supervisor hands the epoch it holds to its child (``CKRUN_LEASE_EPOCH``).
Every manifest and the completion marker record it, and :class:`Fence` checks, right
before a commit is published and again right after, that this epoch is still the
current one and held: otherwise the commit is refused with :class:`LeaseLost` (and a
manifest created in between is withdrawn), and retention does not run, so a stale
holder that wakes up after losing the lease publishes and deletes nothing.  What is left
is the interval between the check and the storage's answer to the publishing request
(a process paused exactly there for a whole TTL); S3 has no write conditioned on another
object, so no client-side fence closes it completely.  A Checkpointer used without a
supervisor (no ``CKRUN_LEASE_EPOCH``) runs unfenced; its writer lock guards one machine.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from ckrun.checkpoint import layout
from ckrun.checkpoint.lease_record import (
    DEFAULT_TTL_S,
    EPOCH_ENV,
    Holder,
    LeaseRecord,
    authority,
    machine_id,
    read_lease,
)
from ckrun.errors import (
    ConfigError,
    LeaseHeld,
    LeaseLost,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
)
from ckrun.notices import iso_utc, utcnow
from ckrun.storage.base import Storage

__all__ = [
    "DEFAULT_TTL_S",
    "EPOCH_ENV",
    "Fence",
    "Holder",
    "Lease",
    "LeaseRecord",
    "authority",
    "machine_id",
    "read_lease",
]

log = logging.getLogger(__name__)


class Lease:
    """The holder's side of the run's lease (see the module docstring).

    Args:
        storage: the run root (the lease goes to its durable tier).
        run: run id.
        ttl_s: seconds without a renewal after which observers may take the lease over.
        job_id, attempt: recorded in the holder.
        clock, sleep: monotonic clock and sleep (seconds), replaceable in tests.

    Attributes:
        epoch: the epoch held (None before :meth:`acquire` or after a loss/release).
        record: the last record this holder wrote.
        renewed_at: monotonic time of the last successful write (acquire or renew).
    """

    def __init__(
        self,
        storage: Storage,
        run: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        job_id: str | None = None,
        attempt: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl_s must be > 0, got {ttl_s}")
        self.storage = authority(storage)
        self.run, self.ttl_s = run, float(ttl_s)
        self.holder = Holder.this_process(job_id=job_id, attempt=attempt)
        self.clock, self.sleep = clock, sleep
        self.epoch: int | None = None
        self.record: LeaseRecord | None = None
        self.renewed_at: float | None = None
        self._version: str | None = None

    def _record(self, epoch: int, renewals: int, acquired: str | None = None) -> LeaseRecord:
        now = utcnow()
        return LeaseRecord(
            self.run,
            epoch,
            self.holder,
            self.ttl_s,
            renewals,
            acquired or iso_utc(now),
            iso_utc(now),
            iso_utc(now + timedelta(seconds=self.ttl_s)),
        )

    def _won(self, rec: LeaseRecord, version: str | None, t0: float) -> LeaseRecord:
        self.epoch, self.record, self._version, self.renewed_at = rec.epoch, rec, version, t0
        return rec

    def try_acquire(self, watch: dict[str, Any]) -> LeaseRecord | None:
        """One round of acquisition; the record on success, None while it is held.

        Args:
            watch: the caller's memory between rounds (``version``, ``since``: when this
                observer first saw that version, monotonic seconds; ``record``: the
                holder's record).

        Raises:
            CorruptCheckpoint, StorageError: see :func:`read_lease`.
        """
        t0 = self.clock()
        cur = read_lease(self.storage)
        seen = self.clock()  # the version read was written before this instant
        if cur is None:
            rec = self._record(_first_epoch(self.storage), 0)
            try:
                info = self.storage.put(layout.LEASE, rec.dumps(), if_absent=True)
            except ObjectExists:
                return None  # another acquirer created it first
            return self._won(rec, info.version, t0)
        old, version = cur
        watch["record"] = old
        if watch.get("version") != version:
            watch["version"], watch["since"] = version, seen
        silent = seen - float(watch["since"])
        free = old.holder is None or silent >= old.ttl_s or old.holder.provably_dead()
        if not free:
            return None
        rec = self._record(old.epoch + 1, 0)
        try:
            info = self.storage.put(layout.LEASE, rec.dumps(), if_match=version)
        except PreconditionFailed:
            return None  # renewed or taken by another acquirer meanwhile
        if old.holder is not None:
            log.warning(
                "took over the lease of run %s from %s (epoch %d → %d): %s",
                self.run,
                old.holder.describe(),
                old.epoch,
                rec.epoch,
                "its process is gone" if silent < old.ttl_s else f"silent {silent:.1f} s",
            )
        return self._won(rec, info.version, t0)

    def acquire(
        self,
        wait_s: float = 0.0,
        *,
        poll_s: float | None = None,
        on_wait: Callable[[LeaseRecord], None] | None = None,
    ) -> LeaseRecord:
        """Acquire the lease, waiting up to ``wait_s`` seconds for a live holder to end.

        A holder that goes silent is taken over ``ttl_s`` after this process first saw
        its current version, even beyond ``wait_s`` only if ``wait_s >= ttl_s``.

        Args:
            poll_s: seconds between reads (default ``ttl_s / 10``, 0.05 to 2 s).
            on_wait: called once with the holder's record when the first round fails.

        Raises:
            LeaseHeld: still held after ``wait_s`` (the message names the holder); exit 2.
        """
        poll = poll_s if poll_s is not None else min(2.0, max(0.05, self.ttl_s / 10))
        watch: dict[str, Any] = {}
        deadline = self.clock() + max(0.0, wait_s)
        told = False
        while True:
            rec = self.try_acquire(watch)
            if rec is not None:
                return rec
            held = watch.get("record")
            if held is not None and not told and on_wait is not None:
                on_wait(held)
                told = True
            if self.clock() >= deadline:
                raise LeaseHeld(_held_message(self.run, held, wait_s), holder=_holder_dict(held))
            self.sleep(poll)

    def renew(self) -> LeaseRecord:
        """Heartbeat: compare-and-swap the lease forward (``renewals + 1``).

        Raises:
            LeaseLost: the lease changed under us (another owner took over); ``epoch``
                becomes None.
            StorageError: the storage failed (transient: renew again at the next beat).
        """
        if self.record is None or self._version is None:
            raise LeaseLost(f"run {self.run!r}: renew without holding the lease")
        t0 = self.clock()
        rec = replace(
            self._record(self.record.epoch, self.record.renewals + 1),
            acquired_utc=self.record.acquired_utc,
        )
        try:
            info = self.storage.put(layout.LEASE, rec.dumps(), if_match=self._version)
        except PreconditionFailed as e:
            lost = self.epoch
            self.epoch = None
            cur = read_lease(self.storage)
            now = cur[0] if cur else None
            raise LeaseLost(
                f"run {self.run!r}: lease epoch {lost} was lost"
                + (f" to {now.holder.describe()} (epoch {now.epoch})" if now and now.holder else "")
                + "; this supervisor stops without requeueing",
                holder=_holder_dict(now),
            ) from e
        return self._won(rec, info.version, t0)

    def release(self) -> None:
        """Give the lease up (holder null, epoch kept); a no-op when not held.

        Never raises for a lost lease; storage errors are logged (the lease then expires
        after its TTL).
        """
        if self.record is None or self._version is None or self.epoch is None:
            return
        rec = replace(
            self.record,
            holder=None,
            renewals=self.record.renewals + 1,
            renewed_utc=iso_utc(utcnow()),
        )
        try:
            self.storage.put(layout.LEASE, rec.dumps(), if_match=self._version)
        except PreconditionFailed:
            log.warning("run %s: lease epoch %s was already taken over", self.run, self.epoch)
        except Exception as e:  # noqa: BLE001 - best effort; expiry covers it
            log.warning("run %s: releasing the lease failed (it expires): %s", self.run, e)
        self.epoch = None
        self._version = None


def _first_epoch(storage: Storage) -> int:
    """Epoch of a lease created from nothing: above the newest commit's epoch, so a lease
    object deleted by hand never hands an old epoch (and its stale writers) back out."""
    newest: str | None = None
    for area in (layout.FINAL, layout.CHECKPOINTS):
        keys = [o.key for o in storage.list(area) if o.key.endswith("/" + layout.MANIFEST)]
        if keys:
            newest = max(keys)
            break
    if newest is None:
        return 1
    try:
        epoch = json.loads(storage.get(newest)).get("lease_epoch")
    except (ObjectNotFound, ValueError, AttributeError):
        return 1
    return epoch + 1 if isinstance(epoch, int) and epoch >= 1 else 1


def _holder_dict(rec: LeaseRecord | None) -> dict[str, Any]:
    if rec is None or rec.holder is None:
        return {}
    return dict(rec.holder.__dict__, epoch=rec.epoch, renewed_utc=rec.renewed_utc)


def _held_message(run: str, rec: LeaseRecord | None, wait_s: float) -> str:
    who = rec.holder.describe() if rec is not None and rec.holder is not None else "another owner"
    epoch = rec.epoch if rec is not None else "?"
    waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
    return (
        f"run {run!r} is owned by {who} (lease epoch {epoch}, renewed "
        f"{rec.renewed_utc if rec else '?'}){waited}: not starting a second writer. Wait "
        "for it to end, `ckrun cancel` it, or pass --wait-for-lease S to wait for its "
        "lease to be released or to expire"
    )


class Fence:
    """The child's side: refuse a commit when its lease epoch is no longer current.

    Args:
        storage: the run root.
        epoch: the epoch the supervisor holds for this child; None: unfenced (no
            supervisor), every check passes.
    """

    def __init__(self, storage: Storage, epoch: int | None) -> None:
        self.storage, self.epoch = storage, epoch

    @classmethod
    def from_env(cls, storage: Storage, environ: Mapping[str, str] | None = None) -> Fence:
        """The fence of ``CKRUN_LEASE_EPOCH`` (unset: unfenced).

        Raises:
            ConfigError: the variable is not an integer.
        """
        env = os.environ if environ is None else environ
        text = env.get(EPOCH_ENV, "").strip()
        if not text:
            return cls(storage, None)
        try:
            return cls(storage, int(text))
        except ValueError as e:
            raise ConfigError(f"{EPOCH_ENV}={text!r} is not an integer epoch") from e

    @property
    def fenced(self) -> bool:
        """True when commits are checked against the lease."""
        return self.epoch is not None

    def check(self, what: str) -> None:
        """Raise :class:`LeaseLost` unless ``epoch`` is the run's current, held epoch.

        Args:
            what: what is about to be published (for the message), e.g. ``"step 40"``.

        Raises:
            LeaseLost: the lease has another epoch, was released, or is gone.
            StorageError: the lease could not be read (the commit does not happen).
        """
        if self.epoch is None:
            return
        cur = read_lease(self.storage)
        rec = cur[0] if cur else None
        if rec is not None and rec.epoch == self.epoch and rec.holder is not None:
            return
        now = (
            "no lease"
            if rec is None
            else f"epoch {rec.epoch} held by {rec.holder.describe()}"
            if rec.holder is not None
            else f"epoch {rec.epoch}, released"
        )
        raise LeaseLost(
            f"{what} refused: this process writes under lease epoch {self.epoch} but the "
            f"run's lease is now {now} in {self.storage.url}; another owner took the run "
            "over, so nothing is published or deleted by this process (fencing)",
            holder=_holder_dict(rec),
        )
