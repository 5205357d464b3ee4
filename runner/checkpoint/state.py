"""Run state capture and restore (DESIGN.md §3, "Run state").

The user's state is a mapping such as ``{"model": model, "optimizer": opt, "scheduler":
sched, "scaler": scaler, "sampler": sampler, "extra": {"epoch": 3}}``.  Values with
``state_dict()``/``load_state_dict()`` are saved through them; tensors, numpy arrays and
primitives as they are; nested dicts recursively.  The RNG state of Python ``random``,
numpy's global generator (when numpy is imported), torch CPU and every initialised CUDA
device is captured next to it and restored last, so the first random draw after
``load`` equals the one an uninterrupted run would make.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from ckrun.errors import CheckpointError

log = logging.getLogger(__name__)

TREE_VERSION = 1


def _has_state_dict(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(
        getattr(v, "load_state_dict", None)
    )


def _capture_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if _has_state_dict(v) and not isinstance(v, Mapping):
        return v.state_dict()
    if isinstance(v, Mapping):
        return {k: _capture_value(x) for k, x in v.items()}
    return v


def capture(state: Mapping[str, Any], *, rng: bool = True) -> dict[str, Any]:
    """The tree to persist: ``{"version", "user": {...}, "rng": {...} | None}``.

    Tensors are referenced, not copied (see :func:`ckrun.checkpoint.shard.snapshot`).
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"state must be a dict of name -> object, got {type(state).__qualname__}"
        )
    return {
        "version": TREE_VERSION,
        "user": {str(k): _capture_value(v) for k, v in state.items()},
        "rng": rng_state() if rng else None,
    }


def restore(state: MutableMapping[str, Any], tree: Mapping[str, Any], *, where: str) -> None:
    """Restore ``tree`` (from :func:`capture`, loaded) into ``state`` in place.

    Objects get ``load_state_dict``, tensors ``copy_``, dicts are restored recursively,
    other entries are replaced.  Keys missing on either side are logged, not fatal.

    Raises:
        CheckpointError: a ``load_state_dict`` or tensor copy failed (names the key).
    """
    if not isinstance(tree, Mapping) or tree.get("version") != TREE_VERSION:
        raise CheckpointError(f"{where}: unknown run-state layout; upgrade ckrun")
    _restore_into(state, tree["user"], where)
    if tree.get("rng") is not None:
        set_rng_state(tree["rng"])


def _restore_into(
    state: MutableMapping[str, Any], saved: Mapping[str, Any], where: str, top: bool = True
) -> None:
    """Top level: only the keys the caller passed are restored (others logged).  Nested
    dicts (``extra``) get the checkpoint's keys added."""
    for k in state.keys() - saved.keys():
        log.warning("%s has no entry %r: it keeps its current value", where, k)
    for k in saved.keys() - state.keys():
        if top:
            log.warning("%s entry %r is not in the state passed to load(): ignored", where, k)
        else:
            state[k] = saved[k]
    for k in state.keys() & saved.keys():
        cur, new = state[k], saved[k]
        try:
            if _has_state_dict(cur) and not isinstance(cur, Mapping):
                cur.load_state_dict(new)
            elif isinstance(cur, torch.Tensor) and isinstance(new, torch.Tensor):
                with torch.no_grad():
                    cur.copy_(new)
            elif isinstance(cur, MutableMapping) and isinstance(new, Mapping):
                _restore_into(cur, new, f"{where}[{k!r}]", top=False)
            else:
                state[k] = new
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{where}: restoring {k!r} into {type(cur).__qualname__} failed: {e}; "
                "the checkpoint does not fit the current model/optimizer"
            ) from e


def rng_state() -> dict[str, Any]:
    """RNG states: python, torch CPU, numpy (if imported), CUDA (if initialised)."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(rng: Mapping[str, Any]) -> None:
    """Restore the states captured by :func:`rng_state`."""
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy

        numpy.random.set_state(tuple(rng["numpy"]))
    cuda = rng.get("cuda")
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "checkpoint holds RNG state of %d CUDA devices, this process sees "
                "%d: CUDA RNG not restored",
                len(cuda),
                torch.cuda.device_count() if torch.cuda.is_available() else 0,
            )


def state_compat(state: Mapping[str, Any]) -> dict[str, Any]:
    """Compat fields read off the state: the class names of its optimizers
    (``optimizer``) and learning-rate schedulers (``scheduler``), when it has any."""
    auto = {
        "optimizer": _class_names(state, torch.optim.Optimizer),
        "scheduler": _class_names(state, torch.optim.lr_scheduler.LRScheduler),
    }
    return {k: v for k, v in auto.items() if v is not None}


def _class_names(state: Mapping[str, Any] | None, base: type) -> str | None:
    if not state:
        return None
    names = sorted(f"{k}={type(v).__name__}" for k, v in state.items() if isinstance(v, base))
    if not names:
        return None
    return names[0].split("=", 1)[1] if len(names) == 1 else ",".join(names)
