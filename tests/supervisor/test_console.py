"""The supervisor's console: whole lines in one write, a lost console never raises."""

from __future__ import annotations

import errno
import io

from ckrun.supervisor.console import Console


class Recording(io.StringIO):
    """A stream that keeps each ``write`` call's text (one ``write(2)`` on a
    write-through ``sys.stderr``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_print_reaches_the_stream_as_one_write_per_line() -> None:
    # print() writes the text and the newline apart: on the shared stderr the child's
    # stack dump once landed between them, splitting the supervisor's line
    rec = Recording()
    out = Console(rec)
    print("[ckrun] h attempt 0: no exit after the notice", file=out, flush=True)
    print("a", "b", file=out, flush=True)
    assert rec.calls == ["[ckrun] h attempt 0: no exit after the notice\n", "a b\n"]


def test_a_partial_line_waits_for_its_newline_or_a_flush() -> None:
    rec = Recording()
    out = Console(rec)
    out.write("one\ntw")
    assert rec.calls == ["one\n"]
    out.write("o\nthree\nfo")
    assert rec.calls == ["one\n", "two\nthree\n"]
    out.flush()
    assert rec.calls == ["one\n", "two\nthree\n", "fo"] and rec.getvalue() == "one\ntwo\nthree\nfo"


class Gone(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(errno.EPIPE, "Broken pipe")


def test_a_lost_console_keeps_the_error_and_drops_later_lines() -> None:
    out = Console(Gone())
    print("first", file=out, flush=True)
    assert out.lost is not None and out.lost.errno == errno.EPIPE
    print("second", file=out, flush=True)  # no raise
    out.flush()
