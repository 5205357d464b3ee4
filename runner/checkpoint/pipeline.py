"""The save pipeline of :class:`ckrun.Checkpointer`, over a small commit context.

A save is, in order (DESIGN.md §3): **snapshot** (the state and RNG flattened, tensors
referenced or copied to host) → **persist** (one shard per rank under an attempt-unique
key, CRC32C while streaming) → **verify** (the shard's size read back by ``head``) →
**commit** (the manifest, written last with a conditional create: one commit per step)
→ **retain** (rank 0 deletes what retention no longer keeps).  With more than one rank
persist/verify/commit are the collective of :mod:`ckrun.checkpoint.collective`.

:class:`CommitContext` holds what these steps read (the storage, run, attempt, rank,
world size, retention settings, the writer lock) and what they record for the next save
and the next load (the step this process resumed from, the compat drift, the manifests
it wrote or verified, the last manifest it committed).  The synchronous
:meth:`~ckrun.Checkpointer.save` and the background persist of
:mod:`ckrun.checkpoint.async_save` both run these functions on the Checkpointer's context.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from ckrun.checkpoint import collective, layout, retention, sharding
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.commit import commit_manifest
from ckrun.checkpoint.compat import normalize
from ckrun.checkpoint.discovery import completion
from ckrun.checkpoint.lease import Fence
from ckrun.checkpoint.lock import WriterLock
from ckrun.checkpoint.manifest import Manifest, ManifestKind, ShardInfo, utc_now
from ckrun.checkpoint.plan_memo import PlanMemo
from ckrun.checkpoint.save_handle import SaveHandle as SaveHandle  # its former home
from ckrun.checkpoint.state import capture
from ckrun.control import notice_pending
from ckrun.errors import CheckpointError, LeaseLost, RunComplete, StateUnusable, StorageError
from ckrun.storage import priority
from ckrun.storage.base import ObjectWriter, PublishesAfter, Storage, publishes_after

log = logging.getLogger(__name__)


@dataclass
class CommitContext:
    """What each step of a save reads, and what it records (module docstring).

    Attributes:
        storage: the run root.
        run, attempt: recorded in every manifest and shard key.
        rank, world_size, group: this process in the job (``group``: the checkpoint's
            own collectives).
        keep_last, milestone_every: retention (see :mod:`ckrun.checkpoint.retention`).
        rng: capture RNG states in the snapshot.
        lock: the writer lock (rank 0), taken by :func:`begin`; None when fenced.
        fence: the lease fence (``CKRUN_LEASE_EPOCH``, :mod:`ckrun.checkpoint.lease`):
            every commit, marker and retention pass first checks that the epoch is
            still current; unfenced (no supervisor) by default.
        resumed_from: the step the last load restored (protected from retention).
        drift: compat differences allowed at that load (recorded in new manifests).
        verified: manifest keys this process wrote or verified (not re-hashed).
        written: the last manifest this process committed.
        complete: the run has its completion marker.
        retaining: the last sync save's retention pass, in the background on the one
            thread of ``retainer`` (:func:`retain_later`); joined before the next save.
        signature: the model signature of the state last seen (:func:`ckrun.checkpoint.
            signature.of_state`), recorded in new manifests, compared by the next load.
        dirty: ``data_ptr → (name, tensor)`` of live tensors a failed in-place load
            wrote and no verified load has rewritten since (:mod:`.inplace_load`).
        unusable: why the state is unusable (a dirty tensor is still in use), or None;
            every save refuses while it is set (:func:`begin`).
        ledger, plans: what retention knows between passes (:class:`~.retention.Ledger`);
            the last save's plan, reused for its structure (:mod:`.plan_memo`).
    """

    storage: Storage
    run: str
    attempt: int
    rank: int
    world_size: int
    group: collective.Group
    keep_last: int = 3
    milestone_every: int | None = None
    rng: bool = True
    lock: WriterLock | None = None
    resumed_from: int | None = None
    drift: list[str] = field(default_factory=list)
    verified: set[str] = field(default_factory=set)
    written: Manifest | None = None
    complete: bool = False
    retaining: Future[None] | None = None
    retainer: ThreadPoolExecutor | None = None
    signature: dict[str, Any] | None = None
    fence: Fence | None = None
    dirty: dict[int, tuple[str, Any]] = field(default_factory=dict)
    unusable: str | None = None
    ledger: retention.Ledger = field(default_factory=retention.Ledger)
    plans: PlanMemo = field(default_factory=PlanMemo)

    def check_fence(self, what: str) -> None:
        """Raise ``LeaseLost`` when fenced and the lease epoch is no longer current."""
        if self.fence is not None:
            self.fence.check(what)

    @property
    def lease_epoch(self) -> int | None:
        """The lease epoch this process writes under (None: unfenced)."""
        return None if self.fence is None else self.fence.epoch


def check_step(step: Any) -> None:
    """Raise CheckpointError unless ``step`` is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")


