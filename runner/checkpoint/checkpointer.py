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
``CKRUN_ALLOW_CHANGE`` (comma-separated), ``CKRUN_RESUME_STEP`` (a hint).
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from ckrun.checkpoint import collective as distributed
from ckrun.checkpoint import layout, pipeline
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.compat import compare, git_state, normalize, parse_allow_change
from ckrun.checkpoint.discovery import scan
from ckrun.checkpoint.env import env_int, install_excepthook, open_storage_from_env
from ckrun.checkpoint.lock import WriterLock
from ckrun.checkpoint.manifest import Manifest, utc_now
from ckrun.checkpoint.marker import CompletionMarker
from ckrun.checkpoint.pipeline import CommitContext, SaveHandle
from ckrun.checkpoint.shard_reader import read_shard
from ckrun.checkpoint.state import restore
from ckrun.checkpoint.verify import verify_manifest
from ckrun.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ObjectNotFound,
)
from ckrun.storage.base import ObjectWriter, Storage
from ckrun.version import __version__

if TYPE_CHECKING:
    from ckrun.checkpoint.async_save import AsyncSaver
    from ckrun.checkpoint.interval import AutoInterval, IntervalEstimate

__all__ = ["Checkpointer", "SaveHandle"]

log = logging.getLogger(__name__)


