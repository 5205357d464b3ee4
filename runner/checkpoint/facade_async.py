"""The async-save and checkpoint-interval side of :class:`ckrun.Checkpointer`:
``async_save``, ``wait``, ``should_save``, ``interval``.

A mixin of the facade (:mod:`ckrun.checkpoint.checkpointer`).  ``async_save`` runs the
persist in the background (:mod:`ckrun.checkpoint.async_save`, at most one in flight);
``should_save``/``interval`` apply ``checkpoint_every`` (a number of steps, or
``"auto"``: the Young/Daly interval of :mod:`ckrun.checkpoint.interval`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.pipeline import CommitContext, SaveHandle

if TYPE_CHECKING:
    from ckrun.checkpoint.async_save import AsyncSaver
    from ckrun.checkpoint.interval import AutoInterval, IntervalEstimate

__all__ = ["AsyncMethods"]


class AsyncMethods:
    """``async_save``/``wait``/``should_save``/``interval`` of the Checkpointer (a mixin:
    the Checkpointer provides the attributes below, ``compat_block`` and ``save``)."""

    _ctx: CommitContext
    _async: AsyncSaver | None  # the background persist of async_save
    _auto: AutoInterval | None  # checkpoint_every="auto", built on first use
    _every: int | str | None  # checkpoint_every as parsed
    _mtbi_s: float | None
    lazy_snapshot: bool

    if TYPE_CHECKING:

        def compat_block(self, state: Mapping[str, Any] | None = None) -> dict[str, Any]: ...

        def save(
            self,
            step: int,
            state: Mapping[str, Any],
            *,
            metrics: Mapping[str, Any] | None = None,
        ) -> Manifest: ...

    def async_save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        lazy: bool | None = None,
    ) -> SaveHandle:
        """Snapshot ``state`` into reused host buffers; persist and commit in the background.

        Returns once the snapshot is copied (training may change ``state`` right away);
        ``handle.result()`` returns the manifest once the commit is durable.  At most one
        save is in flight: a second ``async_save`` or ``save`` first waits for it.  With
        more than one rank this saves synchronously (the distributed commit is a
        collective).  See :mod:`ckrun.checkpoint.async_save`.  ``lazy=True`` (default:
        the Checkpointer's ``lazy_snapshot``) returns before parameters and optimizer
        state are copied: they are copied during the next step, before the optimizer
        writes them (:mod:`ckrun.checkpoint.lazy_snapshot`).

        Raises:
            The previous background save's error (once); otherwise as :meth:`save` for
            the snapshot.  Persist errors surface on the handle, the next save,
            :meth:`wait` or :meth:`close`.
        """
        from ckrun.checkpoint import async_save as aio

        if self._ctx.world_size > 1:
            aio.warn_sync_fallback(self._ctx.world_size)
            return SaveHandle.completed(self.save(step, state, metrics=metrics))
        if self._async is None:
            self._async = aio.AsyncSaver(self._ctx, self.compat_block)
        t0 = time.monotonic()
        lazy = self.lazy_snapshot if lazy is None else lazy
        h = self._async.save(step, state, metrics, lazy=lazy)
        if self._ctx.rank == 0:
            from ckrun.runlog import child_event

            child_event("save", step=step, seconds=time.monotonic() - t0, mode="async")
        return h

    def wait(self) -> Manifest | None:
        """Wait for the in-flight ``async_save``; its manifest, or None when none.

        Raises:
            The background save's error, unless already raised or seen on its handle.
        """
        return None if self._async is None else self._async.drain()

    def should_save(self, step: int, *, sync: bool = False) -> bool:
        """Whether to save after ``step`` under ``checkpoint_every``.

        An int N: ``step`` is a positive multiple of N.  ``"auto"``: the Young/Daly
        interval (:mod:`ckrun.checkpoint.interval`) of compute has passed since the last
        True.  ``sync=True`` makes every rank agree (all-reduce MAX, one collective).

        Raises:
            ConfigError: the Checkpointer has no ``checkpoint_every``.
        """
        from ckrun.checkpoint import interval

        if self._auto is None and self._every == "auto":
            self._auto = self._auto_interval()
        return interval.should_save(self._every, self._auto, step, sync=sync)

    def interval(self) -> IntervalEstimate | None:
        """The interval ``"auto"`` picks now (None without ``checkpoint_every="auto"``)."""

        if self._every != "auto":
            return None
        if self._auto is None:
            self._auto = self._auto_interval()
        return self._auto.current()

    def _auto_interval(self) -> AutoInterval:
        from ckrun.checkpoint import interval

        return interval.auto_for(self._ctx, lambda: self._async, mtbi_s=self._mtbi_s)
