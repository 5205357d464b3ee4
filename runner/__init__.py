"""ckrun: keep long ML training runs alive on preemptible capacity.

The public API (users' training scripts rely on these names)::

    import ckrun
    ckpt = ckrun.Checkpointer(storage="runs/demo", compat={...}, keep_last=3)
    ckpt = ckrun.Checkpointer.from_env(compat={...})      # under the supervisor
    manifest = ckpt.load(state)                            # None when nothing to resume
    ckpt.save(step, state); ckpt.finalize(step, state)
    ckrun.load_weights("runs/demo", model)                 # read-only, for evaluation
    handle = ckpt.async_save(step, state)   # returns after the host snapshot; ckpt.wait()
    ckpt.async_save(step, state, lazy=True)  # copies during the next step (opt-in)
    ckpt = ckrun.Checkpointer(..., checkpoint_every="auto"); ckpt.should_save(step)
    if ckrun.preemption_requested(sync=True): ...   # sync: all ranks agree (MAX)
    ckrun.save({"model": model, **ckrun.live(globals(), "iter_num")}, "out/ckpt.pt")
    ckrun.load("out/ckpt.pt", into=state)   # torch.save/torch.load drop-in, no pickle

Heavy dependencies (torch, boto3, kubernetes, submitit) are imported lazily, so
``import ckrun`` and the supervisor start without torch.
"""

from __future__ import annotations

# ruff: noqa: E402  (the imports below follow the hold on purpose)
from ckrun import notice_hold

# First, before ~0.1 s of imports: `ckrun run` must not die of a notice that comes while
# it starts; the supervisor's signal inbox takes what was held (ckrun.notice_hold).
notice_hold.hold_if_supervisor()

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
from ckrun.version import __version__ as __version__

# name -> (module, attribute) that defines it; imported on first attribute access.
_LAZY = {
    "Checkpointer": ("ckrun.checkpoint.checkpointer", "Checkpointer"),
    "Manifest": ("ckrun.checkpoint.manifest", "Manifest"),
    "ResumableSampler": ("ckrun.checkpoint.sampler", "ResumableSampler"),
    "ResumableDataLoader": ("ckrun.checkpoint.sampler", "ResumableDataLoader"),
    "SaveHandle": ("ckrun.checkpoint.pipeline", "SaveHandle"),
    "load_weights": ("ckrun.checkpoint.weights", "load_weights"),
    # the run's storage as the environment configures it (CKRUN_LOCAL_TIER: two tiers)
    "open_storage": ("ckrun.checkpoint.env", "open_storage_from_env"),
    "save": ("ckrun.checkpoint.drop_in", "save"),
    "load": ("ckrun.checkpoint.drop_in", "load"),
    "live": ("ckrun.checkpoint.drop_in", "live"),
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
    "live",
    "load",
    "load_weights",
    "open_storage",
    "preemption_requested",
    "save",
]


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'ckrun' has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0]), where[1])
    globals()[name] = value
    return value
