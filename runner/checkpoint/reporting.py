"""What the Checkpointer tells the run's log and the supervisor, and how it names itself.

``restore`` and ``save`` events go to the run log (:func:`ckrun.runlog.child_event`,
rank 0 only); :func:`report_training_start` also marks the start of training for the
supervisor (:func:`ckrun.control.mark_training`).  Outside the supervisor both are no-ops.
"""

from __future__ import annotations

import os

from ckrun.checkpoint.manifest import Manifest
from ckrun.runlog import child_event

__all__ = ["created_at", "report_save", "report_training_start", "run_name_of"]


def report_training_start(m: Manifest | None, seconds: float, rank: int) -> None:
    """Tell the run's log and the supervisor that training starts (``restore`` event,
    :func:`ckrun.control.mark_training`) after a load of ``seconds``; a no-op outside the
    supervisor."""
    from ckrun.control import mark_training

    if rank == 0:
        child_event("restore", step=m.step if m is not None else None, seconds=seconds)
    mark_training("restore")


def report_save(m: Manifest, seconds: float, mode: str, rank: int) -> None:
    """The ``save`` event: the training loop was blocked ``seconds`` for step ``m.step``
    (``mode`` ``sync`` or ``async``)."""
    if rank == 0:  # imported once, above: an import statement costs each save (issue 19)
        child_event("save", step=m.step, seconds=seconds, mode=mode, ckpt_kind=m.kind)


def created_at() -> str:
    """``the Checkpointer created at FILE:LINE`` of the first frame outside ckrun's
    checkpoint package (the user's code that built the Checkpointer); the writer lock
    names it to a second Checkpointer it refuses."""
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    for fr in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(fr.filename).startswith(here):
            return f"the Checkpointer created at {fr.filename}:{fr.lineno}"
    return "another Checkpointer"


def run_name_of(url: str) -> str:
    """The default run id: the base name of the run root ``url`` (``"run"`` for a bare
    root)."""
    return url.rstrip("/").rsplit("/", 1)[-1] or "run"
