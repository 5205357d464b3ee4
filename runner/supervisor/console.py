"""The supervisor's console: its stderr, which may go away while the run goes on.

A foreground ``ckrun submit train.py 2>&1 | tee train.log`` loses its console when
Ctrl-C reaches ``tee`` too (the whole foreground process group gets SIGINT), and an
SSH session's terminal answers ``EIO`` once it has hung up.  A write to either raises
(``EPIPE``: SIGPIPE is ignored in Python; ``EIO``); the supervisor is then in the middle
of the very save it exists for.  :class:`Console` turns the first failed write into a
quiet console: later lines are dropped, ``events.jsonl`` (the run's record) keeps them,
and :attr:`Console.lost` says why for the event log.
"""

from __future__ import annotations

import io
from typing import IO


class Console(io.TextIOBase):
    """A text stream over ``stream`` whose writes never raise :class:`OSError`.

    Attributes:
        lost: the error of the first failed write or flush (None while it works).
    """

    def __init__(self, stream: IO[str]) -> None:
        super().__init__()
        self.stream = stream
        self.lost: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        """Write ``s`` (characters); a no-op once the console is lost."""
        if self.lost is None:
            try:
                self.stream.write(s)
            except OSError as e:
                self.lost = e
        return len(s)

    def flush(self) -> None:
        """Flush ``stream``; a failure marks the console lost instead of raising."""
        if self.lost is None:
            try:
                self.stream.flush()
            except OSError as e:
                self.lost = e
