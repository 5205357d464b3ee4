"""Fixtures of the supervisor tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sv_helpers import Ckrun


@pytest.fixture
def procs() -> Iterator[Callable[..., Ckrun]]:
    """Start ``ckrun`` processes; any still running are killed at the end of the test."""
    started: list[Ckrun] = []

    def start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Ckrun:
        c = Ckrun(args, cwd, env)
        started.append(c)
        return c

    yield start
    for c in started:
        c.kill()
