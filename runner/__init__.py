"""ckrun: keep long ML training runs alive on preemptible capacity.

The public API (users' training scripts rely on these names)::

    import ckrun
    ckpt = ckrun.Checkpointer(storage="runs/demo", compat={...}, keep_last=3)
    ckpt = ckrun.Checkpointer.from_env(compat={...})      # under the supervisor
    manifest = ckpt.load(state)                            # None when nothing to resume
    ckpt.save(step, state); ckpt.finalize(step, state)
    ckrun.load_weights("runs/demo", model)                 # read-only, for evaluation
    handle = ckpt.async_save(step, state)   # returns after the host snapshot; ckpt.wait()
    ckpt = ckrun.Checkpointer(..., checkpoint_every="auto"); ckpt.should_save(step)
    if ckrun.preemption_requested(sync=True): ...   # sync: all ranks agree (MAX)

Heavy dependencies (torch, boto3, kubernetes, submitit) are imported lazily, so
``import ckrun`` and the supervisor start without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ckrun.control import install_signal_handlers, preemption_requested
from ckrun.errors import (
    CheckpointError,
    CkrunError,
    CorruptCheckpoint,
    ExitCode,
    IncompatibleCheckpoint,
    RunComplete,
    RunLocked,
    StorageError,
    StorageFull,
)
from ckrun.notices import Notice

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY = {
    "Checkpointer": "ckrun.checkpoint.checkpointer",
    "Manifest": "ckrun.checkpoint.manifest",
    "ResumableSampler": "ckrun.checkpoint.sampler",
    "SaveHandle": "ckrun.checkpoint.checkpointer",
    "ResumableDataLoader": "ckrun.checkpoint.sampler",
    "load_weights": "ckrun.checkpoint.weights",
    "open_storage": "ckrun.storage",
}

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CkrunError",
    "CorruptCheckpoint",
    "ExitCode",
    "IncompatibleCheckpoint",
    "Manifest",
    "Notice",
    "ResumableDataLoader",
    "ResumableSampler",
    "RunComplete",
    "RunLocked",
    "SaveHandle",
    "StorageError",
    "StorageFull",
    "install_signal_handlers",
    "load_weights",
    "open_storage",
    "preemption_requested",
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ckrun' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
