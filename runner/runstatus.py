"""``ckrun status``: the story of a run, from ``events.jsonl`` and the manifests."""

from __future__ import annotations

from typing import Any

from ckrun.rundir import RunDir


def locate(name: str, storage: str | None) -> RunDir:
    """The state directory of run ``name`` (see :func:`ckrun.launch.locate`)."""
    from ckrun.launch import locate as _locate

    return _locate(name, storage)


def summarize(rd: RunDir) -> dict[str, Any]:
    """Placeholder until the goodput computation lands."""
    from ckrun.events import read_events

    evs = read_events(rd.events_path)
    return {"events": len(evs)}


def render(summary: dict[str, Any]) -> str:
    """Human-readable form of :func:`summarize`."""
    return "\n".join(f"{k}: {v}" for k, v in summary.items())
