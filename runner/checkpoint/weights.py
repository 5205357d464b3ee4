"""Read-only access to a run's checkpoints: evaluation loading and export (issue 13, item 8).

:func:`load_weights` loads a model from a committed checkpoint or the final artifact of a
run without a ``Checkpointer``: no writer lock, no compat gate, nothing written.  The
shard is verified (size, CRC32C) before anything is deserialized, as in
``Checkpointer.load``; with ``step=None`` a corrupt newest checkpoint is skipped for the
next older one (logged), with an explicit ``step`` it is an error.  A checkpoint of
several ranks is read from rank 0's shard, which holds the whole (replicated) state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ckrun.checkpoint.discovery import scan
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.shard_reader import read_shard
from ckrun.errors import (
    CheckpointError,
    CorruptCheckpoint,
    CorruptObject,
    ObjectNotFound,
    UsageError,
)
from ckrun.storage.base import Storage

log = logging.getLogger(__name__)


def open_run(path_or_run: str | Storage) -> Storage:
    """The run root ``path_or_run`` (a path, ``s3://`` URL or Storage) as a Storage."""
    if not isinstance(path_or_run, str):
        return path_or_run
    from ckrun.storage import open_storage

    return open_storage(path_or_run)


def candidates(storage: Storage, step: int | None) -> list[Manifest]:
    """Committed manifests to read, best first: all of them newest first (a final
    artifact before a recovery checkpoint of its step), or those of ``step``.

    Raises:
        UsageError: the run has no committed checkpoint (at ``step``).
    """
    ms = [m for m in scan(storage).manifests if step is None or m.step == step]
    if not ms:
        at = "" if step is None else f" at step {step}"
        raise UsageError(
            f"{storage.url}: no committed checkpoint{at}; see `ckrun ls {storage.url}`"
        )
    return ms


def read_tree(storage: Storage, m: Manifest, rank: int = 0) -> dict[str, Any]:
    """The verified state tree (``{"version", "user", "rng"}``) of ``rank``'s shard of ``m``.

    Raises:
        CorruptCheckpoint: the shard is missing, truncated or fails its checksum.
    """
    if m.tensor_layout is not None:  # format 2: global tensors span the shards
        from ckrun.checkpoint.reshard import full_state

        tree = full_state(storage, m, rank)
        if not isinstance(tree, dict) or not isinstance(tree.get("user"), dict):
            raise CorruptCheckpoint(f"{m.key}: not a ckrun run state", key=m.key, step=m.step)
        return tree
    s = next(s for s in m.shards if s.rank == rank)
    info = storage.head(s.key)
    if info is None or info.size_bytes != s.size_bytes:
        got = "missing" if info is None else f"{info.size_bytes} bytes"
        raise CorruptCheckpoint(
            f"{s.key}: {got}, manifest says {s.size_bytes} bytes", key=s.key, step=m.step
        )
    try:
        with storage.open_read(s.key) as f:
            tree = read_shard(f, size_bytes=s.size_bytes, checksum=s.checksum, key=s.key)
    except CorruptObject as e:
        raise CorruptCheckpoint(f"{s.key}: {e}", key=s.key, step=m.step) from e
    if not isinstance(tree, dict) or not isinstance(tree.get("user"), dict):
        raise CorruptCheckpoint(f"{s.key}: not a ckrun run state", key=s.key, step=m.step)
    return tree


def read_state(
    path_or_run: str | Storage, step: int | None = None
) -> tuple[Manifest, dict[str, Any]]:
    """The newest readable committed checkpoint (or that of ``step``) and its user state.

    Raises:
        UsageError: no committed checkpoint (at ``step``).
        CorruptCheckpoint: every candidate is damaged (or the one at ``step`` is).
    """
    storage = open_run(path_or_run)
    errors: list[str] = []
    for m in candidates(storage, step):
        try:
            return m, read_tree(storage, m)["user"]
        except (CorruptCheckpoint, ObjectNotFound) as e:
            if step is not None:
                raise
            log.error("checkpoint step %d is unusable (%s): trying an older one", m.step, e)
            errors.append(f"step {m.step}: {e}")
    raise CorruptCheckpoint(f"{storage.url}: no readable checkpoint ({'; '.join(errors)})")


def module_key(m: Manifest, user: Mapping[str, Any], key: str | None) -> str:
    """The state entry holding the model: ``key``, else the only module the manifest's
    signature names, else ``"model"``.

    Raises:
        CheckpointError: the entry is absent or ambiguous (names the entries to choose).
    """
    if key is None:
        mods = list(((m.signature or {}).get("modules") or {}).keys())
        key = mods[0] if len(mods) == 1 else "model"
        if len(mods) > 1 and key not in mods:
            raise CheckpointError(
                f"checkpoint step {m.step} holds several models {mods}: pass key=NAME"
            )
    node: Any = user
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping):
        entries = sorted(k for k, v in user.items() if isinstance(v, Mapping))
        raise CheckpointError(
            f"checkpoint step {m.step} has no model state under {key!r}; "
            f"its entries are {entries}: pass key=NAME"
        )
    return key


def entry(user: Mapping[str, Any], key: str) -> Any:
    """The value at the dotted ``key`` of ``user``."""
    node: Any = user
    for part in key.split("."):
        node = node[part]
    return node


def load_weights(
    path_or_run: str | Storage, model: Any, step: int | None = None, *, key: str | None = None
) -> Manifest:
    """Load ``model``'s weights from a run's checkpoint, read-only (for evaluation).

    Args:
        path_or_run: the run root (path or ``s3://`` URL) or its Storage.
        model: a ``torch.nn.Module`` (anything with ``load_state_dict``).
        step: the checkpoint step; None: the newest committed one (the final artifact
            when the run finished), skipping damaged ones.
        key: the run-state entry of the model (default: the only module the checkpoint
            recorded, else ``"model"``).

    Returns:
        The manifest loaded from.

    Raises:
        UsageError: no committed checkpoint (at ``step``).
        CorruptCheckpoint: the checkpoint (every one, for ``step=None``) is damaged.
        CheckpointError: no model entry, or ``load_state_dict`` refused it (names why).
    """
    m, user = read_state(path_or_run, step)
    k = module_key(m, user, key)
    try:
        model.load_state_dict(entry(user, k))
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint step {m.step}: loading {k!r} into {type(model).__qualname__} failed: {e}"
        ) from e
    log.info("loaded %r of checkpoint step %d (%s) read-only", k, m.step, m.kind)
    return m
