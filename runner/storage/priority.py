"""CPU and I/O priority of background persist threads: ``SCHED_IDLE`` while training
runs, the normal policy while someone waits for the persist.

On a machine whose cores a training loop keeps busy, every CPU-second a background
persist takes is a CPU-second the loop loses, and more when the loop is a team of
threads: a parallel matmul waits at its barrier for the thread the persist displaced.
``nice`` 10 still gives the persist 110/1134 of a core it competes for (the kernel's
weights, ``sched_prio_to_weight``); ``SCHED_IDLE`` (sched(7)) runs it only on a core
that is otherwise idle (weight 3), so the persist's CRC and system calls move into the
loop's gaps.  Measured in bench/README.md ("compute kept during the persist").

A persist nobody waits for may take longer; one that someone waits for must not starve
behind other busy processes (an emergency save under a preemption notice drains the
save in flight): :func:`raise_waited` moves every registered thread back to
``SCHED_OTHER`` (keeping its ``nice``) when a caller blocks on the persist, and the
worker lowers itself again when its next persist starts.  Leaving ``SCHED_IDLE`` needs
``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` soft limit >= 20 - nice (sched(7),
``__sched_setscheduler``); where neither holds, :func:`lower` uses ``nice`` alone.

I/O threads started by a lowered thread inherit its policy (``clone`` copies it) and
register themselves as they start (:func:`inheriting_pool`), so they are raised too.
A thread exists, already ``SCHED_IDLE``, before its registration runs; a raise that
lands in between would miss it, so every raise is counted (a generation, taken under
the lock with the list of threads to raise) and a thread that registers after a raise
its starter has not lowered itself since raises itself: under the one lock, either
the raise sees the registration or the registration sees the raise.  The lock is
replaced in a forked child (``os.register_at_fork``): a DataLoader worker forked while
a persist holds it would otherwise block on its first priority call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import resource
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = [
    "PERSIST_NICE",
    "can_leave_idle",
    "inheriting_pool",
    "lower",
    "normal_policy",
    "policy_name",
    "raise_thread",
    "raise_waited",
    "register_inherited",
    "registered",
]

log = logging.getLogger(__name__)

PERSIST_NICE = 10
_IOPRIO_SYSCALL = {"x86_64": 251, "aarch64": 30}
_CAP_SYS_NICE = 23
_lowered: dict[int, int] = {}  # tid of a lowered thread -> _raises when it lowered
_raises = 0  # raise_waited calls so far (the raise generation)
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """The child has one thread and none of the parent's: a fresh lock, no threads."""
    global _lock
    _lock = threading.Lock()
    _lowered.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def can_leave_idle(nice: int) -> bool:
    """Whether this process may move a thread from ``SCHED_IDLE`` back to
    ``SCHED_OTHER`` at ``nice``: ``CAP_SYS_NICE`` (``/proc/self/status`` ``CapEff``) or
    ``RLIMIT_NICE`` >= 20 - nice."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if soft == resource.RLIM_INFINITY or soft >= 20 - nice:
            return True
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError, AttributeError):
        pass
    return False


def lower(nice: int = PERSIST_NICE, *, idle: bool = True) -> str:
    """Lower the calling thread: ``nice`` (never raised above its current value),
    ``SCHED_IDLE`` when ``idle`` and it can be undone (:func:`can_leave_idle`), and the
    I/O priority (best-effort class, level 7: only the BFQ scheduler honours it).
    Best effort: each refused step is skipped.

    Returns:
        The policy now in force (:func:`policy_name`).
    """
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (AttributeError, OSError):
        pass
    if idle and hasattr(os, "SCHED_IDLE") and can_leave_idle(nice):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:
            log.debug("SCHED_IDLE refused for the persist thread (%s): nice %d only", e, nice)
    elif not idle and _policy(tid) == getattr(os, "SCHED_IDLE", None):
        try:  # left over from an earlier persist nobody waited for
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError as e:
            log.debug("could not leave SCHED_IDLE (%s)", e)
    nr = _IOPRIO_SYSCALL.get(platform.machine())
    if nr is not None:
        try:  # ioprio_set(IOPRIO_WHO_PROCESS, tid, IOPRIO_PRIO_VALUE(IOPRIO_CLASS_BE, 7))
            ctypes.CDLL(None, use_errno=True).syscall(nr, 1, tid, (2 << 13) | 7)
        except (OSError, AttributeError):
            pass
    with _lock:
        _prune()
        _lowered[tid] = _raises
    return policy_name(tid)


def inheriting_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of up to ``workers`` I/O threads (named ``name``-N) for the calling
    thread, which may be a lowered persist: each thread registers as it starts
    (:func:`register_inherited`, with the caller as its starter), so a waiter raises it
    along with the persist."""
    return ThreadPoolExecutor(
        workers,
        thread_name_prefix=name,
        initializer=register_inherited,
        initargs=(threading.get_native_id(),),
    )


