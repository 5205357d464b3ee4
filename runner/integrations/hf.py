"""Hugging Face Trainer integration (issue 15): one callback and one resume line.

::

    from ckrun.integrations.hf import CkrunCallback, resume_checkpoint
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[CkrunCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))

On a notice (:func:`ckrun.preemption_requested`, checked in ``on_step_end``) the callback
sets ``control.should_save`` and ``control.should_training_stop``: the Trainer writes its
own full checkpoint ``checkpoint-N/`` (model, optimizer, scheduler, scaler, RNG of every
generator it uses, ``trainer_state.json`` with the global step; the data position is the
step count, from which the Trainer skips the batches already consumed in the epoch unless
``ignore_data_skip``) at the end of that step.  In ``on_save`` ckrun commits that
directory as a file set (:mod:`ckrun.checkpoint.fileset`: every file checksummed, the
manifest written last, ckrun's retention) and the process exits 75 — except after the
last step, where the run finalizes and completes instead (no resume could run a step
more).  Every checkpoint
the Trainer saves on its own schedule is committed the same way.  After the last step
the callback makes the Trainer save once more and commits that checkpoint as the run's
final artifact (``COMPLETE.json``).

:func:`resume_checkpoint` restores the newest *verified* commit into
``output_dir/checkpoint-N`` (replacing a half-written directory of that name) and
returns its path for ``trainer.train(resume_from_checkpoint=...)``; None on a fresh run.
With several ranks (``torchrun``, ``ddp_backend="gloo"`` or NCCL) the first rank of a
launch restores under a file lock and the others use its directory; each rank writes
its own ``rng_state_<rank>.pth``, so ``on_save`` waits for all ranks (a barrier) before
rank 0 commits the directory.
The HF layout is kept, so HF tools read the directory as usual.  Sources: transformers
``TrainerCallback``/``TrainerControl`` and ``Trainer._maybe_log_save_evaluate`` /
``_save_checkpoint`` (transformers 5.24).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ckrun.checkpoint import fileset
from ckrun.control import install_signal_handlers, preemption_requested
from ckrun.integrations.common import (
    barrier,
    commit,
    dir_files,
    exit_preempted,
    restore_shared,
    run_storage,
    step_digest,
)
from ckrun.storage.base import Storage
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
STEPS_FILE = "ckrun_steps.json"  # per-step digests, CKRUN_STEP_DIGEST=1 (check-resume)


class CkrunCallback(TrainerCallback):
    """Commit the Trainer's checkpoints with ckrun and stop on a notice (module docstring).

    Args:
        storage: the run root (default ``CKRUN_STORAGE``, set by the supervisor); without
            one the callback only stops training on a notice.
        keep_last: ckrun's retention of committed checkpoints (>= 1).
    """

    def __init__(self, storage: str | Storage | None = None, keep_last: int = 3) -> None:
        self.storage = run_storage(storage)
        self.keep_last = keep_last
        self.preempting = False
        self.resumed_from: int | None = None
        self.digests = os.environ.get("CKRUN_STEP_DIGEST") == "1"
        self.steps: dict[str, str] = {}
        install_signal_handlers()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        self.resumed_from = state.global_step or None
        prior = os.path.join(str(args.output_dir), f"{PREFIX}{state.global_step}", STEPS_FILE)
        if self.digests and self.resumed_from and os.path.exists(prior):
            with open(prior) as f:
                self.steps = dict(json.load(f))
        if args.ignore_data_skip and self.resumed_from:
            log.warning(
                "ignore_data_skip=True: the Trainer does not skip the batches already "
                "consumed in this epoch; the resumed run sees other data than an "
                "uninterrupted one"
            )
        if args.save_only_model:
            log.warning(
                "save_only_model=True: checkpoints hold no optimizer, scheduler or RNG "
                "state; a resume is not exact"
            )
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        if self.digests and "model" in kw:
            self.steps[str(state.global_step)] = step_digest(kw["model"].parameters())
        if preemption_requested(sync=True):
            self.preempting = True
            control.should_save = True
            control.should_training_stop = True
        if state.global_step >= state.max_steps:
            control.should_save = True  # the final artifact is a full checkpoint
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        step = state.global_step
        # every rank writes its own rng_state_<rank>.pth and the Trainer does not wait
        # for them before on_save: rank 0 commits the directory once all are written
        barrier()
        if self.storage is not None and state.is_world_process_zero:
            top = f"{PREFIX}{step}"
            self._write_steps(str(args.output_dir), top)
            commit(
                self.storage,
                step,
                dir_files(str(args.output_dir), top),
                keep_last=self.keep_last,
                resumed_from=self.resumed_from,
            )
        if self.preempting and step < state.max_steps:  # at the last step: finalize, exit 0
            barrier()  # torchrun stops every rank once one exits 75: not before the commit
            exit_preempted(step)
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        top = f"{PREFIX}{state.global_step}"
        if self.storage is None or not state.is_world_process_zero:
            return control
        if not os.path.isdir(os.path.join(str(args.output_dir), top)):
            log.warning("no %s after the last step: no final artifact committed", top)
            return control
        self._write_steps(str(args.output_dir), top)
        commit(self.storage, state.global_step, dir_files(str(args.output_dir), top), kind="final")
        return control

    def _write_steps(self, output_dir: str, top: str) -> None:
        if self.digests and os.path.isdir(os.path.join(output_dir, top)):
            from ckrun.storage.fsutil import write_json_atomic

            write_json_atomic(os.path.join(output_dir, top, STEPS_FILE), self.steps)


def resume_checkpoint(output_dir: str, storage: str | Storage | None = None) -> str | None:
    """Restore the newest verified committed ``checkpoint-N`` into ``output_dir``.

    Args:
        output_dir: the Trainer's ``args.output_dir``.
        storage: the run root (default ``CKRUN_STORAGE``).

    Returns:
        The restored directory for ``trainer.train(resume_from_checkpoint=...)``, or None
        when nothing is committed (a fresh run) or no storage is known.
    """
    st = run_storage(storage)
    if st is None:
        log.warning("resume_checkpoint: no CKRUN_STORAGE (not under ckrun): starting fresh")
        return None
    fs = fileset.newest(st, prefix=PREFIX)
    if fs is None:
        return None
    top = f"{PREFIX}{fs.manifest.step}"
    os.makedirs(output_dir, exist_ok=True)
    path = restore_shared(fs, output_dir, top)
    log.info("restored committed step %d into %s", fs.manifest.step, path)
    return path
