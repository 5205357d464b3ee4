"""``ckrun export``: a run's consolidated model (and optimizer) state for other tools.

Formats live in a registry (:data:`FORMATS`, :func:`register`): each is a function
``(source, out_path) -> None`` given an :class:`ExportSource` (the manifest, the storage
and the verified run state, read once).  Built in:

* ``safetensors``: the model's state dict (``blocks.0.weight`` → tensor) in one
  ``.safetensors`` file (needs ``pip install 'ckrun[export]'``); with the optimizer,
  its per-parameter tensors go under ``optimizer.state.<parameter name>.<field>`` and
  the rest (param groups, non-tensor values) as JSON in the file's metadata
  (``optimizer``), the run's step and kind under ``ckrun.step``/``ckrun.kind``;
* ``torch``: ``torch.save`` of the model's state dict, or of ``{"model": ...,
  "optimizer": ...}`` with the optimizer; tensors and primitives only, so
  ``torch.load(path, weights_only=True)`` reads it.

The optimizer state is keyed by parameter name (``model.blocks.0.weight``) when the
checkpoint recorded the names (:mod:`ckrun.checkpoint.signature`), else by torch's
positional ids.  Another format (e.g. torch.distributed.checkpoint) registers itself
with :func:`register` and reads what it needs from the source.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.weights import entry, module_key, open_run, read_state
from ckrun.errors import CheckpointError, ConfigError, UsageError
from ckrun.storage.base import Storage


@dataclass
class ExportSource:
    """What an exporter reads.

    Attributes:
        storage: the run root.
        manifest: the checkpoint exported.
        user: its verified user state (``{"model": {...}, "optimizer": {...}, ...}``).
        model_key: the entry holding the model.
        optimizer_key: the entry holding the optimizer to export, or None.
    """

    storage: Storage
    manifest: Manifest
    user: dict[str, Any]
    model_key: str
    optimizer_key: str | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict (name → tensor)."""
        sd = entry(self.user, self.model_key)
        return {str(k): v for k, v in sd.items() if isinstance(v, torch.Tensor)}

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer state dict with ``state`` keyed by parameter name (when the
        checkpoint recorded names) and each param group's ``param_names``; None without
        an optimizer to export."""
        if self.optimizer_key is None:
            return None
        sd = entry(self.user, self.optimizer_key)
        names = ((self.manifest.signature or {}).get("optimizers") or {}).get(self.optimizer_key)
        groups = [dict(g) for g in sd.get("param_groups", [])]
        state = dict(sd.get("state", {}))
        if not names or len(names) != len(groups):
            return {"state": state, "param_groups": groups}
        by_id: dict[Any, str] = {}
        for g, gnames in zip(groups, names, strict=True):
            by_id.update(
                {pid: n for pid, n in zip(g["params"], gnames, strict=False) if n is not None}
            )
            g["param_names"] = list(gnames)
        return {
            "state": {by_id.get(pid, str(pid)): v for pid, v in state.items()},
            "param_groups": groups,
        }


Exporter = Callable[[ExportSource, str], None]
FORMATS: dict[str, Exporter] = {}


def register(name: str, fn: Exporter) -> None:
    """Add (or replace) the export format ``name``."""
    FORMATS[name] = fn


def _optimizer_key(user: Mapping[str, Any], m: Manifest) -> str | None:
    recorded = list(((m.signature or {}).get("optimizers") or {}).keys())
    if len(recorded) == 1:
        return str(recorded[0])
    if isinstance(user.get("optimizer"), Mapping):
        return "optimizer"
    raise CheckpointError(
        f"checkpoint step {m.step}: no single optimizer entry to export "
        f"(recorded: {recorded or 'none'}); export without --optimizer"
    )


def export(
    path_or_run: str | Storage,
    out: str,
    *,
    format: str,  # noqa: A002 - the CLI's --format
    step: int | None = None,
    key: str | None = None,
    optimizer: bool = False,
) -> Manifest:
    """Write the consolidated state of a run's checkpoint to ``out`` in ``format``.

    Args:
        path_or_run: the run root (path, ``s3://`` URL or Storage).
        out: output file path (its directory is created; replaced atomically).
        format: a name in :data:`FORMATS`.
        step: the checkpoint step; None: the newest committed (final when finished).
        key: the model's run-state entry (default as :func:`ckrun.load_weights`).
        optimizer: also export the optimizer state.

    Returns:
        The manifest exported.

    Raises:
        ConfigError: unknown format (names the known ones) or a missing extra.
        UsageError: no committed checkpoint (at ``step``).
        CorruptCheckpoint: the checkpoint is damaged.
        CheckpointError: no model (or optimizer) entry.
    """
    fn = FORMATS.get(format)
    if fn is None:
        raise ConfigError(f"unknown export format {format!r}; use one of {sorted(FORMATS)}")
    is_dir = format in DIRECTORY_FORMATS
    if is_dir and os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"{out} exists and is not an empty directory; choose a new -o path")
    storage = open_run(path_or_run)
    m, user = read_state(storage, step)
    src = ExportSource(storage, m, user, module_key(m, user, key))
    if optimizer:
        src.optimizer_key = _optimizer_key(user, m)
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(out)}.ckrun-tmp-{os.getpid()}")
    try:
        fn(src, tmp)
        for path in _files(tmp) if is_dir else [tmp]:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, out)  # a directory replaces a missing or empty one
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        elif os.path.exists(tmp):
            os.unlink(tmp)
    return m


def _files(d: str) -> list[str]:
    return [os.path.join(r, n) for r, _, names in os.walk(d) for n in names]


def _plain(v: Any) -> Any:
    """JSON form of a non-tensor value (tensors of one element become numbers)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


def _safetensors(src: ExportSource, out: str) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ConfigError(
            "--format safetensors needs the safetensors package: pip install 'ckrun[export]'"
        ) from e
    tensors = {k: v.contiguous() for k, v in src.model_state().items()}
    meta = {"ckrun.step": str(src.manifest.step), "ckrun.kind": src.manifest.kind}
    opt = src.optimizer_state()
    if opt is not None:
        rest: dict[str, Any] = {"param_groups": _plain(opt["param_groups"]), "state": {}}
        for name, fields in opt["state"].items():
            for f, v in fields.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    tensors[f"optimizer.state.{name}.{f}"] = v.contiguous()
                else:
                    rest["state"].setdefault(str(name), {})[f] = _plain(v)
        meta["optimizer"] = json.dumps(rest, sort_keys=True)
    save_file(tensors, out, metadata=meta)


def _torch(src: ExportSource, out: str) -> None:
    model = src.model_state()
    opt = src.optimizer_state()
    torch.save(model if opt is None else {"model": model, "optimizer": opt}, out)


def _dcp(src: ExportSource, out: str) -> None:
    from ckrun.checkpoint.dcp_interop import write_dcp

    write_dcp(src.user, out)


register("safetensors", _safetensors)
register("torch", _torch)
register("dcp", _dcp)  # a directory (torch.distributed.checkpoint), issue 14
#: formats whose output is a directory (``out`` must not exist or be empty)
DIRECTORY_FORMATS = frozenset({"dcp"})
