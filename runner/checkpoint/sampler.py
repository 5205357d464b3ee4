"""``ckrun.ResumableSampler``: a shuffling sampler that resumes mid-epoch.

The permutation of epoch ``e`` is ``torch.randperm(n, generator=seed + e)`` (its own
generator: the global RNG is untouched), so it is the same in every process.  The
sampler counts the indices it has yielded in the current epoch; ``state_dict()`` holds
``(epoch, position)`` and a restored sampler yields the rest of that epoch, then moves on
to the next.  With ``num_replicas > 1`` each rank takes every ``num_replicas``-th index
of the padded permutation, like ``DistributedSampler``.

A ``DataLoader`` fetches indices ahead of the batches the model consumed (with worker
processes ``prefetch_factor * num_workers`` batches; the sampler may even have finished
the epoch while its last batches are still in flight).  :class:`ResumableDataLoader`
makes the exact path the easy one: it records the indices of every batch it dispatches
and, as each batch is handed to the training loop, the sampler's state advances to the
samples actually consumed (``state_dict()`` gives that ``(epoch, position)``), whatever
the worker count, before or after a resume.  It also gives the loader its own
``generator=torch.Generator()`` by default: every new DataLoader iterator draws a base
seed from its generator, by default the global torch RNG, and a resumed process creates
its iterator mid-epoch where the uninterrupted run did not, so the global RNG stream
(dropout, ...) would shift by one draw.

With a plain ``DataLoader`` and workers, call :meth:`ResumableSampler.set_position`
with the samples consumed before saving (still supported; with ``num_workers=0`` the
loader fetches no batch ahead and nothing is needed), and pass
``generator=torch.Generator()`` yourself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


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
        # (epoch, samples) consumed, set by a ResumableDataLoader while it iterates;
        # None: the yielded position is the consumed one
        self.consumed: tuple[int, int] | None = None

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
            self.epoch, self.position, self.consumed = epoch, 0, None

    def set_position(self, consumed: int) -> None:
        """Set the samples of the current epoch consumed so far (see module docstring);
        an explicit position replaces what a :class:`ResumableDataLoader` counted."""
        if not 0 <= consumed <= len(self):
            raise ValueError(f"position {consumed} outside the epoch of {len(self)}")
        self.position, self.consumed = consumed, None

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``position`` (consumed samples, when a :class:`ResumableDataLoader`
        counts them; else yielded ones) and the parameters that define the order."""
        epoch, position = self.consumed or (self.epoch, self.position)
        return {
            "epoch": epoch,
            "position": position,
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
        self.consumed = None


class _DispatchedBatches(Sampler[list[int]]):
    """Batches of a :class:`ResumableSampler`'s indices; records ``(epoch, size)`` of
    each batch as the DataLoader takes it (in the main process, ahead of consumption)."""

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.dispatched: deque[tuple[int, int]] = deque()

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        epoch = self.sampler.epoch
        for i in self.sampler:
            if not batch:
                epoch = self.sampler.epoch  # the epoch these indices belong to
            batch.append(i)
            if len(batch) == self.batch_size:
                self.dispatched.append((epoch, len(batch)))
                yield batch
                batch = []
        if batch and not self.drop_last:
            self.dispatched.append((epoch, len(batch)))
            yield batch


class ResumableDataLoader(DataLoader[Any]):
    """A ``DataLoader`` over a :class:`ResumableSampler` that counts consumed samples.

    Put the sampler (or this loader) in the checkpointed state; its ``state_dict()``
    holds the samples the training loop has received, not those prefetched by workers,
    so a resume is exact whatever ``num_workers`` was before and is after, and wherever
    the preemption lands (the last prefetched batches of an epoch included).

    Args:
        dataset: a map-style dataset.
        sampler: the :class:`ResumableSampler` giving the order.
        batch_size: samples per batch.
        drop_last: drop the last incomplete batch of each epoch.
        **kw: other ``DataLoader`` arguments (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ...);
            ``generator`` defaults to a fresh ``torch.Generator()`` (see the module
            docstring).

    Raises:
        ValueError: ``in_order=False`` (batches must reach the loop in dispatch order),
            or ``shuffle``/``batch_sampler`` given (the sampler defines the order).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        sampler: ResumableSampler,
        batch_size: int = 1,
        drop_last: bool = False,
        **kw: Any,
    ) -> None:
        if kw.get("in_order", True) is False:
            raise ValueError("ResumableDataLoader needs in_order=True (the default)")
        for k in ("shuffle", "batch_sampler"):
            if kw.get(k) is not None:
                raise ValueError(f"ResumableDataLoader takes no {k}=: the sampler orders data")
        kw.setdefault("generator", torch.Generator())
        self.resumable_sampler = sampler
        self._batches = _DispatchedBatches(sampler, batch_size, drop_last)
        super().__init__(dataset, batch_sampler=self._batches, **kw)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        s, log = self.resumable_sampler, self._batches.dispatched
        log.clear()
        s.consumed = None  # nothing prefetched yet: the sampler's own position is exact
        consumed = (s.epoch, s.position)
        it = super().__iter__()  # with workers, this already dispatches batches
        for batch in it:
            epoch, n = log.popleft()
            consumed = (epoch, (consumed[1] if consumed[0] == epoch else 0) + n)
            s.consumed = consumed
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (consumed samples)."""
        return self.resumable_sampler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume the sampler (see :meth:`ResumableSampler.load_state_dict`)."""
        self.resumable_sampler.load_state_dict(sd)
