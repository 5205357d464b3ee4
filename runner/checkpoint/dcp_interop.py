"""torch.distributed.checkpoint (DCP) interop (issue 14): export a ckrun checkpoint as a
DCP directory, seed a ckrun run from one.

DCP layout used both ways: the run's user state as a nested state dict, e.g.
``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": {...}}``
(the optimizer state keyed as ``Optimizer.state_dict`` numbers its parameters), which
DCP flattens to ``model.block.weight``, ``optimizer.state.0.exp_avg``, ... in its
``.metadata``.  ``dcp.load`` reads an export into the same structure on any world size
and layout (FSDP2, DDP, one process); a DCP checkpoint saved that way by a
torchtitan-style trainer (``dcp.save({"model": ..., "optimizer": ...})``) seeds a ckrun
run through ``Checkpointer.load(state, from_dcp=PATH)``.

Export (``ckrun export RUN --format dcp -o OUT``, :func:`write_dcp` registered in
:mod:`ckrun.checkpoint.export`) writes the global tensors whole from one process
(``dcp.save(..., no_dist=True)``; DCP reshards them on load).  Import builds, from the
DCP metadata, a target for every tensor in the layout the current state wants (a
DTensor's local shard, the parameter's layout for an optimizer state that does not exist
yet, else a whole tensor: the targets of :mod:`ckrun.checkpoint.reshard`), lets
``dcp.load`` fill them (DCP reads only the chunks each rank needs), and restores the
result with ``load_state_dict``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch
from ckrun.checkpoint import reshard
from ckrun.checkpoint.sharding import dtensor_box, dtensor_type
from ckrun.checkpoint.state import TREE_VERSION, restore
from ckrun.errors import ConfigError


def write_dcp(user: dict[str, Any], out: str) -> None:
    """Write a run's user state (global tensors whole) as a DCP directory ``out`` from
    one process; the ``dcp`` format of ``ckrun export`` (:mod:`ckrun.checkpoint.export`
    reads and verifies the checkpoint, then replaces ``out`` atomically)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    save(user, checkpoint_id=out, no_dist=True)


def load_dcp(state: MutableMapping[str, Any], path: str) -> None:
    """Restore ``state`` in place from the DCP checkpoint directory ``path`` (a
    collective under ``torch.distributed``: every rank calls it).

    Raises:
        ConfigError: ``path`` is not a DCP checkpoint (no ``.metadata``).
        CheckpointError: the checkpoint does not fit ``state`` (as ``load_state_dict``).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ConfigError(f"{path} is not a torch.distributed.checkpoint directory (no .metadata)")
    meta = FileSystemReader(path).read_metadata()
    want = reshard.targets(state)
    DTensor = dtensor_type()  # noqa: N806
    flat: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    for fqn, md in meta.state_dict_metadata.items():
        path_ = tuple((meta.planner_data or {}).get(fqn, tuple(fqn.split("."))))
        paths[fqn] = path_
        if not isinstance(md, TensorStorageMetadata):
            flat[fqn] = None  # bytes: DCP replaces the value
            continue
        target = reshard.target_for(want, "user." + ".".join(map(str, path_)))
        shape = list(md.size)
        if DTensor is not None and isinstance(target, DTensor) and list(target.shape) == shape:
            _, lengths, _ = dtensor_box(target)
            local = torch.empty(lengths, dtype=md.properties.dtype)
            flat[fqn] = DTensor.from_local(
                local, target.device_mesh, target.placements, run_check=False,
                shape=target.shape, stride=target.stride(),
            )  # fmt: skip
        else:
            flat[fqn] = torch.empty(shape, dtype=md.properties.dtype)
    no_dist = not (dist.is_available() and dist.is_initialized())
    load(flat, checkpoint_id=path, no_dist=no_dist)
    user: dict[Any, Any] = {}
    for fqn, value in flat.items():
        node = user
        *parents, leaf = paths[fqn]
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    _lists_back(user)
    restore(state, {"version": TREE_VERSION, "user": user, "rng": None}, where=f"DCP {path}")


def _lists_back(node: dict[Any, Any]) -> None:
    """Undo DCP's flattening where it lost types: ``param_groups`` (a list, indexed by
    int in the paths) becomes a list again, and an optimizer ``state`` keyed by
    parameter index (strings in the paths) is keyed by int as ``Optimizer.state_dict``
    numbers it."""
    for k, v in list(node.items()):
        if isinstance(v, dict):
            _lists_back(v)
            if k == "param_groups" and sorted(v) == list(range(len(v))):
                node[k] = [v[i] for i in range(len(v))]
            elif k == "state" and v and all(isinstance(i, str) and i.isdigit() for i in v):
                node[k] = {int(i): x for i, x in v.items()}
