"""The save side of :class:`ckrun.Checkpointer`: ``snapshot``, ``save``, ``finalize``,
``persist``.

A mixin of the facade (:mod:`ckrun.checkpoint.checkpointer`): the methods run the save
pipeline (:mod:`ckrun.checkpoint.pipeline`: snapshot → persist → verify → commit →
retain) over the Checkpointer's commit context, first draining an in-flight
``async_save`` (:mod:`ckrun.checkpoint.async_save`).  ``finalize`` writes the final
artifact and then the completion marker, checking the lease fence first (DESIGN.md §7).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ckrun.checkpoint import layout, pipeline
from ckrun.checkpoint.discovery import committed_final, completion
from ckrun.checkpoint.manifest import Manifest, ManifestKind, utc_now
from ckrun.checkpoint.marker import CompletionMarker
from ckrun.checkpoint.pipeline import CommitContext
from ckrun.checkpoint.reporting import report_save
from ckrun.checkpoint.sharding import Planned
from ckrun.control import record_notice_save
from ckrun.storage.base import ObjectWriter

if TYPE_CHECKING:
    from ckrun.checkpoint.async_save import AsyncSaver

__all__ = ["SaveMethods"]

log = logging.getLogger(__name__)


class SaveMethods:
    """``snapshot``/``save``/``finalize``/``persist`` of the Checkpointer (a mixin: the
    Checkpointer provides ``_ctx``, ``_async`` and ``compat_block``)."""

    _ctx: CommitContext
    _async: AsyncSaver | None

    if TYPE_CHECKING:

        def compat_block(self, state: Mapping[str, Any] | None = None) -> dict[str, Any]: ...

    def snapshot(self, state: Mapping[str, Any], *, copy: bool = False) -> Planned:
        """Step 1 of a save: the state (and RNG) flattened and cut into this rank's shard
        entries (a collective with more than one rank, :mod:`ckrun.checkpoint.sharding`).

        Args:
            copy: clone tensors to host now (for a persist that overlaps training).
        """
        return pipeline.snapshot(self._ctx, state, copy=copy)

    def save(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None
    ) -> Manifest:
        """Save ``state`` as ``step``; returns once the manifest is durable.

        Raises:
            RunComplete: the run has a completion marker.
            StorageFull: the device is full (path and bytes named); nothing partial is
                left under a final name and the previous checkpoint is intact.
            StorageError: other storage failures (read-only, I/O).
            CheckpointError: a value in ``state`` cannot be checkpointed.
        """
        t0 = time.monotonic()
        m, fresh = self._save(step, state, pipeline.kind_for(self._ctx, step), metrics)
        try:
            report_save(m, time.monotonic() - t0, "sync", self._ctx.rank)
            record_notice_save(m.step)  # after a notice: an exit now is a preemption
        finally:
            if fresh:  # the last step: waking its thread costs the save nothing
                pipeline.retain_later(self._ctx, m)
        return m

    def finalize(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None
    ) -> Manifest:
        """Write the final artifact (``final/``) and then ``COMPLETE.json``; idempotent.

        Finalizing a step again returns its final manifest: when the marker already names
        ``step``, nothing is written; when the final artifact of ``step`` is committed
        but the marker is missing (the process ended between the two), the marker is
        written from that artifact and the state is not saved again.  So a run resumed
        from its own final artifact completes instead of colliding with it
        (``StepAlreadyCommitted``).

        Raises:
            RunComplete: finalized at another step.  Storage errors as :meth:`save`.
        """
        ctx = self._ctx
        marker, _ = completion(ctx.storage)
        if marker is not None and marker.final_step == step:
            ctx.complete = True
            return Manifest.loads(ctx.storage.get(marker.manifest_key), key=marker.manifest_key)
        existing = committed_final(ctx.storage, step) if marker is None else None
        reuse, _ = ctx.group.all_ok(existing is not None)  # every rank decides alike
        if reuse and existing is not None:
            if self._async is not None:
                self._async.drain()
            log.info("final artifact of step %d is already committed: writing its marker", step)
            m = existing
        else:
            t0 = time.monotonic()
            m, fresh = self._save(step, state, ManifestKind.FINAL, metrics)
            if fresh:
                pipeline.retain_later(ctx, m)
            report_save(m, time.monotonic() - t0, "sync", ctx.rank)
        if ctx.rank == 0:
            ctx.check_fence(f"completion marker of step {step}")
            marker_m = CompletionMarker.for_manifest(m)  # the epoch of this writer
            marker_m = dataclasses.replace(marker_m, lease_epoch=ctx.lease_epoch)
            ctx.storage.put(layout.COMPLETE, marker_m.dumps())
        ctx.complete = True
        return m

    def _save(
        self, step: int, state: Mapping[str, Any], kind: str, metrics: Mapping[str, Any] | None
    ) -> tuple[Manifest, bool]:
        """The synchronous save of ``save`` and ``finalize``: the committed manifest, and
        whether this call committed it (then its retention pass is due: the caller
        starts it with :func:`~ckrun.checkpoint.pipeline.retain_later` once nothing
        else of the save is left, so the retention thread's wake-up does not delay the
        save's return; issue 19, bench/README.md "Eleventh session")."""
        started, created = time.monotonic(), utc_now()
        pipeline.check_step(step)
        pipeline.begin(self._ctx)
        if self._async is not None:  # an async save in flight first (deadline-aware)
            early = self._async.before_sync_save(step, kind)
            if early is not None:
                return early, False
        last = pipeline.already_committed(self._ctx, step, kind)
        if last is not None:
            return last, False
        snap = self.snapshot(state)
        m = self.persist(
            step,
            snap,
            kind=kind,
            # built while the shard's write-back runs (the state is unchanged until the
            # save returns): off the time the save waits for the disk
            compat=lambda: self.compat_block(state),
            metrics=metrics,
            created_utc=created,
            started=started,
        )
        return m, True

    def persist(
        self,
        step: int,
        snap: Planned,
        *,
        kind: str,
        compat: dict[str, Any] | Callable[[], dict[str, Any]],
        metrics: Mapping[str, Any] | None,
        created_utc: str,
        started: float,
        open_shard: Callable[[str], ObjectWriter] | None = None,
    ) -> Manifest:
        """Steps 2-4 of a save: write the shard, check its size, commit the manifest
        (:func:`ckrun.checkpoint.pipeline.persist`; ``compat`` the compat block or a
        function building it from a state that does not change meanwhile)."""
        return pipeline.persist(
            self._ctx,
            step,
            snap,
            kind=kind,
            compat=compat,
            metrics=metrics,
            created_utc=created_utc,
            started=started,
            open_shard=open_shard,
        )
