"""Transfer progress: drawn on a real terminal (a pty), silent on pipes and files."""

from __future__ import annotations

import io
import os
import pty

from ckrun.storage.progress import Progress, enabled


def test_drawn_on_a_tty_only(monkeypatch) -> None:
    monkeypatch.delenv("CKRUN_PROGRESS", raising=False)
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert enabled(tty)
            with Progress("upload k", 4_000_000, stream=tty, min_interval_s=0) as bar:
                bar.update(1_000_000)
                bar.update(3_000_000)
        out = ""
        while not out.endswith("\n"):  # the pty may deliver the writes in pieces
            out += os.read(master, 4096).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "upload k  1.0/4.0 MB  25%" in out and "4.0/4.0 MB 100%" in out
    assert out.endswith("\n")


def test_silent_off_a_tty_and_when_disabled(monkeypatch) -> None:
    buf = io.StringIO()
    with Progress("download k", 10, stream=buf, min_interval_s=0) as bar:
        bar.update(10)
    assert buf.getvalue() == ""
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            monkeypatch.setenv("CKRUN_PROGRESS", "0")
            assert not enabled(tty)
    finally:
        os.close(master)
        os.close(slave)
