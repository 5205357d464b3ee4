"""The final artifacts ``ckrun check-resume`` compares, whatever wrote them (issue 15).

* a ckrun checkpoint (``Checkpointer.finalize``): the state tree as saved;
* a file set (:mod:`ckrun.checkpoint.fileset`): the files a framework or script wrote —
  a Hugging Face ``checkpoint-N/``, a Lightning ``.ckpt``, a script's own ``ckpt.pt`` —
  decoded by kind (``.safetensors`` with safetensors, torch files with
  ``torch.load(weights_only=True)`` — tensors and primitives only, no code runs — JSON
  as JSON, anything else as raw bytes) and mapped onto the run-state names the
  comparison orders and explains: data position, scheduler, model, optimizer, RNG.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from typing import Any

# file name / top-level key -> run-state name (the causal order of resume_compare.HINTS)
_HF_FILES = {
    "trainer_state.json": "user.progress",
    "scheduler.pt": "user.scheduler",
    "scaler.pt": "user.scaler",
    "optimizer.pt": "user.optimizer",
    "model.safetensors": "user.model",
    "pytorch_model.bin": "user.model",
}
# not an outcome: the arguments hold run-specific paths (output_dir)
_SKIP = {"training_args.bin"}
_KEYS = {
    "state_dict": "user.model",
    "model": "user.model",
    "optimizer_states": "user.optimizer",
    "optimizer": "user.optimizer",
    "lr_schedulers": "user.scheduler",
    "scheduler": "user.scheduler",
    "loops": "user.progress.loops",
    "epoch": "user.progress.epoch",
    "global_step": "user.progress.global_step",
    "iter_num": "user.progress.iter_num",
}
#: per-step digests (CKRUN_STEP_DIGEST=1): compared apart, to name the first diverging step
STEPS = "ckrun_steps"
# never compared: wall-clock facts that differ between any two runs
_VOLATILE = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}


def decode_file(name: str, data: Any) -> Any:
    """The content of one file (``uint8`` array) as a comparable tree."""
    import torch

    raw = bytes(memoryview(data).cast("B"))
    if name.endswith(".safetensors"):
        try:
            from safetensors.torch import load

            return dict(load(raw))
        except ImportError:
            pass
    if name.endswith(".json"):
        try:
            return _drop_volatile(json.loads(raw))
        except ValueError:
            pass
    if raw[:8] == b"CKRUNSH1":  # written by ckrun.save
        from ckrun.checkpoint.drop_in import loads

        return loads(raw, key=name)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception:  # not a torch file, or one holding objects weights_only refuses
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0)


def _drop_volatile(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _drop_volatile(x) for k, x in v.items() if k not in _VOLATILE}
    if isinstance(v, list):
        return [_drop_volatile(x) for x in v]
    return v


def _rng_name(base: str) -> str | None:
    if base.startswith("rng_state") and base.endswith(".pth"):
        return "rng." + base.removesuffix(".pth")
    return None


def file_set_tree(step: int, files: Mapping[str, Any]) -> dict[str, Any]:
    """A file set's files decoded and placed under run-state names (module docstring)."""
    out: dict[str, Any] = {"step": step}
    for name, data in files.items():
        base = os.path.basename(name)
        if base in _SKIP:
            continue
        if base == "ckrun_steps.json":
            out[STEPS] = decode_file(name, data)
            continue
        tree = decode_file(name, data)
        where = _rng_name(base) or _HF_FILES.get(base)
        if where is None and isinstance(tree, dict) and any(k in _KEYS for k in tree):
            for k, v in tree.items():  # a Lightning .ckpt or a script's own dict
                if k == "callbacks":
                    _callbacks(out, v)
                else:
                    _put(out, _KEYS.get(k) or _special(k) or f"user.{k}", v)
            continue
        _put(out, where or f"user.files.{name}", tree)
    return out


def _special(key: str) -> str | None:
    if key in ("rng", "rng_state", "rng_states"):
        return "rng"
    return None


def _callbacks(out: dict[str, Any], cbs: Any) -> None:
    """Lightning's ``callbacks`` entry: only ckrun's callback state is an outcome (others,
    e.g. ModelCheckpoint, hold run-specific paths)."""
    if not isinstance(cbs, dict):
        return
    for k, v in cbs.items():
        if "CkrunCallback" in str(k) and isinstance(v, dict):
            _put(out, "rng.lightning", v.get("rng"))
            if v.get("rng_ranks") is not None:  # several ranks: each one's RNG
                _put(out, "rng.lightning_ranks", v["rng_ranks"])
            _put(out, "user.sampler", v.get("sampler"))
            _put(out, STEPS, v.get("steps") or {})


def _put(tree: dict[str, Any], path: str, v: Any) -> None:
    parts = path.split(".")
    for p in parts[:-1]:
        tree = tree.setdefault(p, {})
    tree[parts[-1]] = v