def kind_for(ctx: CommitContext, step: int) -> ManifestKind:
    """``milestone`` for a step retention keeps forever, else ``recovery``."""
    milestone = bool(ctx.milestone_every and step % ctx.milestone_every == 0)
    return ManifestKind.MILESTONE if milestone else ManifestKind.RECOVERY


def check_not_complete(ctx: CommitContext, *, probe: bool = True) -> None:
    """Raise RunComplete once the run has its completion marker (nothing more saved);
    ``probe=False``: only what this process knows, no storage read."""
    if probe and not ctx.complete:
        marker, _ = completion(ctx.storage)
        ctx.complete = marker is not None
    if ctx.complete:
        raise RunComplete(
            f"run {ctx.run!r} in {ctx.storage.url} is complete "
            f"({layout.COMPLETE} exists): nothing more is saved; start a "
            "new run directory to train further"
        )


def acquire(ctx: CommitContext) -> None:
    """Take the writer lock (rank 0; idempotent); raises RunLocked: another process
    writes this run."""
    if ctx.lock is not None:
        ctx.lock.acquire()


def begin(ctx: CommitContext, *, join_retention: bool = True) -> None:
    """Before any save: the state is not half-loaded, the last save's retention has
    finished (``join_retention=False``, an async save's pause: its persist takes over
    ``ctx.retaining`` and joins it before it writes), the run is not complete, and this
    process holds the lock.  After its first commit a one-rank save reads the marker
    just before its commit instead (:func:`persist`): off the time before the shard is
    written.

    Raises:
        StateUnusable: a failed in-place load left the state half-written.
    """
    if ctx.unusable:
        raise StateUnusable(ctx.unusable)
    if join_retention:
        wait_retention(ctx)
    check_not_complete(ctx, probe=ctx.written is None or ctx.world_size > 1)
    acquire(ctx)


def already_committed(ctx: CommitContext, step: int, kind: str) -> Manifest | None:
    """The manifest this process last committed when it is ``step`` of ``kind`` (e.g. a
    periodic save and then a preemption save at the same step boundary), else None."""
    last = ctx.written
    if last is not None and last.step == step and last.kind == kind:
        log.info("step %d already committed by this process: not saving it again", step)
        return last
    return None


def snapshot(
    ctx: CommitContext, state: Mapping[str, Any], *, copy: bool = False
) -> sharding.Planned:
    """Step 1: the state (and RNG) flattened and cut into this rank's shard entries
    (:func:`ckrun.checkpoint.sharding.plan`: a collective with more than one rank).

    Args:
        copy: clone tensors to host now (for a persist that overlaps training).
    """
    return ctx.plans.plan(fmt.snapshot(capture(state, rng=ctx.rng), copy=copy), ctx.group)


