"""``ckrun status``: the story of a run, from ``events.jsonl`` and the manifests.

The accounting lives in :mod:`ckrun.report` (definitions in
:mod:`ckrun.report.goodput`); this module keeps the names the CLI and tests use.
"""

from __future__ import annotations

from ckrun.report.summary import scheduler_view, summarize
from ckrun.report.terminal import render
from ckrun.supervisor.rundir import RunDir

__all__ = ["locate", "render", "scheduler_view", "summarize"]


def locate(name: str, storage: str | None) -> RunDir:
    """The state directory of run ``name`` (see :func:`ckrun.cli.commands.locate`)."""
    from ckrun.cli.commands import locate as _locate

    return _locate(name, storage)
