"""Background persist for ``Checkpointer.async_save`` (DESIGN.md §3 step 1).

``async_save`` blocks only for the snapshot: the state (and RNG) is flattened and every
tensor is copied into host buffers allocated on the first save and reused by the next
ones (:class:`ckrun.checkpoint.host_buffers.HostBuffers`: one arena in the shard's data layout;
pinned memory when a tensor lives on a GPU, so the device-to-host copies are DMA — that
path is written but untested here: no GPU).  Steps 2-5 of the commit protocol (persist
with CRC32C, verify, manifest, retention) run on one worker thread; on a local disk the
shard is written with ``O_DIRECT`` straight from the arena (no staging copy).  At most
one save is in flight (the next ``async_save`` or ``save`` waits for it, since it reuses
the buffers).  A checkpoint exists only once its manifest is written, so ``latest()``,
discovery and retention see an async save only after its background commit is durable;
a process killed during the persist leaves the previous checkpoint.

With ``lazy=True`` the call does not copy parameters and optimizer state: the worker
thread copies them first, while the next step's forward and backward run, and a step
pre-hook on each optimizer of the state copies what is left before ``step()`` writes
(:mod:`ckrun.checkpoint.lazy_snapshot`; opt-in, eager under a notice).

Errors of the worker surface on ``handle.result()``, else on the next save, ``wait()`` or
``close()`` (each failure is raised once).  At interpreter exit the in-flight save is
finished before ``concurrent.futures`` shuts down (:mod:`ckrun.checkpoint.async_exit`);
an unobserved failure is then printed.  ``os._exit`` or a signal that kills the process
skips this: the previous checkpoint stays the newest.

The worker lowers its priority at the start of every persist
(:func:`ckrun.storage.priority.lower`): ``SCHED_IDLE`` (``CKRUN_PERSIST_SCHED=idle``,
the default; ``other`` keeps the normal policy) on top of ``nice`` 10
(``CKRUN_PERSIST_NICE``), and the I/O priority; threads it starts, such as the O_DIRECT
writer's, inherit both.  A training loop then keeps the CPUs: the persist's CRC and
system calls run in the loop's gaps.  Whoever waits for the persist (``result()``, the
next save, ``wait()``, ``close()``, an emergency save) first raises its threads back to
the normal policy (:func:`ckrun.storage.priority.raise_waited`), so a waited-for persist
never starves behind other busy processes, and one nobody waits for is raised after
``CKRUN_PERSIST_IDLE_S`` (10 s; :mod:`ckrun.checkpoint.persist_policy`), so an async
save's durability lag stays bounded.  Measured in bench/README.md ("compute kept
during the persist").

Emergency saves: a synchronous ``save`` while a save is in flight reads the notice
(``ckrun.control_files.read_notice``) and waits for the in-flight save.  If the deadline then
leaves time for a full save (estimated from the last measured durations, x
:data:`SAFETY`), it saves the current state; otherwise it returns the in-flight save's
manifest: the newest complete snapshot is committed instead of racing the deadline.  If
the in-flight save failed, the error is logged and the current state is saved.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckrun.checkpoint import pipeline
from ckrun.checkpoint.async_exit import register_exit_drain
from ckrun.checkpoint.host_buffers import HostBuffers
from ckrun.checkpoint.lazy_snapshot import LazySnapshot
from ckrun.checkpoint.manifest import Manifest, ManifestKind, utc_now
from ckrun.checkpoint.persist_policy import (
    idle_limit_s,
    lag_bound,
    persist_sched,
    start_lag_bound,
)
from ckrun.checkpoint.pipeline import CommitContext, SaveHandle, check_step
from ckrun.checkpoint.sharding import Planned
from ckrun.errors import CheckpointError
from ckrun.storage import priority

__all__ = ["AsyncSaveHandle", "AsyncSaver", "SaveHandle", "check_step", "warn_sync_fallback"]

log = logging.getLogger(__name__)

#: Persist rate assumed before one is measured, bytes/s (conservative for local disks).
DEFAULT_RATE = 200e6
#: Margin on estimated durations when deciding whether a deadline allows a new save.
SAFETY = 1.5
PERSIST_NICE = priority.PERSIST_NICE


class AsyncSaveHandle(SaveHandle):
    """A background save: ``result()`` waits for its durable commit.

    Attributes:
        step: the step being saved.
        stall_s: seconds ``async_save`` blocked the caller (the snapshot).
        nbytes: tensor bytes snapshotted.
    """

    def __init__(
        self, future: Future[Manifest], step: int, stall_s: float, nbytes: int, started: float
    ) -> None:
        super().__init__(future)
        self.step, self.stall_s, self.nbytes, self.started = step, stall_s, nbytes, started
        self.observed = False

    def result(self, timeout: float | None = None) -> Manifest:
        """Wait (at most ``timeout`` s) for the commit; re-raises the worker's error.
        The persist's threads leave ``SCHED_IDLE`` first (module docstring)."""
        self.observed = True
        if not self._future.done():
            priority.raise_waited()
        return super().result(timeout)

    def error(self) -> BaseException | None:
        """The worker's exception once done (None while running or on success)."""
        return self._future.exception() if self._future.done() else None


