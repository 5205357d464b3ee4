"""The supervisor's console: its stderr, which may go away while the run goes on.

A foreground ``ckrun submit train.py 2>&1 | tee train.log`` loses its console when
Ctrl-C reaches ``tee`` too (the whole foreground process group gets SIGINT), and an
SSH session's terminal answers ``EIO`` once it has hung up.  A write to either raises
(``EPIPE``: SIGPIPE is ignored in Python; ``EIO``); the supervisor is then in the middle
of the very save it exists for.  :class:`Console` turns the first failed write into a
quiet console: later lines are dropped, ``events.jsonl`` (the run's record) keeps them,
and :attr:`Console.lost` says why for the event log.

Each line reaches the stream in one write.  ``print(line)`` writes the text and the
newline separately, and ``sys.stderr`` is write-through: two ``write(2)`` calls, with the
child's own output (a stack dump at the end of the grace period, its progress lines)
free to land between them on the same descriptor, mid-line.  The console keeps a partial
line until its newline (or an explicit flush) and hands whole lines to the stream, so a
line up to ``PIPE_BUF`` (4096 bytes) is one atomic write on a pipe (pipe(7)).
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
        self._partial = ""  # text after the last newline, not yet written

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        """Write ``s`` (characters): every complete line now, in one stream write, the
        rest with the next newline or flush; a no-op once the console is lost."""
        if self.lost is None:
            text = self._partial + s
            cut = text.rfind("\n") + 1
            self._partial = text[cut:]
            if cut:
                self._put(text[:cut])
        return len(s)

    def _put(self, text: str) -> None:
        try:
            self.stream.write(text)
        except OSError as e:
            self.lost = e

    def flush(self) -> None:
        """Write any partial line and flush ``stream``; a failure marks the console lost
        instead of raising."""
        if self.lost is None and self._partial:
            text, self._partial = self._partial, ""
            self._put(text)
        if self.lost is None:
            try:
                self.stream.flush()
            except OSError as e:
                self.lost = e
