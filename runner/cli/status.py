"""``ckrun status``: the story of a run, from ``events.jsonl`` and the manifests.

The accounting lives in :mod:`ckrun.report` (definitions in
:mod:`ckrun.report.goodput`); this module keeps the names the CLI and tests use.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
from ckrun.errors import UsageError
from ckrun.report.summary import scheduler_view, summarize
from ckrun.report.terminal import render
from ckrun.supervisor.rundir import RunDir

__all__ = ["locate", "render", "scheduler_view", "show", "summarize", "watch"]

#: States after which ``--watch`` stops (the supervisor exited and will not go on).
_FINAL = {"COMPLETED", "ALREADY_COMPLETE", "FAILED", "INCOMPATIBLE", "REQUEUE_FAILED", "CANCELLED"}


def locate(name: str, storage: str | None) -> RunDir:
    """The state directory of run ``name`` (see :func:`ckrun.cli.commands.locate`); on a
    machine with no local state of the run (a fresh VM, a new pod, another user's
    machine) whose storage holds its record, a :class:`ckrun.report.stored.StoredRunDir`
    (the history then comes from the run's storage).

    Raises:
        ConfigError: ``name`` is not a valid run name.
        UsageError: no run of that name exists there, locally or in its storage.
    """
    from ckrun.cli.locate import locate as _locate
    from ckrun.cli.locate import located_config
    from ckrun.report.stored import find_in_storage

    try:
        return _locate(name, storage)
    except UsageError:
        found = find_in_storage(located_config(name, storage))
        if found is None:
            raise
        return found


def show(rd: RunDir, *, as_json: bool = False, html_file: str | None = None) -> dict[str, Any]:
    """Print the status of the run in ``rd`` (text or JSON) and write the timeline page to
    ``html_file`` when given; returns the summary.

    Raises:
        UsageError: ``html_file`` cannot be written.
    """
    s = summarize(rd)
    click.echo(json.dumps(s, indent=1) if as_json else render(s))
    if html_file:
        from ckrun.report.timeline_html import render_html

        try:
            with open(html_file, "w", encoding="utf-8") as f:
                f.write(render_html(s))
        except OSError as e:
            raise UsageError(f"--html {html_file}: cannot write it ({e.strerror})") from e
        if not as_json:
            click.echo(f"timeline page: {html_file}", err=True)
    return s


def watch(
    rd: RunDir, every_s: float, *, as_json: bool = False, html_file: str | None = None
) -> None:
    """``--watch``: print the status every ``every_s`` seconds (the screen is cleared on a
    terminal) until the run reaches a final state with no live supervisor."""
    tty = sys.stdout.isatty()
    try:
        while True:
            if tty:
                click.echo("\x1b[H\x1b[2J", nl=False)
            s = show(rd, as_json=as_json, html_file=html_file)
            if not s["live"] and s["state"] in _FINAL:
                return
            if not tty:
                click.echo("")
            time.sleep(every_s)
    except KeyboardInterrupt:
        return
