"""``ckrun.Checkpointer``: atomic, verified, compatible checkpoints (the user's facade).

Save = snapshot (state referenced or copied to host) → persist (one shard per rank under
an attempt-unique key, CRC32C while streaming) → verify (size by ``head``) → commit (the
manifest, written last) → retain: :mod:`ckrun.checkpoint.pipeline`, in the background
for ``async_save`` (:mod:`ckrun.checkpoint.async_save`).  Load = discover manifests
newest first → compat gate → read and verify the shard (size, CRC32C) → restore in
place; a corrupt checkpoint is reported and the next older one is tried.  See
DESIGN.md §3.  This module holds construction, compat, load and close; the save methods
are in :mod:`ckrun.checkpoint.facade_save`, ``async_save`` and the checkpoint interval
in :mod:`ckrun.checkpoint.facade_async`, the log events in
:mod:`ckrun.checkpoint.reporting`.

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

import logging
import os
import platform
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import torch
from ckrun.checkpoint import collective as distributed
from ckrun.checkpoint import pipeline, resume
from ckrun.checkpoint import signature as sig
from ckrun.checkpoint.compat import git_state, normalize
from ckrun.checkpoint.env import (
    checkpointer_arguments,
    env_int,
    install_excepthook,
    open_storage_from_env,
    refuse_conflict,
)
from ckrun.checkpoint.facade_async import AsyncMethods
from ckrun.checkpoint.facade_save import SaveMethods
from ckrun.checkpoint.lease import Fence
from ckrun.checkpoint.lock import WriterLock
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.pipeline import CommitContext, SaveHandle
from ckrun.checkpoint.reporting import created_at, report_training_start, run_name_of
from ckrun.checkpoint.state import state_compat
from ckrun.errors import (
    ConfigError,
)
from ckrun.storage.base import Storage
from ckrun.version import __version__

if TYPE_CHECKING:
    from ckrun.checkpoint.async_save import AsyncSaver
    from ckrun.checkpoint.interval import AutoInterval

__all__ = ["Checkpointer", "SaveHandle"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class _Context(Generic[T]):
    """A read-only attribute of the Checkpointer that is its commit context's field."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Checkpointer, owner: type | None = None) -> T:
        return cast(T, getattr(obj._ctx, self.name))


class Checkpointer(SaveMethods, AsyncMethods):
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
        run = run or os.environ.get("CKRUN_RUN") or run_name_of(st.url)
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
                WriterLock(st, run=run, attempt=attempt, owner=created_at())
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
        report_training_start(m, time.monotonic() - t0, self.rank)
        if m is not None and self._ctx.lease_epoch is not None:
            # under a supervisor (a fenced writer), retention now, in the background: an
            # attempt stopped by a notice before it saves still retains; a script outside
            # one (an evaluation) never deletes anything by loading
            pipeline.retain_later(self._ctx, m)
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