def _class_names(state: Mapping[str, Any] | None, base: type) -> str | None:
    if not state:
        return None
    names = sorted(f"{k}={type(v).__name__}" for k, v in state.items() if isinstance(v, base))
    if not names:
        return None
    return names[0].split("=", 1)[1] if len(names) == 1 else ",".join(names)


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
        lock: take ``locks/writer.lock`` on first load/save (rank 0 only).
        seed: base seed of the RNG reseed when resuming on another world size.

    Rank and world size come from ``torch.distributed`` (or ``RANK``/``WORLD_SIZE``);
    with more than one rank ``load``/``save``/``finalize`` are collectives (see
    :mod:`ckrun.checkpoint.collective`).

    Raises:
        ConfigError: invalid ``keep_last``/``milestone_every`` or storage URL.
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
    ):
        if keep_last < 1 or (milestone_every is not None and milestone_every < 1):
            raise ConfigError(
                f"keep_last must be >= 1 and milestone_every >= 1 or None "
                f"(got {keep_last}, {milestone_every})"
            )
        st: Storage = open_storage_from_env(storage) if isinstance(storage, str) else storage
        run = run or os.environ.get("CKRUN_RUN") or _basename(st.url)
        attempt = attempt if attempt is not None else env_int("CKRUN_ATTEMPT", 0)
        rank, world_size = distributed.dist_info()
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
            lock=WriterLock(st, run=run, attempt=attempt) if lock and rank == 0 else None,
        )
        self.allow_change = tuple(allow_change)
        self.policy = policy
        self.resume_step = resume_step
        self.seed = seed
        self.skipped: list[str] = []
        self._user_compat = normalize(dict(compat or {}))
        self._state_compat: dict[str, Any] = {}
        from ckrun.checkpoint.interval import parse_every

        self._every, self._mtbi_s = parse_every(checkpoint_every), mtbi_s
        self._async: AsyncSaver | None = None  # the background persist of async_save
        self._auto: AutoInterval | None = None

    # -- the commit context (pipeline.CommitContext), read-only ------------------------

    @property
    def storage(self) -> Storage:
        """The run root."""
        return self._ctx.storage

    @property
    def run(self) -> str:
        """The run id recorded in manifests."""
        return self._ctx.run

    @property
    def attempt(self) -> int:
        """The attempt number recorded in shard keys and manifests."""
        return self._ctx.attempt

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        """The number of ranks saving together."""
        return self._ctx.world_size

    @property
    def group(self) -> distributed.Group:
        """The checkpoint's own collectives (gloo when torch.distributed is up)."""
        return self._ctx.group

    @property
    def keep_last(self) -> int:
        """Newest checkpoints kept by retention."""
        return self._ctx.keep_last

    @property
    def milestone_every(self) -> int | None:
        """Steps divisible by this are kept forever."""
        return self._ctx.milestone_every

    @property
    def rng(self) -> bool:
        """Whether RNG states are captured and restored."""
        return self._ctx.rng

    @property
    def resumed_from(self) -> int | None:
        """The step the last :meth:`load` restored (None: nothing resumed)."""
        return self._ctx.resumed_from

    @property
    def commit_context(self) -> CommitContext:
        """The context the save pipeline runs on (:mod:`ckrun.checkpoint.pipeline`)."""
        return self._ctx

    @classmethod
    def from_env(cls, compat: Mapping[str, Any] | None = None, **kw: Any) -> Checkpointer:
        """A Checkpointer configured by the supervisor's ``CKRUN_*`` environment.

        Also installs the notice signal handlers and an excepthook that makes an
        uncaught :class:`ckrun.errors.CkrunError` exit with its ``exit_code``.

        Raises:
            ConfigError: neither ``CKRUN_STORAGE`` nor ``storage=`` names the storage,
                or a ``CKRUN_*`` integer is malformed.
        """
        from ckrun.control import install_signal_handlers

        url = os.environ.get("CKRUN_STORAGE") or kw.pop("storage", None)
        kw.pop("storage", None)
        if not url:
            raise ConfigError(
                "CKRUN_STORAGE is not set: run the script under `ckrun run`, "
                "or pass storage='path/or/s3-url' to Checkpointer.from_env"
            )
        block = dict(compat or {})
        if os.environ.get("CKRUN_CONFIG_HASH"):
            block.setdefault("launch_hash", os.environ["CKRUN_CONFIG_HASH"])
        allow = tuple(kw.pop("allow_change", ())) + parse_allow_change(
            os.environ.get("CKRUN_ALLOW_CHANGE")
        )
        if os.environ.get("CKRUN_RESUME_STEP"):
            kw.setdefault("resume_step", env_int("CKRUN_RESUME_STEP", -1))
        kw.setdefault("run", os.environ.get("CKRUN_RUN") or None)
        ckpt = cls(url, block, allow_change=allow, **kw)
        install_signal_handlers()
        install_excepthook()
        return ckpt

    # -- compat ---------------------------------------------------------------------

    def compat_block(self, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The compat block of this run: automatic fields overridden by the user's."""
        if state is not None:
            auto = {
                "optimizer": _class_names(state, torch.optim.Optimizer),
                "scheduler": _class_names(state, torch.optim.lr_scheduler.LRScheduler),
            }
            self._state_compat = {k: v for k, v in auto.items() if v is not None}
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

    def _gate(self, m: Manifest, current: Mapping[str, Any]) -> list[str]:
        """Raise IncompatibleCheckpoint on refusing differences; returns the drift."""
        allow = self.allow_change + distributed.allowed_changes(m, self.world_size)
        cmp = compare(current, m.compat, allow_change=allow, policy=self.policy)
        if cmp.refuse:
            raise IncompatibleCheckpoint(
                f"checkpoint step {m.step} in {self.storage.url} belongs to a different "
                "experiment:\n  " + "\n  ".join(cmp.refuse) + "\nrestore the original "
                "settings, allow the change (allow_change=(FIELD,) or --allow-change FIELD) "
                "or start a new run directory",
                diff=cmp.refuse,
                step=m.step,
            )
        for w in cmp.warn:
            log.warning("checkpoint step %d differs (recorded): %s", m.step, w)
        return cmp.drift

    # -- load -----------------------------------------------------------------------

    def load(self, state: MutableMapping[str, Any]) -> Manifest | None:
        """Restore the newest good, compatible checkpoint into ``state`` in place.

        Returns:
            Its manifest, or None when there is nothing to resume (empty run root).

        Raises:
            IncompatibleCheckpoint: the newest readable checkpoint's compat differs in a
                strict field (``.diff`` holds the lines); nothing is restored.
            RunLocked: another process writes this run.
            CheckpointError: the checkpoint does not fit the state (wrong model).
        """
        pipeline.acquire(self._ctx)
        current = self.compat_block(state)
        for m in scan(self.storage).manifests:
            drift = self._gate(m, current)
            tree, why = None, ""
            try:
                tree = self._read(m)
            except (CorruptCheckpoint, ObjectNotFound) as e:
                why = str(e)
            ok, whys = self.group.all_ok(tree is not None, why)  # all ranks fall back together
            if not ok or tree is None:
                msg = f"checkpoint step {m.step} is unusable: {'; '.join(whys)}"
                log.error("%s; falling back to an older checkpoint", msg)
                self.skipped.append(msg)
                continue
            if m.world_size != self.world_size:
                distributed.restore_resharded(
                    state, tree, m, rank=self.rank, world_size=self.world_size, seed=self.seed
                )
            else:
                restore(state, tree, where=f"checkpoint step {m.step}")
            self._ctx.resumed_from, self._ctx.drift = m.step, drift
            self._ctx.verified.add(m.key)
            if self.resume_step is not None and self.resume_step != m.step:
                log.warning("resumed step %d, the supervisor expected %d", m.step, self.resume_step)
            return m
        return None

    def _read(self, m: Manifest) -> Any:
        if m.world_size != self.world_size and not distributed.reshards(m):
            raise CheckpointError(
                f"checkpoint step {m.step} has {m.world_size} shards in a "
                "format that does not reshard; resume it on "
                f"{m.world_size} ranks"
            )
        src = distributed.source_rank(m, self.rank, self.world_size)
        s = next(s for s in m.shards if s.rank == src)
        info = self.storage.head(s.key)
        if info is None or info.size_bytes != s.size_bytes:
            got = "missing" if info is None else f"{info.size_bytes} bytes"
            raise CorruptCheckpoint(
                f"{s.key}: {got}, manifest says {s.size_bytes} bytes (truncated)",
                key=s.key,
                step=m.step,
            )
        with self.storage.open_read(s.key) as f:
            _advise_sequential(f)
            return read_shard(f, size_bytes=s.size_bytes, checksum=s.checksum, key=s.key)

    def latest(self) -> Manifest | None:
        """The newest committed, verified (re-hashed unless this process wrote or loaded
        it), compatible manifest; None when there is none or the newest good one is
        incompatible."""
        current = self.compat_block(None)
        for m in scan(self.storage).manifests:
            if m.key not in self._ctx.verified:
                problems = verify_manifest(self.storage, m)
                if problems:
                    log.warning("latest(): skipping step %d: %s", m.step, "; ".join(problems))
                    continue
                self._ctx.verified.add(m.key)
            allow = self.allow_change + distributed.allowed_changes(m, self.world_size)
            cmp = compare(
                current,
                m.compat,
                allow_change=allow,
                policy=self.policy,
                only_current=not self._state_compat,
            )  # no state seen: partial block
            return None if cmp.refuse else m
        return None

    # -- save -----------------------------------------------------------------------

    def snapshot(self, state: Mapping[str, Any], *, copy: bool = False) -> fmt.Snapshot:
        """Step 1 of a save: the state (and RNG) flattened for persisting.

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
        return self._save(step, state, pipeline.kind_for(self._ctx, step), metrics)

    def finalize(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None
    ) -> Manifest:
        """Write the final artifact (``final/``) and then ``COMPLETE.json``.

        Raises:
            RunComplete: already finalized.  Storage errors as :meth:`save`.
        """
        m = self._save(step, state, "final", metrics)
        if self.rank == 0:
            self.storage.put(layout.COMPLETE, CompletionMarker.for_manifest(m).dumps())
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
        pipeline.retain(self._ctx, m)
        return m

    def persist(
        self,
        step: int,
        snap: fmt.Snapshot,
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
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None
    ) -> SaveHandle:
        """Snapshot ``state`` into reused host buffers; persist and commit in the background.

        Returns once the snapshot is copied (training may change ``state`` right away);
        ``handle.result()`` returns the manifest once the commit is durable.  At most one
        save is in flight: a second ``async_save`` or ``save`` first waits for it.  With
        more than one rank this saves synchronously (the distributed commit is a
        collective).  See :mod:`ckrun.checkpoint.async_save`.

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
        return self._async.save(step, state, metrics)

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
        """The :class:`AutoInterval` of this Checkpointer: in-process save costs (the
        last async stall and durable time, else the last synchronous save), the run's
        history of interruptions."""
        from ckrun.checkpoint import interval

        def cost() -> tuple[float | None, float]:
            a, w = self._async, self._ctx.written
            if a is not None and a.last_stall_s is not None:
                return float(a.last_stall_s), float(a.last_durable_s or 0.0)
            return (float(w.save_duration_s) if w is not None else None), 0.0

        return interval.AutoInterval(
            cost, events_path=interval.events_path_for(self.storage), mtbi_s=self._mtbi_s
        )

    def close(self) -> None:
        """Drain an in-flight async save (raising its error), release the writer lock."""
        try:
            if self._async is not None:
                self._async.close()
        finally:
            if self._ctx.lock is not None:
                self._ctx.lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1] or "run"


def _advise_sequential(f: Any) -> None:
    try:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError, ValueError):
        pass