def persist(
    ctx: CommitContext,
    step: int,
    snap: sharding.Planned,
    *,
    kind: str,
    compat: dict[str, Any] | Callable[[], dict[str, Any]],
    metrics: Mapping[str, Any] | None,
    created_utc: str,
    started: float,
    open_shard: Callable[[str], ObjectWriter] | None = None,
) -> Manifest:
    """Steps 2-4: write the shard, check its size, commit the manifest.

    ``compat`` is the compat block, or a function that builds it (and the state's
    signature) from a state unchanged until the commit: one rank calls it after its
    shard is written, while the disk writes the shard back (issue 19, small saves).

    ``open_shard`` opens the shard's writer (default ``storage.open_write``; async saves
    pass a zero-copy writer over their host buffers, :mod:`ckrun.checkpoint.host_buffers`).

    Raises:
        StorageError: a write failed, or the shard reads back with another size.
        CheckpointError: a collective save failed on another rank.
    """
    try:
        kind = ManifestKind(kind)  # a ManifestKind, or its value
        if callable(compat) and ctx.world_size > 1:
            compat = compat()  # every rank builds it first, as before

        def make(shards: tuple[ShardInfo, ...], mkey: str, lay: dict[str, Any] | None) -> Manifest:
            block = compat() if callable(compat) else compat
            return make_manifest(
                ctx, step, kind, shards, block, metrics, created_utc, started, mkey, lay
            )

        if ctx.world_size > 1:  # collective: every rank's shard, rank 0 commits
            m = collective.persist(ctx, step, snap, kind=kind, make_manifest=make)
            ctx.ledger.stale |= m.created_utc != created_utc  # kept another save's commit
            ctx.verified.add(m.key)
            ctx.written = m
            log.info(
                "committed step %d (%s, %d ranks, %d bytes, %.3f s)",
                step,
                kind,
                m.world_size,
                m.total_size_bytes,
                m.save_duration_s,
            )
            return m
        area: layout.Area = "final" if kind == ManifestKind.FINAL else "checkpoints"
        key = layout.shard_key(step, ctx.rank, ctx.attempt, area)
        w, after = open_single_shard(ctx.storage, key, open_shard, snap.nbytes)
        pending = sharding.write_object(w, snap)
        try:  # until the commit nothing names the shard: a failure removes it
            out = pending.hash()
            size, checksum = out.size_bytes, out.checksum
            info = ctx.storage.head(key)
            if info is None or info.size_bytes != size:
                raise StorageError(
                    f"{key}: committed shard reads back as {info}, expected "
                    f"{size} bytes; the storage lost the write"
                )
            m = make(
                (ShardInfo(key, ctx.rank, size, checksum),),
                layout.manifest_key(step, area),
                sharding.merge_layout([sharding.layout_part(snap, out)], snap.layout_tensors),
            )
            check_not_complete(ctx)  # a marker written since begin: no commit after it
        except BaseException:
            _drop_unnamed(ctx.storage, key)
            raise
        mkey = m.key
        m = commit_manifest(ctx.storage, m, ctx.fence, after)  # conditional create, fenced
        ctx.ledger.stale |= m.created_utc != created_utc  # kept another save's: ours orphaned
        ctx.verified.add(mkey)
        ctx.written = m
        log.info("committed step %d (%s, %d bytes, %.3f s)", step, kind, size, m.save_duration_s)
        return m

    except BaseException:
        ctx.ledger.stale = True  # a shard may be left that no manifest names
        raise


def _drop_unnamed(storage: Storage, key: str) -> None:
    """Delete the shard ``key`` that no manifest names (the save failed before its
    commit, e.g. building the compat block); a storage error leaves it to retention."""
    try:
        storage.delete([key])
    except StorageError as e:
        log.warning("%s: the uncommitted shard stays for retention (%s)", key, e)


def open_single_shard(
    storage: Storage,
    key: str,
    open_shard: Callable[[str], ObjectWriter] | None,
    data_bytes: int | None = None,
) -> tuple[ObjectWriter, tuple[ObjectWriter, ...]]:
    """The shard writer of a one-rank save, and what the manifest's commit must make
    durable first: an unreferenced writer where the storage offers one (no temp file
    or rename; its fsyncs batched with the manifest's, :class:`PublishesAfter`; sized
    by ``data_bytes``, the shard's tensor bytes), else ``open_shard`` or
    ``storage.open_write`` (durable at its own commit)."""
    if open_shard is None and publishes_after(type(storage)):
        w = cast(PublishesAfter, storage).open_unreferenced(key, data_bytes)
        if w is not None:
            return w, (w,)
    return (open_shard or storage.open_write)(key), ()


