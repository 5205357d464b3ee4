"""Parts of the two-tier storage (:mod:`ckrun.checkpoint.tiering`): the upload policy, a
writer wrapper that reports commits, and the pins that keep a queued upload's local files
until it has read them."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ckrun.checkpoint.manifest import Manifest, ManifestKind

from .. import control
from ..errors import ConfigError
from ..storage.base import ObjectInfo, ObjectWriter


@dataclass(frozen=True)
class UploadPolicy:
    """Which committed checkpoints go to the remote tier.

    Final artifacts and emergency checkpoints (a notice is pending) always do.

    Attributes:
        mode: ``every`` | ``milestones`` | ``every_n`` | ``emergency`` (only those).
        every_n: for ``every_n``: the 1st, (n+1)th, ... recovery checkpoint.
    """

    mode: str = "every"
    every_n: int = 1

    @classmethod
    def parse(cls, text: str) -> UploadPolicy:
        """``every``, ``milestones``, ``emergency`` or ``every:N`` (profile ``upload_policy``).

        Raises:
            ConfigError: any other value.
        """
        t = text.strip().lower()
        if t in ("every", "milestones", "emergency"):
            return cls(t)
        name, _, n = t.partition(":")
        if name == "every" and n.isdigit() and int(n) >= 1:
            return cls("every_n", int(n))
        raise ConfigError(f"upload_policy={text!r}: use every, milestones, emergency or every:N")

    def selects(self, m: Manifest, *, emergency: bool, ordinal: int) -> bool:
        """Whether ``m`` (the ``ordinal``-th commit seen, from 0) is uploaded."""
        if emergency or m.kind == ManifestKind.FINAL or self.mode == "every":
            return True
        if self.mode == "milestones":
            return bool(m.kind == ManifestKind.MILESTONE)
        if self.mode == "every_n":
            return ordinal % self.every_n == 0
        return False


class HookedWriter:
    """A local writer that calls ``on_commit`` after a successful commit."""

    def __init__(self, inner: ObjectWriter, on_commit: Any) -> None:
        self.key = inner.key
        self._inner, self._on_commit = inner, on_commit

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._inner.write(data)

    def commit(self) -> ObjectInfo:
        info = self._inner.commit()
        self._on_commit(self.key)
        return info

    def abort(self) -> None:
        self._inner.abort()

    def __enter__(self) -> HookedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.commit()
        else:
            self.abort()


log = logging.getLogger(__name__)


def default_events_path() -> str | None:
    """``events.jsonl`` next to ``CKRUN_CONTROL_DIR`` when supervised, else None."""
    cdir = control.control_dir()
    return os.path.join(os.path.dirname(cdir.rstrip("/")), "events.jsonl") if cdir else None


def record_event(
    path: str | None, kind: str, step: int | None, seconds: float | None, **fields: Any
) -> None:
    """Append an upload event to the run's ``events.jsonl`` at ``path`` (None: nowhere);
    a log that cannot be written is logged and skipped."""
    if not path:
        return
    from ckrun.runlog import EventLog

    try:
        EventLog(
            path, os.environ.get("CKRUN_RUN", ""), int(os.environ.get("CKRUN_ATTEMPT", "0") or 0)
        ).append(kind, step=step, seconds=seconds, **fields)
    except (OSError, ValueError) as e:
        log.warning("cannot record %s in %s: %s", kind, path, e)


def upload_keys(m: Manifest) -> list[str]:
    """The local keys the upload of ``m`` reads (its manifest and shards)."""
    return [m.key, *(s.key for s in m.shards)]


class Pins:
    """Local keys the running upload still reads; deleting one waits for it.

    Local retention runs after every commit and can reach the checkpoint being uploaded
    (saves faster than uploads): the upload then found its files gone and failed.  A
    delete of pinned keys is deferred and done, in the order deletes were asked for (a
    manifest before its shards), when the upload holding them unpins.

    Args:
        delete: the local tier's delete.
    """

    def __init__(self, delete: Callable[[Iterable[str]], None]) -> None:
        self._delete = delete
        self._lock = threading.Lock()
        self._pinned: set[str] = set()  # one upload runs at a time
        self._deferred: list[list[str]] = []

    def pin(self, keys: Iterable[str]) -> None:
        """Hold ``keys`` while the upload that reads them runs."""
        with self._lock:
            self._pinned.update(keys)

    def unpin(self, keys: Iterable[str]) -> None:
        """Release ``keys`` and do the deferred deletes no upload holds any more.

        Raises:
            StorageError: from the local delete (what is left stays deferred).
        """
        with self._lock:
            self._pinned.difference_update(keys)
            ready: list[str] = []
            for batch in self._deferred:
                ready += [k for k in batch if k not in self._pinned]
                batch[:] = [k for k in batch if k in self._pinned]
            self._deferred = [b for b in self._deferred if b]
        if ready:
            try:
                self._delete(ready)
            except BaseException:
                with self._lock:  # kept for the next unpin
                    self._deferred.insert(0, ready)
                raise

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` now, except pinned ones, which wait for their upload."""
        keys = list(keys)
        with self._lock:
            later = [k for k in keys if k in self._pinned]
            if later:
                self._deferred.append(later)
        now = [k for k in keys if k not in later]
        if now:
            self._delete(now)

    def held(self) -> int:
        """Keys pinned now (for tests and logs)."""
        with self._lock:
            return len(self._pinned)
