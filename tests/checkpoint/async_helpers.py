"""Helpers of the async checkpoint tests.

:class:`GatedStorage` is a real :class:`LocalStorage` whose shard writes wait on a gate
(a ``threading.Event``) before their first byte, or stall for good after ``stall_after``
bytes: a slow disk made deterministic, so a test can act while the background persist is
provably in progress.  Everything else (files, fsync, rename) is the real local backend.
"""

from __future__ import annotations

import threading
from typing import Any

from ckrun.storage.local import LocalStorage


class _GatedWriter:
    def __init__(self, inner: Any, owner: GatedStorage):
        self._inner, self._owner = inner, owner
        self.key = inner.key
        self._n = 0

    def write(self, data: Any) -> int:
        o = self._owner
        o.started.set()
        if not o.gate.wait(o.timeout_s):
            raise TimeoutError("test gate never opened")
        n: int = self._inner.write(data)
        self._n += n
        if o.stall_after is not None and self._n >= o.stall_after:
            o.stalled.set()
            threading.Event().wait()  # a disk that never answers again (the test kills us)
        return n

    def commit(self) -> Any:
        return self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()

    def __enter__(self) -> _GatedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.abort()
        else:
            self.commit()


class GatedStorage(LocalStorage):
    """LocalStorage with gated shard writes (see module docstring).

    Attributes:
        gate: set to let shard writes proceed (set initially).
        started: set once a shard write reached the gate.
        stalled: set once ``stall_after`` bytes were written and the writer hangs.
    """

    def __init__(self, path: str, *, stall_after: int | None = None, timeout_s: float = 60.0):
        super().__init__(path)
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.stalled = threading.Event()
        self.stall_after = stall_after
        self.timeout_s = timeout_s

    def open_write(self, key: str) -> Any:
        inner = super().open_write(key)
        return _GatedWriter(inner, self) if key.endswith(".ckpt") else inner
