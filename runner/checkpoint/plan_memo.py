"""The save plan of a single rank, kept between saves of the same structure (issue 19).

A training loop saves the same state again and again: the same tensors under the same
paths, with the same dtypes and shapes, only their values (and the tree's other leaves:
the step, the learning rate, the RNG state) changed.  What :func:`ckrun.checkpoint.
sharding.plan` decides from the structure alone (entry names, pieces, global tensors),
the structure-only part of the shard's header (:class:`ckrun.checkpoint.st_format.
Prepared`) and the manifest layout's global tensors are therefore computed once and
reused while the key below is unchanged: DCP's plan caching
(``torch.distributed.checkpoint.DefaultSavePlanner(enable_plan_caching=True)``) for
ckrun's own planner.  For a small state saved every few steps this work was a large
part of the save (about 40 µs a tensor for a model of 800 tensors).

The key is where each tensor sits in the state (the encoder's chain of keys and indices,
:attr:`ckrun.checkpoint.shard.Snapshot.chains`, of which its name,
:func:`~ckrun.checkpoint.tree_names.tensor_paths`, is a function), their types, dtypes
and shapes, and the piece limit: everything the reused parts are computed from.
Comparing the chains is one C comparison of nested tuples, a tenth of a walk of the tree
for its names (800 tensors: 0.04 against 0.4 ms), which a save of an unchanged structure
no longer makes; nor does it rebuild the tree to name its tensors (the placeholders are
replaced in place, :func:`~ckrun.checkpoint.sharding.materialize`).  The tree itself is
encoded anew by every save, so a changed leaf is never stale.  Only a single process
plans this way: with more than one rank the plan depends on which tensors are equal on
every rank (their CRC32C, gathered each save), and a DTensor's shard on the mesh, so it
is planned each time.
"""

from __future__ import annotations

from typing import Any

import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import sharding, st_format
from ckrun.checkpoint.json_text import Rendered


def _meta(t: fmt.HostArray) -> tuple[Any, ...]:
    """What the reused parts read of one tensor or array: its kind, dtype and shape."""
    if isinstance(t, torch.Tensor):
        return (t.dtype, t.shape)
    return (t.dtype.str, t.shape)


class PlanMemo:
    """The structure of the last single-rank save and what was computed from it."""

    def __init__(self) -> None:
        # (key, structure, cached parts): one attribute, replaced as a whole
        self._memo: tuple[tuple[Any, ...], sharding.Structure, dict[str, Any]] | None = None
        self.hits = 0  # saves planned from the memo (observed by the tests)

    def plan(self, snap: fmt.Snapshot, group: sharding.Group) -> sharding.Planned:
        """:func:`ckrun.checkpoint.sharding.plan` of ``snap``, its structure reused when
        ``snap`` has the key of the last save (module docstring).

        Raises:
            CheckpointError: as :func:`~ckrun.checkpoint.sharding.plan`.
        """
        dtensor = sharding.dtensor_type()
        if group.world_size != 1 or (
            dtensor is not None and any(isinstance(t, dtensor) for t in snap.tensors)
        ):
            return sharding.plan(snap, group)
        limit = sharding.piece_bytes()
        # the encoder's chains name the tensors (no walk of the tree); a snapshot made
        # otherwise is keyed by the names themselves
        chains = len(snap.chains) == len(snap.tensors)
        where = snap.chains if chains else sharding.tensor_paths(snap.tree)
        key = (limit, chains, where, [_meta(t) for t in snap.tensors])
        memo = self._memo
        if memo is not None and memo[0] == key:
            self.hits += 1
            return sharding.materialize(snap, memo[1], **memo[2])
        self._memo = None  # a failure below leaves no stale memo
        names = sharding.tensor_paths(snap.tree) if chains else where
        st = sharding.structure(snap, group, limit, names)
        p = sharding.materialize(snap, st)
        try:
            prepared = st_format.prepare(p.tensors, p.names)
        except ValueError:
            return p  # duplicate entry names: write() refuses them, as without the memo
        # kept with its JSON text: every manifest of this structure writes the same
        lay = Rendered(sharding.layout_tensors([{"pieces": p.pieces, "globals": p.globals}]))
        self._memo = (key, st, {"prepared": prepared, "layout_tensors": lay})
        p.prepared, p.layout_tensors = prepared, lay
        return p
