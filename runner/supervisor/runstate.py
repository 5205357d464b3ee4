"""Run state that travels with the run: budgets and history in the run's storage.

``supervisor/state.json`` (:data:`ckrun.checkpoint.layout.RUN_STATE`) beside the
checkpoints holds what decides restarts — attempts started, preemptions, failures, the
no-progress streak — and the newest :data:`MAX_EVENTS` supervisor events, so a fresh VM,
a new pod or a requeued job continues the counts instead of starting at zero; the
machine-local state directory (``events.jsonl``) is only a cache of it.

Only the lease holder writes it, and each write is fenced like a commit
(:class:`ckrun.checkpoint.lease.Fence`): a supervisor that lost the run's lease cannot
overwrite its successor's counts.  A missing record is an empty one; an unreadable one is
reported and replaced (the counts then restart, never the checkpoints).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckrun.checkpoint import layout
from ckrun.checkpoint.lease import Fence
from ckrun.errors import LeaseLost, ObjectNotFound, StorageError
from ckrun.notices import iso_utc, parse_utc, utcnow
from ckrun.runlog import EventLog
from ckrun.storage.base import Storage
from ckrun.supervisor.budgets import RunBudgets, RunDirBudgets

log = logging.getLogger(__name__)

FORMAT = "ckrun.runstate"
MAX_EVENTS = 500
COUNTERS = ("attempts", "preemptions", "failures", "no_progress", "streak")


@dataclass
class RunRecord:
    """Budgets and history of one run (see the module docstring).

    Attributes:
        attempts: attempts started (the next attempt's 0-based id).
        preemptions, failures, no_progress: the restart budgets' counts.
        events: the newest supervisor events (``events.jsonl`` lines), oldest first.
        updated_utc: when the record was last written.
    """

    attempts: int = 0
    preemptions: int = 0
    failures: int = 0
    no_progress: int = 0
    streak: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    updated_utc: str = ""

    def counters(self) -> dict[str, int]:
        """The budget counts by name."""
        return {k: int(getattr(self, k)) for k in COUNTERS}

    def dumps(self) -> bytes:
        body = {"format": FORMAT, "format_version": 1, **self.counters()}
        body.update(events=self.events[-MAX_EVENTS:], updated_utc=self.updated_utc)
        return json.dumps(body, default=str).encode()

    @classmethod
    def load(cls, storage: Storage) -> RunRecord:
        """The run's record; an empty one when it has none or it is unreadable.

        Raises:
            StorageError: the storage failed (not a missing object).
        """
        try:
            obj = json.loads(storage.get(layout.RUN_STATE))
            if obj.get("format") != FORMAT:
                raise ValueError(f"format {obj.get('format')!r}")
            rec = cls()
            for k in COUNTERS:
                setattr(rec, k, int(obj.get(k) or 0))
            rec.events = [e for e in obj.get("events") or [] if isinstance(e, dict)]
            rec.updated_utc = str(obj.get("updated_utc") or "")
            return rec
        except ObjectNotFound:
            return cls()
        except (ValueError, TypeError, AttributeError) as e:
            log.warning(
                "%s in %s is unreadable (%s): budgets restart", layout.RUN_STATE, storage.url, e
            )
            return cls()


class RunState:
    """The supervisor's handle on the record: update counters, mirror events, save.

    Saves run on a background writer thread that always writes the newest snapshot
    (coalescing bursts), so a slow storage request never delays the supervisor's loop on
    the notice path; :meth:`flush` waits for it (before the lease is released).

    Args:
        storage: the run root.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.fence = Fence(storage, None)
        self.record = RunRecord()
        self.enabled = False  # writes start once the lease is held (:meth:`activate`)
        #: ``updated_utc`` of the record as :meth:`activate` found it in storage (before
        #: this supervisor's own first save moved it to now); "" when there was none
        self.found_utc = ""
        self._cv = threading.Condition()
        self._pending: bytes | None = None
        self._writing = False
        self._thread: threading.Thread | None = None

    def activate(self, epoch: int | None) -> RunRecord:
        """Load the record as the lease holder of ``epoch`` left it and start saving;
        events mirrored before this are kept (appended after the stored ones).

        Raises:
            StorageError: the storage failed.
        """
        pending = self.record.events
        self.record = RunRecord.load(self.storage)
        self.found_utc = self.record.updated_utc
        self.record.events.extend(pending)
        self.fence = Fence(self.storage, epoch)
        self.enabled = True
        self._thread = threading.Thread(target=self._work, name="ckrun-runstate", daemon=True)
        self._thread.start()
        self.save()
        return self.record

    def update(self, **counts: int) -> None:
        """Set counters; saved when one changed."""
        changed = {k: v for k, v in counts.items() if getattr(self.record, k) != v}
        if changed:
            for k, v in changed.items():
                setattr(self.record, k, int(v))
            self.save()

    def event(self, body: dict[str, Any]) -> None:
        """Mirror one event line into the record and save."""
        self.record.events.append(body)
        del self.record.events[:-MAX_EVENTS]
        self.save()

    def save(self) -> None:
        """Queue the current record for writing (never blocks on the storage)."""
        if not self.enabled:
            return
        self.record.updated_utc = iso_utc(utcnow())
        with self._cv:
            self._pending = self.record.dumps()
            self._cv.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save was attempted; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.enabled and (self._pending is not None or self._writing):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _work(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                body, self._pending, self._writing = self._pending, None, True
            try:
                self._write(body)
            finally:
                with self._cv:
                    self._writing = False
                    self._cv.notify_all()

    def _write(self, body: bytes) -> None:
        """Write one snapshot (fenced); errors are logged, never raised (the local cache
        keeps the events; the next save carries them)."""
        try:
            self.fence.check("run state update")
            self.storage.put(layout.RUN_STATE, body)
        except LeaseLost as e:
            self.enabled = False
            log.warning("run state not saved: %s", e)
        except StorageError as e:
            log.warning(
                "saving the run state to %s failed (retried later): %s", self.storage.url, e
            )


class StorageBudgets:
    """A :class:`ckrun.supervisor.budgets.BudgetStore` kept in the run's record in
    storage (:class:`RunState`) and in the local ``budgets.json`` (the machine's cache).

    ``load`` takes the newer of the two: the storage record on a fresh machine (no local
    file) or when another machine wrote it later; the local file after ``ckrun submit``
    reset it here (a new submission starts at zero).
    """

    def __init__(self, state: RunState, local: RunDirBudgets) -> None:
        self.state, self.local = state, local

    def load(self) -> RunBudgets:
        r = self.state.record
        stored = RunBudgets(r.preemptions, r.failures, r.no_progress, r.streak)
        try:
            local_mtime = os.path.getmtime(self.local.path)
        except OSError:
            return stored
        # when the record was written before this supervisor (its own first save, at
        # activation, is always newer than the reset `ckrun submit` just made)
        found = self.state.found_utc
        if found and parse_utc(found).timestamp() > local_mtime:
            return stored
        return self.local.load()

    def save(self, budgets: RunBudgets) -> None:
        self.state.update(**asdict(budgets))
        self.local.save(budgets)

    def reset(self) -> None:
        self.save(RunBudgets())


class MirroredEventLog(EventLog):
    """An :class:`~ckrun.runlog.EventLog` whose lines are also mirrored into the run's
    record in storage (:class:`RunState`)."""

    def __init__(self, path: str, run: str, state: RunState, attempt: int = 0, **kw: Any) -> None:
        super().__init__(path, run, attempt, **kw)
        self.state = state

    def append(
        self,
        kind: str,
        *,
        step: int | None = None,
        seconds: float | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        body = super().append(kind, step=step, seconds=seconds, **fields)
        self.state.event(body)
        return body
