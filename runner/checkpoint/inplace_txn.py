"""The transaction of an in-place load (:mod:`ckrun.checkpoint.inplace_load`): a failed
load never leaves a half-loaded state in use.

The bytes of a fresh tensor are verified before the state sees them; those read in place
are not (that is the point: no second copy).  So an in-place load is a transaction over
the live tensors, recorded on the commit context
(:attr:`ckrun.checkpoint.pipeline.CommitContext.dirty`):

1. before the first byte of a checkpoint lands in a live tensor, that tensor is recorded
   as written by the attempt;
2. when any piece of the checkpoint fails its check (CRC32C mismatch, missing or
   truncated shard), every tensor the attempt wrote becomes *dirty*, and the load falls
   back to the next older checkpoint, as a corrupt checkpoint always did (DESIGN.md §3);
   that older checkpoint is read in place over the same tensors;
3. a successful, verified attempt cleans the tensors it rewrote; after its ``restore``,
   a dirty tensor that is still part of the state means the older checkpoint did not
   cover it (it lacked that tensor), and the load raises :class:`StateUnusable`;
4. when no older checkpoint is left and a tensor is dirty, the load raises
   :class:`StateUnusable` too (instead of returning None and training from a
   half-loaded model).

So the answer to "a checksum failure mid-load" is: **restore the previous good
checkpoint over it; when none covers it, stop the process** (StateUnusable is a
CheckpointError: exit status 5, an ordinary failure the supervisor restarts within its
budgets — a fresh process reads the checkpoints again; a persistently damaged only
checkpoint ends in the supervisor's crash-loop stop, with the damaged step named, so
the operator can move it aside).  Until a later load cleans them, every save of this
Checkpointer refuses (:func:`ckrun.checkpoint.pipeline.begin`), so a half-loaded state
is never committed.  With more than one rank every decision is collective (all ranks fall
back and stop together).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from ckrun.checkpoint.pipeline import CommitContext
from ckrun.checkpoint.state import capture, tensors_of
from ckrun.errors import StateUnusable

__all__ = ["Transaction"]

log = logging.getLogger(__name__)


class Transaction:
    """One :meth:`ckrun.Checkpointer.load`'s record of the live tensors it writes (see
    the module docstring; the dirty set itself lives on the commit context, so it
    outlasts a load that raised)."""

    def __init__(self, ctx: CommitContext):
        self.ctx = ctx
        self.written: dict[int, tuple[str, torch.Tensor]] = {}  # by the current attempt
        self.failed_step: int | None = None  # newest checkpoint that failed after writing
        # every rank knows these alike (fall-backs are collective): they decide whether
        # the collective checks of restored()/exhausted() run
        self.fell_back = False
        self.started_unusable = bool(ctx.unusable)
        self.healed = 0  # dirty tensors the restored checkpoint rewrote

    def attempt(self) -> MutableMapping[int, tuple[str, torch.Tensor]]:
        """Start reading one checkpoint; returns the record :func:`read_globals` fills."""
        self.written = {}
        return self.written

    def failed(self, step: int) -> None:
        """The attempt's checkpoint failed verification: what it wrote is dirty."""
        self.fell_back = True
        if self.written:
            self.ctx.dirty.update(self.written)
            if self.failed_step is None:
                self.failed_step = step
        self.written = {}

    def aborted(self, why: BaseException) -> None:
        """The load raised (storage error, a restore that does not fit): what the
        attempt wrote is dirty, and the state is unusable until a load cleans it."""
        self.ctx.dirty.update(self.written)
        self.written = {}
        if self.ctx.dirty:
            self.ctx.unusable = _message(f"the load stopped ({type(why).__name__}: {why})")

    def restored(self, state: Mapping[str, Any], step: int) -> None:
        """The attempt's checkpoint verified and was restored: it cleans what it
        rewrote; a dirty tensor still in the state makes the state unusable.

        Raises:
            StateUnusable: a tensor written by a failed attempt is still in use.
        """
        self.healed = sum(1 for p in self.written if p in self.ctx.dirty)
        for ptr in self.written:
            self.ctx.dirty.pop(ptr, None)
        self.written = {}
        if not self.fell_back and not self.started_unusable:
            if not self.ctx.dirty:
                self.ctx.unusable = None
            return
        live = {t.data_ptr() for t in tensors_of(capture(state, rng=False))}
        left = sorted(n for p, (n, _) in self.ctx.dirty.items() if p in live)
        why = (
            f"checkpoint step {step} does not overwrite {', '.join(left[:5])}"
            + (f" and {len(left) - 5} more" if len(left) > 5 else "")
            + f", which the damaged checkpoint step {self.failed_step} had partly written"
            if left
            else ""
        )
        ok, whys = self.ctx.group.all_ok(not left, why)  # symmetric: every rank failed
        if ok:
            if self.healed:
                log.warning(
                    "checkpoint step %s failed verification after %d tensors were read "
                    "in place; checkpoint step %d was restored over every one of them",
                    self.failed_step,
                    self.healed,
                    step,
                )
            self.ctx.dirty.clear()
            self.ctx.unusable = None
            return
        self._unusable("; ".join(whys))

    def exhausted(self) -> None:
        """No checkpoint is left to restore.

        Raises:
            StateUnusable: a failed attempt wrote into live tensors (module docstring).
        """
        if not self.fell_back:
            return
        n = len(self.ctx.dirty)
        ok, whys = self.ctx.group.all_ok(
            not n, f"{n} tensors partly hold checkpoint step {self.failed_step}"
        )
        if not ok:
            self._unusable(
                "; ".join(whys) + " and no older checkpoint is left to restore over them"
            )

    def _unusable(self, why: str) -> None:
        self.ctx.unusable = _message(why)
        raise StateUnusable(self.ctx.unusable)


def _message(why: str) -> str:
    return (
        f"the state in memory is unusable: {why}.  A checkpoint failed verification after "
        "its bytes were read in place into the live tensors; this process stops (the "
        "supervisor restarts it and a fresh process reads the checkpoints again) and "
        "nothing is saved from this state.  If a checkpoint is damaged on storage, "
        "`ckrun verify` names it: move its step directory aside to resume from an "
        "older one"
    )
