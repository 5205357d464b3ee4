"""An ``async_save`` in flight at interpreter exit (:mod:`ckrun.checkpoint.async_save`):
finished before ``concurrent.futures`` shuts down, bounded by a pending notice's
deadline; a failure that can no longer be raised is printed.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from ckrun.storage import priority

__all__ = ["Drainable", "InflightSave", "register_exit_drain", "finish_at_exit"]

log = logging.getLogger(__name__)


class InflightSave(Protocol):
    """The in-flight save (:class:`ckrun.checkpoint.async_save.AsyncSaveHandle`)."""

    step: int
    _future: Future[Any]


class Drainable(Protocol):
    """The background persist (:class:`ckrun.checkpoint.async_save.AsyncSaver`)."""

    def inflight(self) -> InflightSave | None: ...

    def close(self) -> None: ...


def register_exit_drain(ref: weakref.ReferenceType[Drainable]) -> None:
    """Have the saver ``ref`` names drained at interpreter exit (:func:`finish_at_exit`),
    before ``concurrent.futures`` refuses new work.

    ``threading._register_atexit`` callbacks run (last registered first) before
    non-daemon threads are joined and before ``concurrent.futures`` shuts its executors
    down, which the persist still needs (the O_DIRECT writer submits to a pool); plain
    ``atexit`` runs too late for that and is only the fallback.
    """
    register = getattr(threading, "_register_atexit", None)
    if callable(register):
        register(finish_at_exit, ref)
    else:
        atexit.register(finish_at_exit, ref)


def finish_at_exit(ref: weakref.ReferenceType[Drainable]) -> None:
    """atexit: finish the in-flight save; an error can no longer be raised: print it.

    With a notice pending the wait is bounded by its deadline: past it the save is
    abandoned (logged), and the supervisor's KILL may end the process while it runs (the
    previous checkpoint stays the newest).
    """
    saver = ref()
    if saver is None:
        return
    from ckrun.control_files import read_notice

    h = saver.inflight()
    notice = read_notice() if h is not None else None
    if h is not None and notice is not None:
        priority.raise_waited()
        left = max(0.0, notice.seconds_left())
        try:
            h._future.exception(timeout=left)
        except FutureTimeout:
            log.error(
                "ckrun: the background save of step %d did not finish before the notice "
                "deadline; exiting without it (the previous checkpoint stands)",
                h.step,
            )
            return
    try:
        saver.close()
    except BaseException as e:
        log.error("ckrun: the background checkpoint save failed at exit: %s", e)
        print(
            f"ckrun: the background checkpoint save failed at exit: {e}",
            file=sys.stderr,
            flush=True,
        )