def make_manifest(
    ctx: CommitContext,
    step: int,
    kind: str,
    shards: tuple[ShardInfo, ...],
    compat: dict[str, Any],
    metrics: Mapping[str, Any] | None,
    created_utc: str,
    started: float,
    mkey: str,
    tensor_layout: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest committing ``shards`` (built just before it is written)."""
    return Manifest(
        run=ctx.run,
        step=step,
        kind=ManifestKind(kind),
        attempt=ctx.attempt,
        world_size=len(shards),
        shards=shards,
        compat=compat,
        metrics=normalize(dict(metrics or {}), "metrics", lenient=True),
        resumed_from=ctx.resumed_from,
        created_utc=created_utc,
        committed_utc=utc_now(),
        save_duration_s=round(time.monotonic() - started, 6),
        versions={
            "ckrun": str(compat.get("ckrun_version")),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        compat_drift=tuple(ctx.drift),
        signature=ctx.signature,
        tensor_layout=tensor_layout,
        lease_epoch=ctx.lease_epoch,
        key=mkey,
    )


def retain_later(ctx: CommitContext, m: Manifest) -> None:
    """Step 5 off the save's return (issue 19): :func:`retain` in a background thread,
    started after ``m`` is committed (durable), joined by :func:`wait_retention` before
    the next save or load starts and at ``Checkpointer.close``, so retention never runs
    concurrently with a save of this process.  The thread is not a daemon: an exiting
    interpreter finishes the pass first (a ``ThreadPoolExecutor`` worker, kept for the
    next save: no thread start per save).  A killed process leaves at most the files of
    one old checkpoint, which the next pass deletes (as for a kill during ``retain``)."""
    if ctx.rank != 0:
        return
    wait_retention(ctx)
    if ctx.retainer is None:
        ctx.retainer = ThreadPoolExecutor(  # a sync save waits for it: never idle
            1, thread_name_prefix="ckrun-retention", initializer=priority.normal_policy
        )
    ctx.retaining = ctx.retainer.submit(retain, ctx, m)


def wait_retention(ctx: CommitContext) -> None:
    """Join the last save's background retention pass, if any (:func:`retain` logs)."""
    f, ctx.retaining = ctx.retaining, None
    if f is not None:
        f.result()


def retain(ctx: CommitContext, m: Manifest) -> None:
    """Step 5 (rank 0 alone deletes): apply retention after committing ``m``; never
    deletes ``m`` nor the step this process resumed from.  A storage error is logged:
    the checkpoint is committed and retention retries after the next save."""
    if ctx.rank != 0:
        return
    if m.kind != ManifestKind.FINAL and notice_pending():
        # deletes can wait: a notice's save and exit must not wait for their unlinks
        # (big shards' extents freed) nor carry their journal blocks in the emergency
        # save's commit; the next attempt retains when it loads (a full pass: its ledger
        # is new), and nothing is lost by keeping more checkpoints
        log.info("retention after step %d left to the next attempt: a notice is pending", m.step)
        return
    try:
        ctx.check_fence(f"retention after step {m.step}")
    except LeaseLost:
        if ctx.world_size == 1:
            raise
        log.error("retention after step %d skipped: the lease moved on", m.step)
        return  # the next collective commit refuses on every rank
    try:
        plan = retention.retain_after(
            ctx.storage,
            m,
            keep_last=ctx.keep_last,
            milestone_every=ctx.milestone_every,
            protect=() if ctx.resumed_from is None else (ctx.resumed_from,),
            # a stale owner never collects a newer attempt's in-flight shard; unfenced
            # runs (no supervisor) have no stale owners and no monotonic attempts
            attempt=ctx.attempt if ctx.lease_epoch is not None else None,
            ledger=ctx.ledger,
            stop=None if m.kind == ManifestKind.FINAL else notice_pending,
        )
        ctx.verified -= set(plan.manifests)
    except StorageError as e:
        log.warning("retention after step %d failed (will retry): %s", m.step, e)
