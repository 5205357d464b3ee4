"""A one-line transfer progress display for uploads and downloads (no dependencies).

Shown only when the stream (stderr by default) is a terminal and ``CKRUN_PROGRESS`` is
not ``0``: under the supervisor, in CI or in a log file nothing is printed.  Redrawn at
most every ``min_interval_s`` seconds::

    upload checkpoints/step-0000001200/shard-r00000-a0003-1f2e.ckpt  412.0/1024.0 MB  40%  118 MB/s
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def enabled(stream: TextIO | None = None) -> bool:
    """True when progress should be drawn on ``stream`` (default stderr)."""
    s = stream if stream is not None else sys.stderr
    if os.environ.get("CKRUN_PROGRESS", "auto") == "0":
        return False
    try:
        return bool(s.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress of one transfer of ``total_bytes`` (0 if unknown); a no-op when disabled.

    Use as a context manager; call :meth:`update` with each chunk's size in bytes.
    """

    def __init__(
        self,
        label: str,
        total_bytes: int = 0,
        *,
        stream: TextIO | None = None,
        min_interval_s: float = 0.5,
    ) -> None:
        self.label, self.total = label, total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.on = enabled(self.stream)
        self.done = 0
        self._t0 = self._last = time.monotonic()
        self._every = min_interval_s

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.on and now - self._last >= self._every:
            self._last = now
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        rate = self.done / max(now - self._t0, 1e-9) / 1e6
        of = f"/{self.total / 1e6:.1f}" if self.total else ""
        pct = f" {100 * self.done // self.total:3d}%" if self.total else ""
        self.stream.write(
            f"\r{self.label}  {self.done / 1e6:.1f}{of} MB{pct}  {rate:.1f} MB/s\x1b[K{end}"
        )
        self.stream.flush()

    def close(self) -> None:
        """Draw the final line (when anything was drawn or the transfer was slow)."""
        if self.on:
            self._draw(time.monotonic(), end="\n")
            self.on = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
