"""Loading a format-2 checkpoint straight into the live tensors (issue 19, "load at read
speed"), and the commit protocol that keeps a failed load from leaving a half-loaded
state in use.

Reading: every global tensor of the manifest's layout (:mod:`ckrun.checkpoint.sharding`)
whose current tensor exists with the same shape and dtype in contiguous CPU memory (model
parameters and buffers, optimizer state already initialised, plain tensors of the state)
is read straight into that tensor's memory: each saved piece is one ranged read
(``Storage.read_into``: ``preadv`` locally, a ``Range`` GET on S3) into the byte range
of the destination it covers, checked against the CRC32C the manifest records
(:mod:`ckrun.checkpoint.piece_read`: a local shard front to back, each big piece checked
beside the next read; S3 :data:`READ_DEPTH` reads in flight).  A tensor with no such
destination (the optimizer state before its first step, a dtype or shape change the
compat gate allowed, a non-contiguous view, tensors sharing memory) is read into a fresh
tensor as before; a DTensor target keeps the resharding path of
:mod:`ckrun.checkpoint.reshard`.  Optimizer state is matched by parameter name, as
:func:`ckrun.checkpoint.signature.remap_optimizer` re-keys it, so the state of parameter
``model.blocks.3.w`` lands in that parameter's own ``exp_avg`` even when the parameters
were reordered.

The bytes of a fresh tensor are verified before the state sees them; those read in place
are not (that is the point: no second copy).  So an in-place load is a transaction over
the live tensors: :class:`ckrun.checkpoint.inplace_txn.Transaction` (re-exported here),
which says what happens when a piece fails its check mid-load.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.inplace_txn import Transaction
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.piece_read import READ_DEPTH, Piece, read_pieces
from ckrun.checkpoint.pipeline import CommitContext
from ckrun.checkpoint.reshard import target_for
from ckrun.checkpoint.sharding import dtensor_type, tensor_paths
from ckrun.checkpoint.state import capture, tensors_of
from ckrun.checkpoint.verify import shard_present
from ckrun.errors import CorruptCheckpoint
from ckrun.storage.base import Storage

__all__ = [
    "READ_DEPTH",
    "Transaction",
    "bulk_reader",
    "destinations",
    "live_tensors",
    "read_globals",
]

log = logging.getLogger(__name__)


# -- destinations --------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def live_tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Current name (:func:`ckrun.checkpoint.sharding.tensor_paths`) → the live tensor
    whose own memory can receive a checkpoint's bytes: dense, contiguous, on the CPU, not
    a DTensor, not empty, and not overlapping another one (tied weights, views of one
    flat buffer: the first name keeps it, the others get fresh tensors)."""
    tree = capture(state, rng=False)
    dtensor = dtensor_type()
    own = {
        t.data_ptr()
        for t in tensors_of(tree)
        if t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel()
        and (dtensor is None or not isinstance(t, dtensor))
    }
    snap = fmt.snapshot(tree)  # non-contiguous tensors become copies: not in ``own``
    out: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, t in zip(tensor_paths(snap.tree), snap.tensors, strict=True):
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() in own:
            spans.append((t.data_ptr(), t.data_ptr() + _nbytes(t), name))
            out[name] = t
    end = 0
    for lo, hi, name in sorted(spans):
        if lo < end:
            out.pop(name)  # overlaps a tensor already taken
        end = max(end, hi)
    return out


def _index_map(saved: list[list[str | None]] | None, cur: list[list[str | None]] | None) -> Any:
    """Current flat parameter index → saved flat index, by parameter name (as
    :func:`ckrun.checkpoint.signature.remap_optimizer`), or None: positional."""
    if not saved or not cur:
        return None
    fs = [n for g in saved for n in g]
    fc = [n for g in cur for n in g]
    if None in fs or None in fc or len(set(fs)) != len(fs) or fs == fc:
        return None
    at = {n: j for j, n in enumerate(fs)}
    return {k: at.get(n) for k, n in enumerate(fc)}


def destinations(
    state: Mapping[str, Any], m: Manifest, current_signature: Mapping[str, Any] | None
) -> dict[str, torch.Tensor]:
    """Saved global tensor name of ``m`` → the live tensor it is read into in place
    (same shape, dtype; see :func:`live_tensors`).  Optimizer state names are
    translated from the current parameter order to the saved one by parameter name
    (the manifest's and the current signature's ``optimizers``)."""
    if m.tensor_layout is None:
        return {}
    specs: Mapping[str, Any] = m.tensor_layout.get("tensors", {})
    saved_opt = (m.signature or {}).get("optimizers") or {}
    cur_opt = (current_signature or {}).get("optimizers") or {}
    maps = {p: _index_map(saved_opt.get(p), cur_opt.get(p)) for p in cur_opt}
    out: dict[str, torch.Tensor] = {}
    for name, t in live_tensors(state).items():
        saved_name = _saved_name(name, maps)
        if saved_name is None or saved_name in out or saved_name not in specs:
            continue
        spec = specs[saved_name]
        dtype = fmt.DTYPES.get(spec.get("dtype", ""))
        if dtype == t.dtype and list(spec.get("shape", ())) == list(t.shape):
            out[saved_name] = t
    return out


def _saved_name(name: str, maps: Mapping[str, Any]) -> str | None:
    """The saved name of current tensor ``name`` (``user.<opt>.state.<k>.<key>`` with
    ``k`` re-keyed by parameter name), or None when the checkpoint has no state for it."""
    for path, mp in maps.items():
        prefix = f"user.{path}.state."
        if mp is None or not name.startswith(prefix):
            continue
        idx, _, rest = name[len(prefix) :].partition(".")
        if not idx.isdigit():
            return name
        j = mp.get(int(idx))
        return None if j is None else f"{prefix}{j}.{rest}" if rest else f"{prefix}{j}"
    return name


