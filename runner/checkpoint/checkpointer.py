"""``ckrun.Checkpointer``: atomic, verified, compatible checkpoints (the user's facade).

Save = snapshot (state referenced or copied to host) → persist (one shard per rank under
an attempt-unique key, CRC32C while streaming) → verify (size by ``head``) → commit (the
manifest, written last) → retain: :mod:`ckrun.checkpoint.pipeline`, in the background
for ``async_save`` (:mod:`ckrun.checkpoint.async_save`).  Load = discover manifests
newest first → compat gate → read and verify the shard (size, CRC32C) → restore in
place; a corrupt checkpoint is reported and the next older one is tried.  See
DESIGN.md §3.

Environment read by :meth:`Checkpointer.from_env`: ``CKRUN_STORAGE``, ``CKRUN_RUN``,
``CKRUN_ATTEMPT``, ``CKRUN_CONFIG_HASH`` (compat field ``launch_hash``),
``CKRUN_ALLOW_CHANGE`` (comma-separated), ``CKRUN_RESUME_STEP`` (a hint).  Explicit
beats ambient and a conflict is refused: an argument that differs from its set
``CKRUN_*`` variable raises ``ConfigError`` naming both (issue 13).

The manifest records the state's model signature and optimizer parameter names
(:mod:`ckrun.checkpoint.signature`): a load gates on it and re-keys optimizer state by
parameter name.  ``finalize`` is idempotent and completes a run whose final artifact was
committed without its marker.

Fencing (DESIGN.md §7): under a supervisor, ``CKRUN_LEASE_EPOCH`` names the lease epoch
the supervisor holds; every manifest and the completion marker record it and every
commit, marker write and retention pass first checks that it is still the run's current
epoch (:class:`ckrun.checkpoint.lease.Fence`), raising :class:`ckrun.errors.LeaseLost`
(exit 2) otherwise.  The lease then replaces the machine-local writer lock.  Without a
supervisor (no ``CKRUN_LEASE_EPOCH``) the Checkpointer runs unfenced.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import torch
from ckrun.checkpoint import collective as distributed
from ckrun.checkpoint import layout, pipeline, resume
from ckrun.checkpoint import signature as sig
from ckrun.checkpoint.compat import git_state, normalize
from ckrun.checkpoint.discovery import committed_final, completion
from ckrun.checkpoint.env import (
    checkpointer_arguments,
    env_int,
    install_excepthook,
    open_storage_from_env,
    refuse_conflict,
)
from ckrun.checkpoint.lease import Fence
from ckrun.checkpoint.lock import WriterLock
from ckrun.checkpoint.manifest import Manifest, ManifestKind, utc_now
from ckrun.checkpoint.marker import CompletionMarker
from ckrun.checkpoint.pipeline import CommitContext, SaveHandle
from ckrun.checkpoint.sharding import Planned
from ckrun.checkpoint.state import state_compat
from ckrun.errors import (
    ConfigError,
)
from ckrun.storage.base import ObjectWriter, Storage
from ckrun.version import __version__

if TYPE_CHECKING:
    from ckrun.checkpoint.async_save import AsyncSaver
    from ckrun.checkpoint.interval import AutoInterval, IntervalEstimate

__all__ = ["Checkpointer", "SaveHandle"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class _Context(Generic[T]):
    """A read-only attribute of the Checkpointer that is its commit context's field."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Checkpointer, owner: type | None = None) -> T:
        return cast(T, getattr(obj._ctx, self.name))


