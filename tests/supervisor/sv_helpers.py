"""Helpers for the end-to-end supervisor tests: a real ``ckrun`` process and its output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHILD = str(Path(__file__).with_name("child_train.py"))

#: Short timings so escalation and backoff tests finish in seconds.
FAST_ENV = {"CKRUN_BACKOFF_S": "0.1", "CKRUN_KILL_DELAY_S": "1", "CKRUN_MARGIN_S": "0.5"}


def gone(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` no longer runs (gone, or a zombie) within ``timeout_s`` seconds."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def expected_w(steps: int) -> float:
    """``sum(w)`` of child_train.py after ``steps`` steps (4 equal entries)."""
    w = 0.0
    for k in range(steps):
        w = w * 0.5 + k
    return 4 * w


class Ckrun:
    """A ``python -m ckrun.cli ...`` process whose merged output is collected by a thread."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        full = dict(os.environ, **FAST_ENV, **(env or {}))
        full.pop("CKRUN_CONTROL_DIR", None)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckrun.cli", *args],
            cwd=cwd,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                m = rx.search(line)
                if m:
                    return m
            if self.proc.poll() is not None and not self._t.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.text}")

    def wait(self, timeout: float = 120.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._t.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def events(root: Path) -> list[dict[str, Any]]:
    path = root / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def poll(cond: Callable[[], object], timeout: float = 30.0) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError("condition not met within the timeout")