# -- reading ---------------------------------------------------------------------------


def read_globals(
    storage: Storage,
    m: Manifest,
    *,
    into: Mapping[str, torch.Tensor],
    skip: Callable[[str], bool],
    written: MutableMapping[int, tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Every global tensor of ``m`` (but those ``skip`` names), read and verified piece
    by piece: into ``into[name]`` in place when given, else into a fresh tensor.

    Args:
        into: saved name → live destination (:func:`destinations`).
        skip: names left to the resharding path (DTensor targets).
        written: filled with ``data_ptr → (name, tensor)`` of each live destination
            before its first byte is written (the transaction record, module docstring).

    Returns:
        Name → tensor holding its verified bytes (the destination itself when in place).

    Raises:
        CorruptCheckpoint: a missing or truncated shard, a CRC32C mismatch of a piece, a
            layout that does not cover a tensor (the message names the key and tensor).
        StorageError: the storage failed otherwise.
    """
    lay = m.tensor_layout
    assert lay is not None
    keys = {s.rank: s for s in m.shards}
    out: dict[str, torch.Tensor] = {}
    jobs: list[Piece] = []
    for name, spec in lay["tensors"].items():
        if skip(name):
            continue
        dtype = fmt.DTYPES.get(spec["dtype"])
        if dtype is None:
            raise CorruptCheckpoint(f"{m.key}: unknown dtype of {name}", key=m.key, step=m.step)
        shape = list(spec["shape"])
        dest = into.get(name)
        inplace = dest is not None
        if dest is None:
            dest = torch.empty(shape, dtype=dtype)
        out[name] = dest
        jobs += _jobs(m, keys, name, spec, dest, inplace, lay)
    for rank in sorted({r for r in keys if any(j.key == keys[r].key for j in jobs)}):
        shard_present(storage, keys[rank], m.step)
    jobs.sort(key=lambda j: (j.key, j.begin))

    def mark(p: Piece) -> None:
        if p.inplace and p.dest.data_ptr() not in written:
            written[p.dest.data_ptr()] = (p.name, p.dest)

    read_pieces(storage, m, jobs, mark)
    return out


def _jobs(
    m: Manifest,
    keys: Mapping[int, Any],
    name: str,
    spec: Mapping[str, Any],
    dest: torch.Tensor,
    inplace: bool,
    lay: Mapping[str, Any],
) -> list[Piece]:
    shape = list(spec["shape"])
    flat = fmt.bytes_view(dest) if dest.numel() else memoryview(b"")
    row = (math.prod(shape[1:]) if shape else 1) * dest.element_size()
    jobs, covered = [], 0
    for rank, entry, po, pl in spec["pieces"]:
        if rank not in keys:
            raise CorruptCheckpoint(f"{m.key}: {name} names rank {rank}", key=m.key, step=m.step)
        b, e, crc = lay["shards"][rank]["entries"][entry]
        n = math.prod(pl) * dest.element_size()
        if e - b != n or len(po) != len(shape) or len(pl) != len(shape):
            raise CorruptCheckpoint(
                f"{keys[rank].key}: entry {entry} is {e - b} bytes, expected {n}",
                key=keys[rank].key,
                step=m.step,
            )
        covered += math.prod(pl)
        key = keys[rank].key
        if not shape or (list(pl[1:]) == shape[1:] and not any(po[1:])):
            lo = (po[0] if shape else 0) * row
            if lo + n > len(flat):
                raise CorruptCheckpoint(f"{key}: piece {entry} outside {name}", key=key)
            jobs.append(Piece(key, b, flat[lo : lo + n], crc, entry, name, dest, inplace))
        else:  # a box of other dimensions: read whole, verify, then copy into place
            piece = torch.empty(pl, dtype=dest.dtype)
            box = dest[tuple(slice(o, o + k) for o, k in zip(po, pl, strict=True))]
            jobs.append(
                Piece(key, b, fmt.bytes_view(piece), crc, entry, name, dest, inplace, box, piece)
            )
    if covered != math.prod(shape):
        raise CorruptCheckpoint(
            f"{m.key}: the pieces of {name} cover {covered} of the {math.prod(shape)} "
            "elements needed",
            key=m.key,
            step=m.step,
        )
    return jobs


def bulk_reader(
    ctx: CommitContext,
    state: Mapping[str, Any],
    m: Manifest,
    want: Mapping[str, Any],
    written: MutableMapping[int, tuple[str, torch.Tensor]],
) -> Callable[[], Mapping[str, Any]] | None:
    """The ``bulk`` step of :func:`ckrun.checkpoint.reshard.load_tree` for ``m``: its
    global tensors read in place where possible (:func:`read_globals`); None when ``m``
    is format 1 or was saved on another world size (the resharding path then reads
    every tensor into fresh memory and verifies it before the state sees it)."""
    if m.tensor_layout is None or m.world_size != ctx.world_size:
        return None
    into = destinations(state, m, ctx.signature)
    dtensor = dtensor_type()

    def skip(name: str) -> bool:
        return dtensor is not None and isinstance(target_for(want, name), dtensor)

    def bulk() -> Mapping[str, Any]:
        out = read_globals(ctx.storage, m, into=into, skip=skip, written=written)
        inplace = sum(_nbytes(t) for t in into.values())
        log.info(
            "checkpoint step %d: %d of %d tensors (%d bytes) read in place",
            m.step,
            len(into),
            len(out),
            inplace,
        )
        return out

    return bulk
