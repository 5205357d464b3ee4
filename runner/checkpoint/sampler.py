"""``ckrun.ResumableSampler``: a shuffling sampler that resumes mid-epoch.

The permutation of epoch ``e`` is ``torch.randperm(n, generator=seed + e)`` (its own
generator: the global RNG is untouched), so it is the same in every process.  The
sampler counts the indices it has yielded in the current epoch; ``state_dict()`` holds
``(epoch, position)`` and a restored sampler yields the rest of that epoch, then moves on
to the next.  With ``num_replicas > 1`` each rank takes every ``num_replicas``-th index
of the padded permutation, like ``DistributedSampler``.

DataLoader with worker processes fetches ``prefetch_factor * num_workers`` batches
ahead, so the yielded count runs ahead of the batches the model consumed: call
:meth:`ResumableSampler.set_position` with the samples actually consumed (or use
``torchdata.stateful_dataloader.StatefulDataLoader``, whose state dict can be put in the
ckrun state under any key) before saving.  With ``num_workers=0`` no fix is needed.

Exact resume also needs ``DataLoader(..., generator=torch.Generator())``: every new
DataLoader iterator draws a base seed from its generator, by default the global torch
RNG, and a resumed process creates its iterator mid-epoch where the uninterrupted run
did not, so the global RNG stream (dropout, ...) would shift by one draw.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) indices with an exact mid-epoch resume position.

    Args:
        data_source: a sized dataset, or its length.
        shuffle: permute each epoch (seeded by ``seed + epoch``).
        seed: base seed of the permutations.
        num_replicas: ranks sharing the data; this rank takes ``rank::num_replicas``.
        rank: this rank.
        drop_last: drop the tail instead of padding to a multiple of ``num_replicas``.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ):
        self.n = data_source if isinstance(data_source, int) else len(data_source)
        if self.n < 0 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid sampler size {self.n} / rank {rank} of {num_replicas}")
        self.shuffle, self.seed = shuffle, seed
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Indices per epoch for this rank."""
        if self.drop_last:
            return self.n // self.num_replicas
        return -(-self.n // self.num_replicas)

    def _order(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        total = len(self) * self.num_replicas
        if total > len(idx) and idx:
            idx += (idx * (total // len(idx) + 1))[: total - len(idx)]
        return idx[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        order = self._order(self.epoch)
        while self.position < len(order):
            i = order[self.position]
            self.position += 1
            yield i
        self.epoch += 1
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless it is the epoch being resumed."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def set_position(self, consumed: int) -> None:
        """Set the samples of the current epoch consumed so far (see module docstring)."""
        if not 0 <= consumed <= len(self):
            raise ValueError(f"position {consumed} outside the epoch of {len(self)}")
        self.position = consumed

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``position`` and the parameters that define the order."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "n": self.n,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at ``sd``'s epoch and position.

        Raises:
            ValueError: the dataset size, seed, shuffle or replica layout differ (the
                remaining batches would not be the same ones).
        """
        for k in ("seed", "n", "shuffle", "num_replicas", "rank"):
            if sd.get(k) != getattr(self, k):
                raise ValueError(
                    f"sampler {k} changed ({sd.get(k)!r} → {getattr(self, k)!r}):"
                    " the resumed epoch would see different data"
                )
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])