class Checkpointer:
    """Verified checkpoints of one run (see the module docstring).

    Args:
        storage: run root: a local path or ``s3://`` URL, or a Storage object.
        compat: the experiment's compat block (``config``, ``model_version``,
            ``dataset_version``, ``precision``, ...); JSON-normalised.
        keep_last: newest checkpoints kept by retention (>= 1).
        milestone_every: steps divisible by this are kept forever.
        allow_change: compat paths allowed to differ from the checkpoint (drift recorded).
        run: run id (default ``CKRUN_RUN`` or the root's base name).
        attempt: attempt number (default ``CKRUN_ATTEMPT`` or 0).
        policy: compat field → ``strict``/``warn``/``ignore`` overrides.
        rng: capture and restore RNG states.
        resume_step: the supervisor's hint of the step to resume (logged if different).
        checkpoint_every: for :meth:`should_save`: a number of steps, or ``"auto"``
            (Young/Daly interval from measured save costs and interruptions, see
            :mod:`ckrun.checkpoint.interval`).
        mtbi_s: mean time between interruptions for ``"auto"``, seconds (default
            ``CKRUN_MTBI_S``, else the run's history).
        lock: take ``locks/writer.lock`` on first load/save (rank 0 only); a second
            Checkpointer of this process on the same run is then refused (``RunLocked``
            naming where the first was created), on every storage.
        seed: base seed of the RNG reseed when resuming on another world size.
        lazy_snapshot: default of :meth:`async_save`'s ``lazy`` (opt-in: see
            :mod:`ckrun.checkpoint.lazy_snapshot`).

    Rank and world size come from ``torch.distributed`` (or ``RANK``/``WORLD_SIZE``);
    with more than one rank ``load``/``save``/``finalize`` are collectives (see
    :mod:`ckrun.checkpoint.collective`).

    Attributes:
        storage, run, attempt, rank, world_size, group, keep_last, milestone_every, rng:
            the settings above as resolved (read-only; the commit context's).
        resumed_from: the step the last :meth:`load` restored (None: nothing resumed).
        skipped: why each checkpoint :meth:`load` passed over was unusable.

    Raises:
        ConfigError: invalid ``keep_last``/``milestone_every`` or storage URL, or
            ``run``/``attempt`` given and different from a set ``CKRUN_RUN``/
            ``CKRUN_ATTEMPT``.
    """

    def __init__(
        self,
        storage: str | Storage,
        compat: Mapping[str, Any] | None = None,
        *,
        keep_last: int = 3,
        milestone_every: int | None = None,
        checkpoint_every: int | str | None = None,
        mtbi_s: float | None = None,
        allow_change: Sequence[str] = (),
        run: str | None = None,
        attempt: int | None = None,
        policy: Mapping[str, str] | None = None,
        rng: bool = True,
        resume_step: int | None = None,
        lock: bool = True,
        seed: int = 0,
        lazy_snapshot: bool = False,
    ):
        if keep_last < 1 or (milestone_every is not None and milestone_every < 1):
            raise ConfigError(
                f"keep_last must be >= 1 and milestone_every >= 1 or None "
                f"(got {keep_last}, {milestone_every})"
            )
        st: Storage = open_storage_from_env(storage) if isinstance(storage, str) else storage
        refuse_conflict("run", run, "CKRUN_RUN")
        refuse_conflict("attempt", attempt, "CKRUN_ATTEMPT")
        run = run or os.environ.get("CKRUN_RUN") or _basename(st.url)
        attempt = attempt if attempt is not None else env_int("CKRUN_ATTEMPT", 0)
        rank, world_size = distributed.dist_info()
        fence = Fence.from_env(st)
        self._ctx = CommitContext(
            storage=st,
            run=run,
            attempt=attempt,
            rank=rank,
            world_size=world_size,
            group=distributed.Group(rank, world_size),
            keep_last=keep_last,
            milestone_every=milestone_every,
            rng=rng,
            lock=(
                WriterLock(st, run=run, attempt=attempt, owner=_created_at())
                if lock and rank == 0 and not fence.fenced
                else None
            ),
            fence=fence,
        )
        self.allow_change = tuple(allow_change)
        self.policy = policy
        self.resume_step = resume_step
        self.seed = seed
        self.lazy_snapshot = lazy_snapshot
        self.skipped: list[str] = []
        self._user_compat = normalize(dict(compat or {}))
        self._state_compat: dict[str, Any] = {}
        from ckrun.checkpoint.interval import parse_every

        self._every, self._mtbi_s = parse_every(checkpoint_every), mtbi_s
        self._async: AsyncSaver | None = None  # the background persist of async_save
        self._auto: AutoInterval | None = None

    # -- read-only attributes: the commit context's (pipeline.CommitContext) ------------
    storage = _Context[Storage]()
    run = _Context[str]()
    attempt = _Context[int]()
    rank = _Context[int]()
    world_size = _Context[int]()
    group = _Context[distributed.Group]()
    keep_last = _Context[int]()
    milestone_every = _Context[int | None]()
    rng = _Context[bool]()
    resumed_from = _Context[int | None]()
    fence = _Context[Fence | None]()

    @property
    def commit_context(self) -> CommitContext:
        """The context the save pipeline runs on (:mod:`ckrun.checkpoint.pipeline`)."""
        return self._ctx

    @classmethod
    def from_env(
        cls,
        compat: Mapping[str, Any] | None = None,
        *,
        default_storage: str | Storage | None = None,
        **kw: Any,
    ) -> Checkpointer:
        """A Checkpointer configured by the supervisor's ``CKRUN_*`` environment.

        Also installs the notice signal handlers and an excepthook that makes an
        uncaught :class:`ckrun.errors.CkrunError` exit with its ``exit_code``.

        Explicit beats ambient, and a conflict is refused: an argument (``storage=``,
        ``run=``, ``attempt=``, ``resume_step=``) that differs from the ``CKRUN_*``
        variable set for it raises :class:`ConfigError` naming both values; an argument
        equal to it, or given where the variable is unset, is used.  For a fallback used
        only outside the supervisor pass ``default_storage=`` (the supervisor's
        ``CKRUN_STORAGE`` then wins without a conflict).  ``allow_change=`` adds to
        ``CKRUN_ALLOW_CHANGE``.  Other keyword arguments go to :class:`Checkpointer`
        (see :func:`ckrun.checkpoint.env.checkpointer_arguments`).

        Raises:
            ConfigError: neither ``CKRUN_STORAGE``, ``storage=`` nor ``default_storage=``
                names the storage, an argument conflicts with its ``CKRUN_*`` variable,
                or a ``CKRUN_*`` integer is malformed.
        """
        from ckrun.control import install_signal_handlers

        url, block, kw = checkpointer_arguments(compat, kw, default_storage)
        ckpt = cls(url, block, **kw)
        install_signal_handlers()
        install_excepthook()
        return ckpt

    # -- compat ---------------------------------------------------------------------

    def compat_block(self, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The compat block of this run: automatic fields overridden by the user's."""
        if state is not None:
            self._state_compat = state_compat(state)
            self._ctx.signature = sig.of_state(state)
        block: dict[str, Any] = {
            "world_size": self.world_size,
            "torch_version": torch.__version__,
            "ckrun_version": __version__,
            "python_version": platform.python_version(),
        }
        block.update(git_state())
        block.update(distributed.compat_fields(self.world_size))
        block.update(self._state_compat)
        block.update(self._user_compat)
        return block

    # -- load: ckrun.checkpoint.resume ----------------------------------------------

    def load(
        self, state: MutableMapping[str, Any], *, from_dcp: str | None = None
    ) -> Manifest | None:
        """Restore the newest good, compatible checkpoint into ``state`` in place.

        Args:
            from_dcp: a ``torch.distributed.checkpoint`` directory that seeds ``state``
                when the run has no checkpoint yet (its own checkpoints win, so a
                requeued run resumes where it stopped); see
                :mod:`ckrun.checkpoint.dcp_interop`.

        Returns:
            Its manifest, or None when there is nothing to resume (empty run root;
            ``state`` seeded from ``from_dcp`` when given).

        Raises:
            IncompatibleCheckpoint: the newest readable checkpoint's compat differs in a
                strict field (``.diff`` holds the lines); nothing is restored.
            RunLocked: another process writes this run.
            CheckpointError: the checkpoint does not fit the state (wrong model).
        """
        pipeline.wait_retention(self._ctx)
        pipeline.acquire(self._ctx)
        if os.environ.get("CKRUN_STEP_DIGEST") == "1":  # ckrun check-resume
            from functools import partial

            from ckrun.checkpoint.state import record_step
            from ckrun.control import add_check_hook

            add_check_hook(partial(record_step, state))
        t0 = time.monotonic()
        m = resume.load(
            self._ctx,
            state,
            self.compat_block(state),
            allow_change=self.allow_change,
            policy=self.policy,
            seed=self.seed,
            resume_step=self.resume_step,
            skipped=self.skipped,
        )
        if m is None and from_dcp is not None:
            from ckrun.checkpoint.dcp_interop import load_dcp

            load_dcp(state, from_dcp)
            log.info("no checkpoint in %s: state seeded from DCP %s", self.storage.url, from_dcp)
        _report_training_start(m, time.monotonic() - t0, self.rank)
        return m

    def latest(self) -> Manifest | None:
        """The newest committed, verified (re-hashed unless this process wrote or loaded
        it), compatible manifest; None when there is none or the newest good one is
        incompatible."""
        pipeline.wait_retention(self._ctx)
        return resume.latest(
            self._ctx,
            self.compat_block(None),
            allow_change=self.allow_change,
            policy=self.policy,
            only_current=not self._state_compat,  # no state seen: a partial block
        )

    # -- save -----------------------------------------------------------------------

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
        m = self._save(step, state, pipeline.kind_for(self._ctx, step), metrics)
        _report_save(m, time.monotonic() - t0, "sync", self.rank)
        from ckrun.control import record_notice_save

        record_notice_save(m.step)  # after a notice: an exit now is a preemption
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
        marker, _ = completion(self.storage)
        if marker is not None and marker.final_step == step:
            self._ctx.complete = True
            return Manifest.loads(self.storage.get(marker.manifest_key), key=marker.manifest_key)
        existing = committed_final(self.storage, step) if marker is None else None
        reuse, _ = self.group.all_ok(existing is not None)  # every rank decides alike
        if reuse and existing is not None:
            if self._async is not None:
                self._async.drain()
            log.info("final artifact of step %d is already committed: writing its marker", step)
            m = existing
        else:
            t0 = time.monotonic()
            m = self._save(step, state, ManifestKind.FINAL, metrics)
            _report_save(m, time.monotonic() - t0, "sync", self.rank)
        if self.rank == 0:
            self._ctx.check_fence(f"completion marker of step {step}")
            marker_m = CompletionMarker.for_manifest(m)  # the epoch of this writer
            marker_m = dataclasses.replace(marker_m, lease_epoch=self._ctx.lease_epoch)
            self.storage.put(layout.COMPLETE, marker_m.dumps())
        self._ctx.complete = True
        return m

    def _save(
        self, step: int, state: Mapping[str, Any], kind: str, metrics: Mapping[str, Any] | None
    ) -> Manifest:
        started, created = time.monotonic(), utc_now()
        pipeline.check_step(step)
        pipeline.begin(self._ctx)
        if self._async is not None:  # an async save in flight first (deadline-aware)
            early = self._async.before_sync_save(step, kind)
            if early is not None:
                return early
        last = pipeline.already_committed(self._ctx, step, kind)
        if last is not None:
            return last
        compat = self.compat_block(state)
        snap = self.snapshot(state)
        m = self.persist(
            step,
            snap,
            kind=kind,
            compat=compat,
            metrics=metrics,
            created_utc=created,
            started=started,
        )
        pipeline.retain_later(self._ctx, m)  # after the commit, off the save's return
        return m

    def persist(
        self,
        step: int,
        snap: Planned,
        *,
        kind: str,
        compat: dict[str, Any],
        metrics: Mapping[str, Any] | None,
        created_utc: str,
        started: float,
        open_shard: Callable[[str], ObjectWriter] | None = None,
    ) -> Manifest:
        """Steps 2-4 of a save: write the shard, check its size, commit the manifest
        (:func:`ckrun.checkpoint.pipeline.persist`)."""
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

    # -- async saves and the checkpoint interval --------------------------------------

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

        if self.world_size > 1:
            aio.warn_sync_fallback(self.world_size)
            return SaveHandle.completed(self.save(step, state, metrics=metrics))
        if self._async is None:
            self._async = aio.AsyncSaver(self._ctx, self.compat_block)
        t0 = time.monotonic()
        lazy = self.lazy_snapshot if lazy is None else lazy
        h = self._async.save(step, state, metrics, lazy=lazy)
        if self.rank == 0:
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

    def close(self) -> None:
        """Drain an in-flight async save (raising its error) and a background retention
        pass, release the writer lock."""
        try:
            pipeline.wait_retention(self._ctx)
            if self._ctx.retainer is not None:
                self._ctx.retainer.shutdown()
                self._ctx.retainer = None
            if self._async is not None:
                self._async.close()
        finally:
            if self._ctx.lock is not None:
                self._ctx.lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _report_training_start(m: Manifest | None, seconds: float, rank: int) -> None:
    """Tell the run's log and the supervisor that training starts (``restore`` event,
    :func:`ckrun.control.mark_training`); a no-op outside the supervisor."""
    from ckrun.control import mark_training
    from ckrun.runlog import child_event

    if rank == 0:
        child_event("restore", step=m.step if m is not None else None, seconds=seconds)
    mark_training("restore")


def _report_save(m: Manifest, seconds: float, mode: str, rank: int) -> None:
    """The ``save`` event: the training loop was blocked ``seconds`` for step ``m.step``."""
    if rank == 0:
        from ckrun.runlog import child_event

        child_event("save", step=m.step, seconds=seconds, mode=mode, ckpt_kind=m.kind)


def _created_at() -> str:
    """``the Checkpointer created at FILE:LINE`` of the user's frame that built it."""
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    for fr in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(fr.filename).startswith(here):
            return f"the Checkpointer created at {fr.filename}:{fr.lineno}"
    return "another Checkpointer"


def _basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1] or "run"