class AsyncSaver:
    """The background persist of one :class:`~ckrun.Checkpointer` (module docstring).

    Args:
        ctx: the Checkpointer's commit context (the pipeline's stages run on it).
        compat_block: the Checkpointer's compat block of a state.
        nice: the worker's CPU niceness (default ``CKRUN_PERSIST_NICE``, else 10).
    """

    def __init__(
        self,
        ctx: CommitContext,
        compat_block: Callable[[Mapping[str, Any]], dict[str, Any]],
        *,
        nice: int | None = None,
    ) -> None:
        if nice is None:
            from ckrun.checkpoint.env import env_int

            nice = env_int("CKRUN_PERSIST_NICE", PERSIST_NICE)
        self._ctx = ctx
        self._compat_block = compat_block
        self.buffers = HostBuffers()
        self.nice, self.idle = nice, persist_sched()
        self.idle_limit_s = idle_limit_s()  # SCHED_IDLE lag bound (persist_policy)
        self.policy: str | None = None  # the worker's policy during the last persist
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckrun-persist")
        self._inflight: AsyncSaveHandle | None = None
        self._lazy: LazySnapshot | None = None  # the lazy copy of the save in flight
        self._copier: ThreadPoolExecutor | None = None  # its thread (first lazy save)
        self._lock = threading.Lock()
        self.last_stall_s: float | None = None
        self.last_durable_s: float | None = None  # async_save call -> commit
        self.last_persist_s: float | None = None  # worker start -> commit
        self._closed = False
        register_exit_drain(weakref.ref(self))

    # -- the save -------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        *,
        lazy: bool = False,
    ) -> SaveHandle:
        """Snapshot now, persist in the background; see ``Checkpointer.async_save``.

        ``lazy``: copy parameters and optimizer state during the next step instead
        (:mod:`ckrun.checkpoint.lazy_snapshot`); eager anyway while a notice is pending.

        Returns:
            An :class:`AsyncSaveHandle`, or a completed handle when this process already
            committed ``step``.
        """
        started, created = time.monotonic(), utc_now()
        check_step(step)
        if self._closed:
            raise CheckpointError("async_save after close(): create a new Checkpointer")
        ctx = self._ctx
        # the last sync save's retention pass is not waited for in the pause: the
        # persist joins it before it writes (bench/README.md, "Eighteenth session")
        pipeline.begin(ctx, join_retention=False)
        kind = pipeline.kind_for(ctx, step)
        with self._lock:
            self.drain()
            last = pipeline.already_committed(ctx, step, kind)
            if last is not None:
                return SaveHandle.completed(last)
            compat = self._compat_block(state)
            lz = None
            if lazy and _no_notice():  # an emergency save stays eager
                planned = pipeline.snapshot(ctx, state)
                dests = self.buffers.destinations(planned)
                lz = self._lazy = LazySnapshot(step, planned, dests, state)
                snap = dataclasses.replace(planned, tensors=dests)
                if self._copier is None:
                    self._copier = ThreadPoolExecutor(1, thread_name_prefix="ckrun-copier")
                self._copier.submit(lz.copy_all)
            else:
                snap = self.buffers.stage(pipeline.snapshot(ctx, state))
            meta = copy.deepcopy(dict(metrics or {}))
            stall = time.monotonic() - started
            bound = start_lag_bound(self.idle, self.idle_limit_s, step)  # not idle itself
            prior = ctx.retaining  # the last sync save's retention pass, if running
            fut = self._pool.submit(
                self._persist, step, snap, kind, compat, meta, created, started, lz, bound, prior
            )
            # taken over: the persist joins it (its error fails this save, once); a later
            # sync save or close drains this persist first
            ctx.retaining = None
            h = AsyncSaveHandle(fut, step, stall, snap.nbytes, started)
            self._inflight, self.last_stall_s = h, stall
        return h

    def _persist(
        self,
        step: int,
        snap: Planned,
        kind: str,
        compat: dict[str, Any],
        metrics: dict[str, Any],
        created: str,
        started: float,
        lz: LazySnapshot | None = None,
        bound: threading.Timer | None = None,
        prior: Future[None] | None = None,
    ) -> Manifest:
        self.policy = priority.lower(self.nice, idle=self.idle)  # raised by a waiter
        with lag_bound(bound):
            if prior is not None:  # the last save's retention pass: never beside a write
                prior.result()
            t0 = time.monotonic()  # the persist's own time (the notice's estimates)
            open_shard = self.buffers.writer_for(self._ctx.storage)
            if lz is not None:  # every tensor copied (by the copier or a hook), checked
                lz.wait()
                open_shard = lz.verified(open_shard or self._ctx.storage.open_write)
            m = pipeline.persist(
                self._ctx,
                step,
                snap,
                kind=kind,
                compat=compat,
                metrics=metrics,
                created_utc=created,
                started=started,
                open_shard=open_shard,
            )
        self.last_persist_s = time.monotonic() - t0
        self.last_durable_s = time.monotonic() - started
        pipeline.retain(self._ctx, m)
        return m

    # -- waiting --------------------------------------------------------------------

    def drain(self) -> Manifest | None:
        """Wait for the in-flight save; raise its error unless already observed.

        Returns:
            Its manifest, or None when nothing was in flight (or it failed, observed).
        """
        h = self._inflight
        if h is None:
            return None
        self._inflight = None
        if not h._future.done():
            priority.raise_waited()
        err = h._future.exception()  # waits
        if self._lazy is not None:  # the copies are done: no hook is needed any more
            self._lazy.close()
            self._lazy = None
        if err is None:
            return h._future.result()
        if h.observed:
            return None
        h.observed = True
        err.add_note(f"raised by the background save of step {h.step} (ckrun async_save)")
        raise err

    def inflight(self) -> AsyncSaveHandle | None:
        """The save in flight (done or not) that nobody has drained yet."""
        return self._inflight

    def before_sync_save(self, step: int, kind: str) -> Manifest | None:
        """Called by ``save``/``finalize`` first: drain, or (deadline) commit the snapshot.

        Under a notice, a failed in-flight save is logged and the synchronous save goes
        ahead (the state must reach the disk); otherwise its error is raised here.

        Returns:
            A manifest to return instead of saving (the in-flight snapshot, committed
            because the notice deadline does not leave time for a new save), else None.

        Raises:
            Exception: the in-flight save's error (raised once), without a notice.
        """
        from ckrun.control_files import read_notice

        h = self._inflight
        notice = read_notice() if h is not None and kind != ManifestKind.FINAL else None
        if notice is None:
            self.drain()
            return None
        assert h is not None
        rest, new = self.estimates(h)
        try:
            m = self.drain()
        except Exception as e:  # the emergency save below is the state's last chance
            log.error(
                "the background save of step %d failed (%s); the emergency save of "
                "step %d goes ahead",
                h.step,
                e,
                step,
            )
            return None
        left = notice.seconds_left()  # after the wait
        if m is None or left >= SAFETY * new:
            log.info(
                "emergency save of step %d after the in-flight save of step %d "
                "(~%.1f s + ~%.1f s, %.1f s before the deadline)",
                step,
                h.step,
                rest,
                new,
                left,
            )
            return None
        log.warning(
            "emergency save of step %d: %.1f s to the deadline after the in-flight "
            "save do not allow a new one (~%.1f s); committed the in-flight snapshot "
            "of step %d instead (steps %d..%d are lost)",
            step,
            left,
            new,
            m.step,
            m.step + 1,
            step,
        )
        return m

    def estimates(self, h: AsyncSaveHandle) -> tuple[float, float]:
        """Seconds left for the in-flight save ``h`` and for a new synchronous save."""
        w = self._ctx.written
        rate = (
            h.nbytes / self.last_persist_s
            if self.last_persist_s
            else (
                w.total_size_bytes / w.save_duration_s if w and w.save_duration_s else DEFAULT_RATE
            )
        )
        whole = h.nbytes / max(rate, 1.0)
        rest = max(0.0, whole - (time.monotonic() - h.started - h.stall_s))
        return rest, whole

    def close(self) -> None:
        """Drain (raising an unobserved error) and stop the worker."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)
            if self._copier is not None:
                self._copier.shutdown(wait=True)


def _no_notice() -> bool:
    """No preemption notice is pending (a save under a notice stays eager)."""
    from ckrun.control_files import read_notice

    return read_notice() is None


_warned: list[bool] = []


def warn_sync_fallback(world_size: int) -> None:
    """Log once that ``async_save`` saves synchronously on more than one rank."""
    if not _warned:
        _warned.append(True)
        log.warning(
            "async_save with %d ranks saves synchronously: the distributed commit "
            "is a collective, which cannot run on a background thread",
            world_size,
        )
