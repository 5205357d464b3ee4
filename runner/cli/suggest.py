"""Checks that catch a newcomer's typo before anything is created: a missing training
script (``ckrun submit train_charlmm.py``) and a misspelled run name (``ckrun status
charml``), each answered with the closest existing name (:mod:`difflib`)."""

from __future__ import annotations

import difflib
import os
import sys

from ckrun.errors import UsageError


def close_run_names(name: str, storage: str) -> list[str]:
    """Run names under a local ``storage`` base that look like ``name`` (a typo)."""
    try:
        names = [
            d for d in os.listdir(storage) if os.path.exists(os.path.join(storage, d, "run.json"))
        ]
    except OSError:
        return []
    return difflib.get_close_matches(name, sorted(names), n=2)


def check_script(command: tuple[str, ...]) -> None:
    """Refuse a ``train.py`` that does not exist here, before a run is created.

    Only for commands that run on this machine (the local profile): a Slurm node or a
    container image may hold the script at a path this machine does not have.

    Raises:
        UsageError: the script is missing (exit 2), naming similar files beside it.
    """
    if len(command) < 2 or command[0] != sys.executable or not command[1].endswith(".py"):
        return
    script = command[1]
    if os.path.isfile(script):
        return
    folder = os.path.dirname(script) or "."
    try:
        near = [f for f in os.listdir(folder) if f.endswith(".py")]
    except OSError:
        near = []
    close = [
        os.path.join(os.path.dirname(script), f)
        for f in difflib.get_close_matches(os.path.basename(script), near, n=2)
    ]
    raise UsageError(
        f"script {script!r} not found (in {os.path.abspath(folder)})"
        + (f"; did you mean {' or '.join(map(repr, close))}?" if close else "")
        + "; no run was created"
    )
