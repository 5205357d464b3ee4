""":class:`StrEnum`: the base of ckrun's named values (notice kinds, manifest kinds,
preflight and requeue outcomes).

A member is a ``str`` equal to its value, so JSON files, the event log and comparisons
with plain strings keep the words they always had, and ``str()``/``format()`` give the
value (as :class:`enum.StrEnum` does from Python 3.11; ckrun supports 3.10).
"""

from __future__ import annotations

import enum

__all__ = ["StrEnum"]


class StrEnum(str, enum.Enum):
    """A str-valued enum whose ``str()`` and ``format()`` are the value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
