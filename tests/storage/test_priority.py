"""The persist's priority protocol (storage/priority): an I/O thread started by a
``SCHED_IDLE`` persist is raised with it when a caller waits, however late the thread
itself gets to run, and a forked child never inherits the module's lock held.  Real
threads and a real ``fork``; the kernel's ``sched_getscheduler`` is what is asserted,
and every wait is a bounded event wait that records an ordering, never a timing."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from ckrun.storage import priority

IDLE_OK = hasattr(os, "SCHED_IDLE") and priority.can_leave_idle(priority.PERSIST_NICE)


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_an_io_thread_that_registers_after_the_raise_is_raised_too() -> None:
    """A thread is created SCHED_IDLE (clone copies the persist's policy) but registers
    only when its initializer runs.  A caller that waits for the persist in between
    (raise_waited) used to miss it: the thread stayed SCHED_IDLE for the whole wait.
    The initializer here is held back by an event, standing in for "not scheduled yet"."""
    out: dict[str, Any] = {}
    created, go = threading.Event(), threading.Event()

    def late_initializer(parent: int) -> None:
        out["born"] = os.sched_getscheduler(0)
        created.set()
        assert go.wait(10), "the test never released the initializer"
        priority.register_inherited(parent)

    def persist() -> None:
        out["policy"] = priority.lower(12)
        # priority.inheriting_pool's wiring, with the registration held back
        pool = ThreadPoolExecutor(
            1, initializer=late_initializer, initargs=(threading.get_native_id(),)
        )
        try:
            fut = pool.submit(os.sched_getscheduler, 0)  # the thread is created here
            assert created.wait(10), "the I/O thread never started"
            out["raised"] = priority.raise_waited()  # a caller waits for this persist
            go.set()
            out["io"] = fut.result(10)
        finally:
            pool.shutdown()

    t = threading.Thread(target=persist)
    t.start()
    t.join(30)
    assert out["policy"] == "idle" and out["born"] == os.SCHED_IDLE
    assert out["raised"] >= 1  # the persist thread itself
    assert out["io"] == os.SCHED_OTHER  # was SCHED_IDLE: the late thread was missed


@pytest.mark.skipif(not IDLE_OK, reason="leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE")
def test_a_thread_of_a_later_persist_nobody_waits_for_stays_idle() -> None:
    """The raise is remembered per persist: once the persist thread lowers itself again
    for its next persist, a new I/O thread of that persist stays SCHED_IDLE."""
    out: dict[str, Any] = {}

    def persist() -> None:
        priority.lower(12)
        priority.raise_waited()  # the first persist was waited for
        out["again"] = priority.lower(12)  # the next one starts: nobody waits yet
        with priority.inheriting_pool(1, "ckrun-test-io") as pool:
            out["io"] = pool.submit(os.sched_getscheduler, 0).result(10)

    t = threading.Thread(target=persist)
    t.start()
    t.join(30)
    assert out["again"] == "idle" and out["io"] == os.SCHED_IDLE


def test_a_child_forked_while_the_lock_is_held_can_use_it(
    fork_call: Callable[[Callable[[], object]], int],
    reap_child: Callable[[int], int | None],
) -> None:
    """DataLoader workers fork while a persist may hold the module's lock (a lower, a
    registration or a raise); without an at-fork reset the child inherits it held and
    its first priority call blocks for ever.  The lock is held here to make that moment
    deterministic; the child exits 0 only if its priority calls return."""
    with priority._lock:
        pid = fork_call(lambda: (priority.registered(), priority.raise_waited()))
    code = reap_child(pid)
    assert code is not None, "the forked child blocked on the priority lock it inherited held"
    assert code == 0
