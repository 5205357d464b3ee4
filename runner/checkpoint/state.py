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

import array
import logging
import random
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch
from ckrun.errors import CheckpointError

log = logging.getLogger(__name__)

TREE_VERSION = 1


def _has_state_dict(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(
        getattr(v, "load_state_dict", None)
    )


def capture_value(v: Any) -> Any:
    """One state entry as saved: tensors detached, objects through ``state_dict()``,
    mappings recursively, anything else as it is."""
    if isinstance(v, torch.Tensor):
        return v.detach()
    if _has_state_dict(v) and not isinstance(v, Mapping):
        return v.state_dict()
    if isinstance(v, Mapping):
        return {k: capture_value(x) for k, x in v.items()}
    return v


#: Per-step digests ``{step: crc32c}`` of the state after each step, recorded when
#: ``CKRUN_STEP_DIGEST=1`` (``ckrun check-resume``), saved with every checkpoint as
#: ``ckrun_steps`` and restored with it: the comparison names the first step that differs.
STEP_DIGESTS: dict[str, str] = {}


def tree_digest(tree: Any) -> str:
    """CRC32C (``%08x``) over the tensors and primitives of ``tree`` in key order."""
    import crc32c

    crc = 0

    def walk(v: Any) -> None:
        nonlocal crc
        if isinstance(v, torch.Tensor):
            b = v.detach().cpu().contiguous().view(-1).view(torch.uint8)
            crc = crc32c.crc32c(b.numpy().data, crc)
        elif isinstance(v, Mapping):
            for k in sorted(v, key=str):
                crc = crc32c.crc32c(str(k).encode(), crc)
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            crc = crc32c.crc32c(repr(v).encode(), crc)

    walk(tree)
    return f"{crc:08x}"


def record_step(state: Mapping[str, Any]) -> None:
    """Record the digest of ``state`` as the next step's (numbering continues after a
    restore: the restored digests end at the checkpoint's step)."""
    step = max((int(s) for s in STEP_DIGESTS), default=-1) + 1
    STEP_DIGESTS[str(step)] = tree_digest(capture(state, rng=False)["user"])


def capture(state: Mapping[str, Any], *, rng: bool = True) -> dict[str, Any]:
    """The tree to persist: ``{"version", "user": {...}, "rng": {...} | None}``.

    Tensors are referenced, not copied (see :func:`ckrun.checkpoint.shard.snapshot`).
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"state must be a dict of name -> object, got {type(state).__qualname__}"
        )
    out = {
        "version": TREE_VERSION,
        "user": {str(k): capture_value(v) for k, v in state.items()},
        "rng": rng_state() if rng else None,
    }
    if STEP_DIGESTS and rng:
        out["ckrun_steps"] = dict(STEP_DIGESTS)
    return out


def tensors_of(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a captured tree (:func:`capture`; mappings, lists and tuples
    walked), in tree order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from tensors_of(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from tensors_of(v)


def restore(state: MutableMapping[str, Any], tree: Mapping[str, Any], *, where: str) -> None:
    """Restore ``tree`` (from :func:`capture`, loaded) into ``state`` in place.

    Objects get ``load_state_dict``, tensors ``copy_``, dicts are restored recursively,
    other entries are replaced.  Keys missing on either side are logged, not fatal.

    Raises:
        CheckpointError: a ``load_state_dict`` or tensor copy failed (names the key).
    """
    if not isinstance(tree, Mapping) or tree.get("version") != TREE_VERSION:
        raise CheckpointError(f"{where}: unknown run-state layout; upgrade ckrun")
    restore_into(state, tree["user"], where)
    steps = tree.get("ckrun_steps")
    if isinstance(steps, Mapping):
        STEP_DIGESTS.clear()
        STEP_DIGESTS.update({str(k): str(v) for k, v in steps.items()})
    if tree.get("rng") is not None:
        set_rng_state(tree["rng"])


def restore_into(
    state: MutableMapping[str, Any], saved: Mapping[str, Any], where: str, top: bool = True
) -> None:
    """Restore ``saved`` into ``state`` in place (see :func:`restore`).

    Top level: only the keys the caller passed are restored (others logged).  Nested
    dicts (``extra``) get the checkpoint's keys added.

    Raises:
        CheckpointError: a ``load_state_dict`` or tensor copy failed (names the key).
    """
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
                restore_into(cur, new, f"{where}[{k!r}]", top=False)
            else:
                state[k] = new
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{where}: restoring {k!r} into {type(cur).__qualname__} failed: {e}; "
                "the checkpoint does not fit the current model/optimizer"
            ) from e


def _python_rng() -> list[Any]:
    """Python ``random``'s state as ``[version, words, gauss]`` with the 625 Mersenne
    Twister words (624 state words and the position) in one int64 tensor: a single leaf
    of the saved tree.  As the tuple ``random.getstate()`` returns, every word was a tree
    node of its own, and encoding them cost about 1.5 ms per save, a quarter of a 1 MB
    checkpoint's time (issue 19, measured with cProfile).  The words go through an
    ``array`` (one C conversion) rather than ``torch.tensor(list)``, which infers each
    element's type: 49 → 20 µs hot and 750 → 290 µs right after a training step, when
    the save's code runs cache-cold (bench/README.md, "Seventeenth session")."""
    version, words, gauss = random.getstate()
    return [version, torch.frombuffer(array.array("q", words), dtype=torch.int64), gauss]


def _python_rng_tuple(py: Any) -> tuple[Any, ...]:
    """The state :func:`random.setstate` takes, from :func:`_python_rng`'s form or from
    the tuple of ints older checkpoints hold."""
    words = py[1].tolist() if isinstance(py[1], torch.Tensor) else py[1]
    return (py[0], tuple(int(w) for w in words), py[2])


def _raw_rng() -> dict[str, Any]:
    out: dict[str, Any] = {"python": _python_rng(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return out


def _fingerprint(rng: Mapping[str, Any]) -> dict[str, str]:
    """A short digest per generator (to tell which ones the run draws from)."""
    import hashlib

    out = {}
    for k, v in rng.items():
        if k == "used":
            continue
        h = hashlib.sha1(usedforsecurity=False)
        for part in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(part, torch.Tensor):
                h.update(part.numpy().tobytes())
            elif hasattr(part, "tobytes"):
                h.update(part.tobytes())
            else:
                h.update(repr(part).encode())
        out[k] = h.hexdigest()[:16]
    return out


# generators drawn from (or seeded) since this module was imported / the last restore:
# ``ckrun check-resume`` lists only these when RNG states differ (issue 15)
_BASELINE: dict[str, str] = _fingerprint(_raw_rng())
_USED: set[str] = set()


def rng_state() -> dict[str, Any]:
    """RNG states: python, torch CPU, numpy (if imported), CUDA (if initialised), and
    ``used``: the generators whose state changed since this process started (or restored
    a checkpoint), plus those a restored checkpoint listed."""
    out = _raw_rng()
    now = _fingerprint(out)
    for k, v in now.items():  # a generator first seen now (numpy imported later): baseline
        _BASELINE.setdefault(k, v)
    _USED.update(k for k, v in now.items() if _BASELINE[k] != v)
    out["used"] = sorted(_USED)
    return out


def set_rng_state(rng: Mapping[str, Any]) -> None:
    """Restore the states captured by :func:`rng_state`."""
    global _BASELINE
    random.setstate(_python_rng_tuple(rng["python"]))
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
    _USED.update(str(u) for u in rng.get("used") or ())
    _BASELINE = _fingerprint(_raw_rng())


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
