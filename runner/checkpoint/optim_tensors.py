"""The optimizers of a state and the tensor storages each one's ``step()`` writes
(its parameters and its state tensors): what a lazy snapshot
(:mod:`ckrun.checkpoint.lazy_snapshot`) may copy after the call, before that optimizer's
next step.  A storage is named by ``(device, address)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["optimizers_in", "owned_storages", "storage_key"]


def optimizers_in(state: Any) -> list[torch.optim.Optimizer]:
    """The optimizers of ``state`` (top level and nested mappings/lists), each once."""
    out: dict[int, torch.optim.Optimizer] = {}

    def walk(v: Any) -> None:
        if isinstance(v, torch.optim.Optimizer):
            out.setdefault(id(v), v)
        elif isinstance(v, Mapping):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(state)
    return list(out.values())


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, storage address) of ``t``, None for an empty storage."""
    ptr = int(t.untyped_storage().data_ptr())
    return None if ptr == 0 else (str(t.device), ptr)


def owned_storages(opt: torch.optim.Optimizer) -> Iterator[tuple[str, int]]:
    """Storages ``opt.step()`` may write: its parameters and its state tensors."""
    for group in opt.param_groups:
        for p in group["params"]:
            if isinstance(p, torch.Tensor) and (k := storage_key(p)) is not None:
                yield k
    for st in opt.state.values():
        for v in st.values() if isinstance(st, Mapping) else ():
            if isinstance(v, torch.Tensor) and (k := storage_key(v)) is not None:
                yield k
