"""PyTorch Lightning integration (issue 15): one callback and one resume line.

::

    from ckrun.integrations.lightning import CkrunCallback, resume_checkpoint
    trainer = L.Trainer(max_steps=1000, callbacks=[CkrunCallback()])
    trainer.fit(model, ckpt_path=resume_checkpoint("ckpts"))

What the callback does (sources: Lightning 2.6 ``Callback``, ``Trainer.save_checkpoint``,
``FitLoop.setup_data`` and ``_SignalConnector``):

* **every save committed**: ``setup`` wraps the strategy's ``CheckpointIO`` in
  :class:`ckrun.integrations.lightning_io.CkrunCheckpointIO`, so each full checkpoint
  Lightning writes (``ModelCheckpoint``'s, the user's ``trainer.save_checkpoint``, the
  callback's own) is committed by ckrun once written.
* **notice**: :func:`ckrun.preemption_requested` is checked in ``on_train_batch_end``;
  on a notice (before the last batch: at the last one the final save follows anyway and
  the run completes with exit 0) the callback calls ``trainer.save_checkpoint``
  (Lightning's own full checkpoint: model, optimizers, schedulers, loops, callbacks),
  commits that file as a ckrun file set (:mod:`ckrun.checkpoint.fileset`: checksummed,
  manifest last, ckrun's retention) and exits 75.  When ``fit`` ends it saves and
  commits the final artifact (also when a run resumed from a checkpoint of its last step
  runs no step at all).
* **data position**: Lightning restarts a plain ``DataLoader`` from the start of the epoch
  on a mid-epoch resume ("dataloader is not resumable").  The callback rebuilds the
  training ``DataLoader(shuffle=True)`` with a :class:`ckrun.ResumableSampler` (seeded from
  ``torch.initial_seed()``) and its own ``torch.Generator`` (so creating the iterator draws
  nothing from the global RNG), and stores the batches consumed in the epoch in the
  checkpoint; the resumed run continues the same permutation at the next batch.
* **RNG**: Lightning checkpoints hold no RNG state; the callback stores python, numpy,
  torch and CUDA RNG states and restores them in ``on_train_start``, after the data
  iterator exists, right before the first resumed batch.
* **SLURM**: Lightning's own SLURM auto-requeue (``SLURMEnvironment(auto_requeue=True)``,
  the default inside a Slurm job) is switched off in ``setup``: ckrun's supervisor
  requeues; two requeues of one job would race.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sized
from typing import Any, cast

import lightning.pytorch as pl
import torch
from ckrun.checkpoint import fileset
from ckrun.checkpoint.sampler import ResumableSampler
from ckrun.checkpoint.state import rng_state, set_rng_state
from ckrun.control import install_signal_handlers, preemption_requested
from ckrun.integrations.common import commit, exit_preempted, run_storage, step_digest
from ckrun.integrations.lightning_io import PREFIX, CkrunCheckpointIO, install
from ckrun.storage.base import Storage
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

log = logging.getLogger(__name__)

__all__ = ["PREFIX", "CkrunCallback", "CkrunCheckpointIO", "resume_checkpoint"]


class CkrunCallback(pl.Callback):
    """Commit Lightning checkpoints with ckrun, stop on a notice, restore the data
    position and RNG (module docstring).

    Args:
        dirpath: where the callback writes its checkpoint files (default
            ``<trainer.default_root_dir>/ckrun``).
        storage: the run root (default ``CKRUN_STORAGE``).
        keep_last: ckrun's retention of committed checkpoints (>= 1).
        every_n_steps: also save and commit every this many optimizer steps.
        data_position: rebuild the training ``DataLoader(shuffle=True)`` so a mid-epoch
            resume continues its permutation (False: leave the loader alone; a mid-epoch
            resume then sees other batches than an uninterrupted run).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        storage: str | Storage | None = None,
        keep_last: int = 3,
        every_n_steps: int | None = None,
        data_position: bool = True,
    ) -> None:
        self.dirpath = dirpath
        self.storage = run_storage(storage)
        self.keep_last, self.every_n_steps = keep_last, every_n_steps
        self.data_position = data_position
        self.sampler: ResumableSampler | None = None
        self.batch_size = 1
        self.steps: dict[str, str] = {}  # per-step digests (CKRUN_STEP_DIGEST=1)
        self._pending: dict[str, Any] | None = None
        self._resumed_from: int | None = None
        self._consumed = 0
        self.io: CkrunCheckpointIO | None = None
        install_signal_handlers()

    # -- setup: SLURM requeue off, the training loader made resumable ----------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning.fabric.plugins.environments.slurm import SLURMEnvironment

        connector = getattr(trainer, "_accelerator_connector", None)  # what registers signals
        for env in (
            getattr(trainer.strategy, "cluster_environment", None),
            getattr(connector, "cluster_environment", None),
        ):
            if isinstance(env, SLURMEnvironment) and env.auto_requeue:
                env.auto_requeue = False
                log.info("Lightning's SLURM auto-requeue is off: ckrun requeues the job")
        if self.storage is not None:  # every full checkpoint Lightning writes is committed
            self.io = install(trainer.strategy, self.storage, self.keep_last)
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "ckrun")
        if stage != "fit" or not self.data_position:
            return
        src = getattr(trainer.fit_loop, "_data_source", None)  # Lightning 2.x internals
        if src is None or not callable(getattr(src, "dataloader", None)):
            log.warning("cannot reach Lightning's training data source: data position not restored")
            return
        original = src.dataloader
        src.dataloader = lambda: self._resumable(original(), trainer)

    def _resumable(self, loader: Any, trainer: pl.Trainer) -> Any:
        if type(loader) is not DataLoader or not isinstance(loader.sampler, RandomSampler):
            if not isinstance(getattr(loader, "sampler", None), ResumableSampler):
                log.warning(
                    "the training loader is not a DataLoader(shuffle=True): ckrun does not "
                    "restore its position mid-epoch"
                )
            return loader
        world, rank = trainer.world_size, trainer.global_rank
        seed = torch.initial_seed() % 2**31
        if world > 1:  # one permutation for all ranks, each takes its share
            seed = int(trainer.strategy.broadcast(seed))
        self.sampler = ResumableSampler(
            len(cast(Sized, loader.dataset)),
            shuffle=True,
            seed=seed,
            num_replicas=world,
            rank=rank,
        )
        if self._pending is not None and self._pending.get("sampler") is not None:
            # rank 0 wrote the checkpoint; every rank has consumed as many batches
            self.sampler.load_state_dict({**self._pending["sampler"], "rank": rank})
        self.batch_size = loader.batch_size or 1
        self._consumed = self.sampler.position
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=self.sampler if world == 1 else RankSampler(self.sampler),
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            generator=torch.Generator(),
        )

    # -- state in Lightning's checkpoint -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        sampler = None
        if self.sampler is not None:
            sampler = self.sampler.state_dict()
            sampler["position"] = min(self._consumed, len(self.sampler))
        rng = _portable(rng_state())
        out: dict[str, Any] = {"rng": rng, "sampler": sampler, "steps": dict(self.steps)}
        if _world() > 1:  # rank 0 writes the file: it holds every rank's RNG
            import torch.distributed as dist

            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, rng)  # every rank dumps the checkpoint's state
            out["rng_ranks"] = ranks
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = dict(state_dict)
        self.steps = dict(state_dict.get("steps") or {})

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resumed_from = trainer.global_step or None
        if self.io is not None:
            self.io.resumed_from = self._resumed_from
        if self._pending is not None and self._pending.get("rng") is not None:
            set_rng_state(_native(_own_rng(self._pending, trainer)))  # last: the next draw
        self._pending = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sampler is not None:
            self._consumed = (
                self.sampler.position if self.sampler.epoch == trainer.current_epoch else 0
            )

    # -- the notice, periodic and final saves -----------------------------------------

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._consumed += self.batch_size
        step = trainer.global_step
        if os.environ.get("CKRUN_STEP_DIGEST") == "1":
            self.steps[str(step)] = step_digest(pl_module.parameters())
        if preemption_requested(sync=True) and not _last_step(trainer):
            self._save(trainer, step)
            exit_preempted(step)
        elif self.every_n_steps and step % self.every_n_steps == 0:
            self._save(trainer, step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # on_fit_end, not on_train_end: a run resumed from a checkpoint of its last step
        # skips the training loop (and on_train_end) and must still finalize
        if self._pending is not None and self._pending.get("rng") is not None:
            set_rng_state(_native(_own_rng(self._pending, trainer)))  # no on_train_start
            self._pending = None
        if not trainer.interrupted:
            self._save(trainer, trainer.global_step, kind="final")

    def _save(self, trainer: pl.Trainer, step: int, kind: str = "recovery") -> None:
        assert self.dirpath is not None
        name = f"step={step}.ckpt" if kind != "final" else f"final-step={step}.ckpt"
        path = os.path.join(self.dirpath, name)
        if self.io is not None:  # the plugin commits what Lightning writes (rank 0)
            self.io.kind = kind
            try:
                trainer.save_checkpoint(path)  # every rank must call it (a collective)
            finally:
                self.io.kind = "recovery"
            return
        trainer.save_checkpoint(path)
        if self.storage is not None and trainer.is_global_zero:
            commit(
                self.storage,
                step,
                {PREFIX + name: path},
                kind=kind,
                keep_last=self.keep_last,
                resumed_from=self._resumed_from,
            )


def _last_step(trainer: pl.Trainer) -> bool:
    """The batch that just ended is the run's last: a notice now is answered by the
    final save that follows anyway (no preemption, no resume that could run a step more)."""
    if trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step:
        return True
    max_epochs = trainer.max_epochs
    return bool(
        trainer.is_last_batch
        and max_epochs is not None
        and 0 < max_epochs <= trainer.current_epoch + 1
    )


class RankSampler(DistributedSampler):  # type: ignore[type-arg]
    """A :class:`ResumableSampler` with several replicas, presented to Lightning as the
    ``DistributedSampler`` it would otherwise wrap around it (``DistributedSamplerWrapper``
    re-partitions whatever the inner sampler yields, which breaks a mid-epoch resume)."""

    def __init__(self, inner: ResumableSampler) -> None:  # no super(): nothing of its own
        self.inner = inner
        self.num_replicas, self.rank = inner.num_replicas, inner.rank
        self.shuffle, self.seed, self.drop_last = inner.shuffle, inner.seed, inner.drop_last
        self.epoch = inner.epoch

    def __iter__(self) -> Iterator[int]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)
        self.epoch = epoch


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _own_rng(state: dict[str, Any], trainer: pl.Trainer) -> dict[str, Any]:
    """This rank's RNG from a checkpoint (rank 0's when it holds no per-rank states or
    was written by another world size: then a resume is not exact, and says so)."""
    ranks = state.get("rng_ranks")
    if isinstance(ranks, list) and len(ranks) == trainer.world_size:
        return cast(dict[str, Any], ranks[trainer.global_rank])
    if trainer.world_size > 1:
        log.warning(
            "the checkpoint holds no RNG state of rank %d: rank 0's is used", trainer.global_rank
        )
    return cast(dict[str, Any], state["rng"])


