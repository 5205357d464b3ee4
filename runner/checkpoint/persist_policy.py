"""How hard a background persist may compete with training, and for how long.

``CKRUN_PERSIST_SCHED`` picks the persist threads' CPU policy
(:mod:`ckrun.storage.priority`): ``idle`` (the default) runs them at ``SCHED_IDLE``,
only on cores training leaves idle; ``other`` keeps the normal policy at
``CKRUN_PERSIST_NICE``.  ``SCHED_IDLE`` alone would let a persist starve for as long as
the cores stay busy (measured on a loaded 2-vCPU VM: 13-37 s instead of 1.4-5 s), and a
hard kill without notice in that window loses every step since the previous commit.
:func:`start_lag_bound` therefore raises a persist that is still running
``CKRUN_PERSIST_IDLE_S`` seconds (default :data:`IDLE_LIMIT_S`) after it started back to
the normal policy, with nobody waiting: an async save is durable at most that long plus
its own normal-priority duration after it started persisting.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ckrun.errors import ConfigError
from ckrun.storage import priority

__all__ = ["IDLE_LIMIT_S", "idle_limit_s", "lag_bound", "persist_sched", "start_lag_bound"]

log = logging.getLogger(__name__)

#: Seconds a persist may run at ``SCHED_IDLE`` before it is raised (the lag bound).
IDLE_LIMIT_S = 10.0


def persist_sched() -> bool:
    """``CKRUN_PERSIST_SCHED``: True for ``idle`` (the default), False for ``other``.

    Raises:
        ConfigError: another value.
    """
    raw = os.environ.get("CKRUN_PERSIST_SCHED", "idle").strip().lower() or "idle"
    if raw not in ("idle", "other"):
        raise ConfigError(
            f"CKRUN_PERSIST_SCHED={raw!r}: expected 'idle' (SCHED_IDLE, the default) "
            "or 'other' (the normal policy at CKRUN_PERSIST_NICE)"
        )
    return raw == "idle"


def idle_limit_s() -> float:
    """``CKRUN_PERSIST_IDLE_S`` in seconds (default :data:`IDLE_LIMIT_S`).

    Raises:
        ConfigError: not a number > 0.
    """
    raw = os.environ.get("CKRUN_PERSIST_IDLE_S", "").strip()
    if not raw:
        return IDLE_LIMIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"CKRUN_PERSIST_IDLE_S={raw!r}: expected seconds > 0, the longest a persist "
            f"may run at SCHED_IDLE before it is raised (default {IDLE_LIMIT_S:g})"
        )
    return value


def start_lag_bound(idle: bool, limit_s: float, step: int) -> threading.Timer | None:
    """Start the lag bound of one persist: a daemon timer that raises the persist's
    threads to the normal policy (:func:`ckrun.storage.priority.raise_waited`) once
    ``limit_s`` seconds have passed; None when the persist does not run ``idle``.

    Call it from the thread that submits the persist (the training thread), never from
    the persist itself: a thread inherits its creator's scheduling policy, and a timer
    started by the persist after it lowered itself ran at ``SCHED_IDLE`` too, so with
    the cores busy (the case the bound exists for) it would not fire."""
    if not idle:
        return None

    def late() -> None:
        if priority.raise_waited():
            log.info(
                "persist of step %d still running after %.1f s at SCHED_IDLE: raised to "
                "the normal policy (lag bound CKRUN_PERSIST_IDLE_S)",
                step,
                limit_s,
            )

    timer = threading.Timer(limit_s, late)
    timer.daemon = True
    timer.name = "ckrun-persist-lag-bound"
    timer.start()
    return timer


@contextmanager
def lag_bound(timer: threading.Timer | None) -> Iterator[None]:
    """Within the block (one persist) the lag bound ``timer`` of
    :func:`start_lag_bound` may fire; it is cancelled when the block ends."""
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
