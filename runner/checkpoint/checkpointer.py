"""``ckrun.Checkpointer``: atomic, verified, compatible checkpoints (issue 2).

Save = snapshot (state referenced or copied to host) → persist (one shard per rank under
an attempt-unique key, CRC32C while streaming) → verify (size by ``head``) → commit (the
manifest, written last) → retain.  Load = discover manifests newest first → compat gate
→ read and verify the shard (size, CRC32C) → restore in place; a corrupt checkpoint is
reported and the next older one is tried.  See DESIGN.md §3.

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
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from ckrun.checkpoint import collective as distributed
from ckrun.checkpoint import layout, reshard, retention, sharding
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.commit import commit_manifest
from ckrun.checkpoint.compat import compare, git_state, normalize, parse_allow_change
from ckrun.checkpoint.discovery import completion, scan
from ckrun.checkpoint.env import env_int, install_excepthook
from ckrun.checkpoint.lock import WriterLock
from ckrun.checkpoint.manifest import Manifest, ShardInfo, utc_now
from ckrun.checkpoint.marker import CompletionMarker
from ckrun.checkpoint.state import capture, restore
from ckrun.checkpoint.verify import verify_manifest
from ckrun.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    ObjectNotFound,
    RunComplete,
    StorageError,
)
from ckrun.storage.base import ObjectWriter, Storage

if TYPE_CHECKING:
    from ckrun.checkpoint.async_save import AsyncSaver
    from ckrun.checkpoint.interval import AutoInterval, IntervalEstimate

log = logging.getLogger(__name__)


class SaveHandle:
    """A save that is running or done; ``result()`` returns its committed Manifest.

    ``save`` is synchronous in this version; ``async_save`` (issue 7) returns handles
    backed by a background persist.
    """

    def __init__(self, future: Future[Manifest]):
        self._future = future

    @classmethod
    def completed(cls, manifest: Manifest) -> SaveHandle:
        """A handle for a save that already committed."""
        f: Future[Manifest] = Future()
        f.set_result(manifest)
        return cls(f)

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Manifest:
        """Wait (at most ``timeout`` seconds) and return the manifest; re-raises errors."""
        return self._future.result(timeout)


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
        from ckrun.storage import open_storage

        if keep_last < 1 or (milestone_every is not None and milestone_every < 1):
            raise ConfigError(
                f"keep_last must be >= 1 and milestone_every >= 1 or None "
                f"(got {keep_last}, {milestone_every})"
            )
        self.storage: Storage = open_storage(storage) if isinstance(storage, str) else storage
        self.run = run or os.environ.get("CKRUN_RUN") or _basename(self.storage.url)
        self.attempt = attempt if attempt is not None else env_int("CKRUN_ATTEMPT", 0)
        self.keep_last, self.milestone_every = keep_last, milestone_every
        self.allow_change = tuple(allow_change)
        self.policy = policy
        self.rng = rng
        self.resume_step = resume_step
        self.rank, self.world_size = distributed.dist_info()
        self.seed = seed
        self.group = distributed.Group(self.rank, self.world_size)
        self.resumed_from: int | None = None
        self.skipped: list[str] = []
        self._user_compat = normalize(dict(compat or {}))
        self._state_compat: dict[str, Any] = {}
        self._drift: list[str] = []
        self._verified: set[str] = set()
        self._written: Manifest | None = None  # the last manifest this process committed
        self._complete = False
        from ckrun.checkpoint.interval import parse_every

        self._every, self._mtbi_s = parse_every(checkpoint_every), mtbi_s
        self._async: AsyncSaver | None = None  # issue 7: background persist
        self._auto: AutoInterval | None = None
        self._lock = (
            WriterLock(self.storage, run=self.run, attempt=self.attempt)
            if lock and self.rank == 0
            else None
        )

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
        from ckrun import __version__

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
        self._acquire()
        current = self.compat_block(state)
        want: dict[str, Any] | None = None
        for m in scan(self.storage).manifests:
            drift = self._gate(m, current)
            tree, why = None, ""
            try:
                if m.tensor_layout is not None and want is None:
                    want = reshard.targets(state)  # where each global tensor goes
                tree = self._read(m, want or {})
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
            self.resumed_from, self._drift = m.step, drift
            self._verified.add(m.key)
            if self.resume_step is not None and self.resume_step != m.step:
                log.warning("resumed step %d, the supervisor expected %d", m.step, self.resume_step)
            return m
        if from_dcp is not None:
            from ckrun.checkpoint.dcp_interop import load_dcp

            load_dcp(state, from_dcp)
            log.info("no checkpoint in %s: state seeded from DCP %s", self.storage.url, from_dcp)
        return None

    def _read(self, m: Manifest, want: Mapping[str, Any]) -> Any:
        if m.world_size != self.world_size and not distributed.reshards(m):
            raise CheckpointError(
                f"checkpoint step {m.step} has {m.world_size} shards in a "
                "format that does not reshard; resume it on "
                f"{m.world_size} ranks"
            )
        src = distributed.source_rank(m, self.rank, self.world_size)
        if m.tensor_layout is not None:  # format 2: ranged reads of what this rank needs
            return reshard.load_tree(self.storage, m, source_rank=src, want=want)
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
            return fmt.read_shard(f, size_bytes=s.size_bytes, checksum=s.checksum, key=s.key)

    def latest(self) -> Manifest | None:
        """The newest committed, verified (re-hashed unless this process wrote or loaded
        it), compatible manifest; None when there is none or the newest good one is
        incompatible."""
        current = self.compat_block(None)
        for m in scan(self.storage).manifests:
            if m.key not in self._verified:
                problems = verify_manifest(self.storage, m)
                if problems:
                    log.warning("latest(): skipping step %d: %s", m.step, "; ".join(problems))
                    continue
                self._verified.add(m.key)
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

    def snapshot(self, state: Mapping[str, Any], *, copy: bool = False) -> sharding.Planned:
        """Step 1 of a save: the state (and RNG) flattened and cut into this rank's
        shard entries (:func:`ckrun.checkpoint.sharding.plan`, a collective with more
        than one rank).

        Args:
            copy: clone tensors to host now (for a persist that overlaps training).
        """
        snap = fmt.snapshot(capture(state, rng=self.rng), copy=copy)
        return sharding.plan(snap, self.group)

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
        milestone = bool(self.milestone_every and step % self.milestone_every == 0)
        return self._save(step, state, "milestone" if milestone else "recovery", metrics)

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
        self._complete = True
        return m

    def _save(
        self, step: int, state: Mapping[str, Any], kind: str, metrics: Mapping[str, Any] | None
    ) -> Manifest:
        started, created = time.monotonic(), utc_now()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an int >= 0, got {step!r}")
        self._check_not_complete()
        self._acquire()
        if self._async is not None:  # an async save in flight first (deadline-aware)
            early = self._async.before_sync_save(step, kind)
            if early is not None:
                return early
        last = self._written
        if last is not None and last.step == step and last.kind == kind:
            # e.g. a periodic save and then a preemption save at the same step boundary
            log.info("step %d already committed by this process: not saving it again", step)
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
        self._retain(m)
        return m

    def persist(
        self,
        step: int,
        snap: sharding.Planned,
        *,
        kind: str,
        compat: dict[str, Any],
        metrics: Mapping[str, Any] | None,
        created_utc: str,
        started: float,
        open_shard: Callable[[str], ObjectWriter] | None = None,
    ) -> Manifest:
        """Steps 2-4 of a save: write the shard, check its size, commit the manifest.

        ``open_shard`` opens the shard's writer (default ``storage.open_write``; async
        saves pass a zero-copy writer over their host buffers, :mod:`.arena`).
        """

        def make(shards: tuple[ShardInfo, ...], mkey: str, lay: dict[str, Any] | None) -> Manifest:
            return self._manifest(
                step, kind, shards, compat, metrics, created_utc, started, mkey, lay
            )

        if self.world_size > 1:  # collective: every rank's shard, rank 0 commits
            m = distributed.persist(self, step, snap, kind=kind, make_manifest=make)
            self._verified.add(m.key)
            self._written = m
            log.info(
                "committed step %d (%s, %d ranks, %d bytes, %.3f s)",
                step,
                kind,
                m.world_size,
                m.total_size_bytes,
                m.save_duration_s,
            )
            return m
        area: layout.Area = "final" if kind == "final" else "checkpoints"
        key = layout.shard_key(step, self.rank, self.attempt, area)
        out = sharding.write_object((open_shard or self.storage.open_write)(key), snap)
        size, checksum = out.size_bytes, out.checksum
        info = self.storage.head(key)
        if info is None or info.size_bytes != size:
            raise StorageError(
                f"{key}: committed shard reads back as {info}, expected "
                f"{size} bytes; the storage lost the write"
            )
        m = make(
            (ShardInfo(key, self.rank, size, checksum),),
            layout.manifest_key(step, area),
            sharding.merge_layout([sharding.layout_part(snap, out)]),
        )
        mkey = m.key
        m = commit_manifest(self.storage, m)  # conditional create: one commit per step
        self._verified.add(mkey)
        self._written = m
        log.info("committed step %d (%s, %d bytes, %.3f s)", step, kind, size, m.save_duration_s)
        return m

    def _manifest(
        self,
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
            run=self.run,
            step=step,
            kind=kind,
            attempt=self.attempt,
            world_size=len(shards),
            shards=shards,
            compat=compat,
            metrics=normalize(dict(metrics or {}), "metrics", lenient=True),
            resumed_from=self.resumed_from,
            created_utc=created_utc,
            committed_utc=utc_now(),
            save_duration_s=round(time.monotonic() - started, 6),
            versions={
                "ckrun": str(compat.get("ckrun_version")),
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            compat_drift=tuple(self._drift),
            tensor_layout=tensor_layout,
            key=mkey,
        )

    # -- async saves and the checkpoint interval (issue 7) ------------------------------

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
            self._async = aio.AsyncSaver(self)
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
            self._auto = interval.auto_for(self)
        return interval.should_save(self._every, self._auto, step, sync=sync)

    def interval(self) -> IntervalEstimate | None:
        """The interval ``"auto"`` picks now (None without ``checkpoint_every="auto"``)."""
        from ckrun.checkpoint import interval

        if self._every != "auto":
            return None
        if self._auto is None:
            self._auto = interval.auto_for(self)
        return self._auto.current()

    def _retain(self, m: Manifest) -> None:
        if self.rank != 0:  # rank 0 alone deletes
            return
        try:
            sc = scan(self.storage)
            broken = [p.step for k, _ in sc.problems if (p := layout.parse(k)) is not None]
            protect = {m.step} | ({self.resumed_from} if self.resumed_from is not None else set())
            plan = retention.plan(
                self.storage,
                sc.manifests,
                keep_last=self.keep_last,
                milestone_every=self.milestone_every,
                protect=protect,
                broken_steps=broken,
            )
            retention.apply(self.storage, plan)
            self._verified -= set(plan.manifests)
        except StorageError as e:  # the checkpoint is committed; retention retries next time
            log.warning("retention after step %d failed (will retry): %s", m.step, e)

    def _check_not_complete(self) -> None:
        if not self._complete:
            marker, _ = completion(self.storage)
            self._complete = marker is not None
        if self._complete:
            raise RunComplete(
                f"run {self.run!r} in {self.storage.url} is complete "
                f"({layout.COMPLETE} exists): nothing more is saved; start a "
                "new run directory to train further"
            )

    def _acquire(self) -> None:
        if self._lock is not None:
            self._lock.acquire()

    def close(self) -> None:
        """Drain an in-flight async save (raising its error), release the writer lock."""
        try:
            if self._async is not None:
                self._async.close()
        finally:
            if self._lock is not None:
                self._lock.release()

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