def _portable(rng: dict[str, Any]) -> dict[str, Any]:
    """RNG states as tensors and primitives: Lightning loads with ``weights_only=True``."""
    out = dict(rng)
    if "numpy" in out:
        name, keys, pos, has_gauss, gauss = out["numpy"]
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    return out


def _native(rng: dict[str, Any]) -> dict[str, Any]:
    out = dict(rng)
    if "numpy" in out:
        import numpy as np

        name, keys, pos, has_gauss, gauss = out["numpy"]
        out["numpy"] = [name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss]
    return out


def resume_checkpoint(dirpath: str, storage: str | Storage | None = None) -> str | None:
    """Restore the newest verified committed Lightning checkpoint into ``dirpath``.

    Returns:
        The restored ``.ckpt`` path for ``trainer.fit(model, ckpt_path=...)``, or None on
        a fresh run (nothing committed) or without a storage.
    """
    st = run_storage(storage)
    if st is None:
        log.warning("resume_checkpoint: no CKRUN_STORAGE (not under ckrun): starting fresh")
        return None
    fs = fileset.newest(st, prefix=PREFIX)
    if fs is None:
        return None
    name = next(n for n in fs.files if n.startswith(PREFIX))
    path = os.path.join(dirpath, name[len(PREFIX) :])
    fs.extract(name, path)
    log.info("restored committed step %d into %s", fs.manifest.step, path)
    return path
