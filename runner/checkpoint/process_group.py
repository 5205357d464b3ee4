"""The checkpoint's process group: who this rank is, and the gloo group of its own that
the collective save and load (:mod:`ckrun.checkpoint.collective`) gather objects on.

A group of its own keeps the checkpoint's gathers apart from the training's collectives
(a CUDA/NCCL job's collectives are untouched, and a save persisted by a background thread
cannot interleave with DDP's all-reduces).  Its collectives wait at most
``CKRUN_COLLECTIVE_TIMEOUT_S`` seconds for a rank.
"""

from __future__ import annotations

import atexit
import datetime as dt
import logging
import os
from typing import Any

from ckrun.errors import ConfigError

__all__ = ["TIMEOUT_ENV", "Group", "dist_info"]

log = logging.getLogger(__name__)

#: Seconds a collective of the checkpoint group waits for a rank (default 30 min); the
#: supervisor's grace deadline normally ends a hung save much earlier.
TIMEOUT_ENV = "CKRUN_COLLECTIVE_TIMEOUT_S"


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)``: from ``torch.distributed`` when initialised, else from the
    ``RANK`` / ``WORLD_SIZE`` environment (torchrun sets both), else ``(0, 1)``.

    Raises:
        ConfigError: ``RANK``/``WORLD_SIZE`` malformed or inconsistent.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ConfigError(f"RANK/WORLD_SIZE must be integers: {e}") from e
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}; check the launcher")
    return rank, world


class Group:
    """The checkpoint's own gloo process group (CPU objects; a single process: no-op).

    Created here when ``torch.distributed`` is already initialised (the Checkpointer is
    built at the same point of the program on every rank, in the main thread), else by
    the first collective (``load``/``save`` are collectives).  A group of its own keeps
    the checkpoint's gathers apart from the training's collectives, so a save persisted
    by a background thread (``async_save``) cannot interleave with DDP's all-reduces.

    Raises:
        ConfigError: ``world_size > 1`` but ``torch.distributed`` is not initialised.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._pg: Any = None
        import torch.distributed as dist

        if world_size > 1 and dist.is_available() and dist.is_initialized():
            self._group()

    def _group(self) -> Any:
        import torch.distributed as dist

        if self._pg is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError(
                    f"rank {self.rank} of {self.world_size}: torch.distributed is not "
                    "initialised; call torch.distributed.init_process_group() before the "
                    "Checkpointer's load/save"
                )
            secs = float(os.environ.get(TIMEOUT_ENV, "1800"))
            self._pg = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=secs))
            atexit.register(_destroy_at_exit, self._pg)
        return self._pg

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._group())
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, on every rank."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group())
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group())
        return box[0]

    def all_ok(self, ok: bool, why: str = "") -> tuple[bool, list[str]]:
        """(True when every rank is ok, the reasons of the ranks that are not)."""
        if self.world_size == 1:
            return ok, [] if ok else [why]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, (ok, why), group=self._group())
        return all(o[0] for o in out), [f"rank {r}: {o[1]}" for r, o in enumerate(out) if not o[0]]


def _destroy_at_exit(pg: Any) -> None:
    """Destroy the checkpoint's gloo group while the interpreter is still alive.

    A gloo group left to interpreter finalization can abort the process ("terminate
    called without an active exception", exit -6): its worker threads still hold work
    objects whose tensors need the GIL when the C++ objects are torn down (see
    pytorch/pytorch#179291).  Destroying a gloo group is local (no collective).
    """
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group(pg)
    except Exception as e:  # the process is ending: report, never raise from atexit
        log.debug("destroying the checkpoint group at exit failed: %s", e)