def register_inherited(starter: int | None = None) -> None:
    """``ThreadPoolExecutor`` initializer of I/O threads: register the calling thread
    when it inherited ``SCHED_IDLE`` from the thread that started it, and raise it at
    once when a :func:`raise_waited` came after ``starter`` (that thread's native id)
    last lowered itself: the raise ran before this registration and missed it."""
    tid = threading.get_native_id()
    if not hasattr(os, "SCHED_IDLE") or _policy(tid) != os.SCHED_IDLE:
        return
    with _lock:
        _lowered[tid] = _raises
        since = _lowered.get(starter) if starter is not None else None
        late = since is not None and since < _raises
    if late:
        raise_thread(tid)


def raise_waited() -> int:
    """Move every registered thread still in ``SCHED_IDLE`` back to ``SCHED_OTHER``
    (its ``nice`` is kept): someone now waits for the persist.

    Returns:
        How many threads were raised.
    """
    global _raises
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    with _lock:
        _raises += 1  # a thread registering from here on sees it (register_inherited)
        _prune()
        tids = list(_lowered)
    return sum(raise_thread(tid) for tid in tids)


def normal_policy() -> None:
    """``ThreadPoolExecutor`` initializer of pools shared with callers that wait on them
    (the fsync pool, the retention thread): a thread started by a ``SCHED_IDLE`` persist
    inherits ``SCHED_IDLE`` (``clone`` copies it) and would stay there, so a later
    synchronous save would wait on a starving thread; it leaves it at once."""
    raise_thread(threading.get_native_id())


def raise_thread(tid: int) -> bool:
    """Move thread ``tid`` from ``SCHED_IDLE`` back to ``SCHED_OTHER`` (its ``nice``
    kept): someone waits for it.  Returns whether it was raised (False: not idle,
    exited, or not permitted)."""
    if not hasattr(os, "SCHED_IDLE") or _policy(tid) != os.SCHED_IDLE:
        return False
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        return True
    except OSError as e:  # exited meanwhile, or not permitted
        log.debug("could not raise thread %d (%s)", tid, e)
        return False


def registered() -> set[int]:
    """The live registered thread ids (for tests and diagnostics)."""
    with _lock:
        _prune()
        return set(_lowered)


def policy_name(tid: int) -> str:
    """``"idle"``, ``"other"`` (with its nice, e.g. ``"other nice 10"``) or ``"?"``."""
    p = _policy(tid)
    if p is None:
        return "?"
    if p == getattr(os, "SCHED_IDLE", -1):
        return "idle"
    try:
        return f"other nice {os.getpriority(os.PRIO_PROCESS, tid)}"
    except OSError:
        return "other"


def _policy(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except (OSError, AttributeError):
        return None


def _prune() -> None:
    """Forget exited threads (their ids may be reused by other processes)."""
    alive = (
        {int(t) for t in os.listdir("/proc/self/task")}
        if os.path.isdir("/proc/self/task")
        else None
    )
    if alive is not None:
        for tid in _lowered.keys() - alive:
            del _lowered[tid]
