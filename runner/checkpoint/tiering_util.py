"""Parts of the two-tier storage (:mod:`ckrun.checkpoint.tiering`): the upload policy and
a writer wrapper that reports commits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckrun.checkpoint.manifest import Manifest, ManifestKind

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
