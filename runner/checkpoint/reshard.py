"""Loading a format-2 checkpoint on any layout with ranged reads (issue 14).

The manifest's ``tensor_layout`` (:mod:`ckrun.checkpoint.sharding`) gives every global
tensor's dtype, shape and saved pieces.  A rank loads:

1. the header of its source shard (its own on the same world size, else rank 0's, as
   :func:`ckrun.checkpoint.collective.source_rank`), one ranged read, verified by the
   CRC32C the manifest records for it; its tree holds the rank-local state (RNG, data
   position) and names the global tensors;
2. each rank-local entry the tree references (ranged read, entry CRC32C);
3. each global tensor as the current state wants it (:func:`targets`): for a ``DTensor``
   (FSDP2 / tensor parallel) only the box of its local shard
   (``compute_local_shape_and_global_offset`` of the *current* mesh and placements),
   wrapped back with ``DTensor.from_local``; for an optimizer state that does not exist
   yet, the layout of its parameter; otherwise the whole tensor.  The pieces
   overlapping the box are read with ranged reads (``Storage.read_into``: ``preadv``
   locally, ``Range`` GETs on S3), each verified by its CRC32C before its bytes are used.

The result is the same tree :func:`ckrun.checkpoint.state.restore` takes for a format-1
shard, so model and optimizer ``load_state_dict`` receive DTensors of their own layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import st_format
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.shard_reader import decode_tree
from ckrun.checkpoint.sharding import dtensor_box, dtensor_type, tensor_paths
from ckrun.checkpoint.state import capture
from ckrun.errors import CheckpointError, CorruptCheckpoint, ObjectNotFound
from ckrun.storage.base import Storage

READ_THREADS = 4


def targets(state: Mapping[str, Any] | None) -> dict[str, Any]:
    """Global tensor name → the current tensor (or optimizer parameter) it loads into.

    Names are those :func:`ckrun.checkpoint.sharding.tensor_paths` gives the saved tree;
    an optimizer state with no value yet (before the first step) maps to its parameter
    under ``user.<key>.state.<index>`` (parameter order of ``param_groups``, as
    ``Optimizer.state_dict`` numbers them).
    """
    if not state:
        return {}
    snap = fmt.snapshot(capture(state, rng=False))
    out: dict[str, Any] = dict(zip(tensor_paths(snap.tree), snap.tensors, strict=True))
    for k, v in state.items():
        if isinstance(v, torch.optim.Optimizer):
            params = [p for g in v.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                out.setdefault(f"user.{k}.state.{i}", p)
    return out


def target_for(want: Mapping[str, Any], name: str) -> Any:
    """The current tensor that global tensor ``name`` loads into: its own entry of
    :func:`targets`, else (an optimizer state not created yet) its parameter's."""
    t = want.get(name)
    return t if t is not None else want.get(name.rsplit(".", 1)[0])


class _Reader:
    """Verified ranged reads of one manifest's shards."""

    def __init__(self, storage: Storage, m: Manifest):
        self.storage, self.m = storage, m
        assert m.tensor_layout is not None
        self.lay = m.tensor_layout
        self.keys = {s.rank: s for s in m.shards}
        self._checked: set[int] = set()

    def _check(self, rank: int) -> None:
        if rank in self._checked:
            return
        s = self.keys[rank]
        info = self.storage.head(s.key)
        if info is None or info.size_bytes != s.size_bytes:
            got = "missing" if info is None else f"{info.size_bytes} bytes"
            raise CorruptCheckpoint(
                f"{s.key}: {got}, manifest says {s.size_bytes} bytes (truncated)",
                key=s.key,
                step=self.m.step,
            )
        self._checked.add(rank)

    def read(self, rank: int, begin: int, buf: memoryview, crc: str, what: str) -> None:
        self._check(rank)
        key = self.keys[rank].key
        try:
            self.storage.read_into(key, begin, buf)
        except ObjectNotFound as e:
            raise CorruptCheckpoint(f"{key}: missing ({e})", key=key, step=self.m.step) from e
        got = f"crc32c:{crc32c.crc32c(buf):08x}" if len(buf) else "crc32c:00000000"
        if got != crc:
            raise CorruptCheckpoint(
                f"{key}: checksum mismatch in {what} (CRC32C mismatch: manifest {crc}, read {got})",
                key=key,
                step=self.m.step,
            )

    def entry(self, rank: int, name: str, out: fmt.HostArray) -> None:
        b, e, crc = self.lay["shards"][rank]["entries"][name]
        if e - b != fmt.nbytes(out):
            raise CorruptCheckpoint(
                f"{self.keys[rank].key}: entry {name} is {e - b} bytes, expected {fmt.nbytes(out)}",
                key=self.keys[rank].key,
            )
        self.read(rank, b, fmt.bytes_view(out), crc, name)

    def header(self, rank: int) -> st_format.Header:
        s = self.lay["shards"][rank]
        buf = bytearray(s["header_bytes"])
        self.read(rank, 0, memoryview(buf), s["header_crc"], "the header")
        return st_format.parse_header(bytes(buf), self.keys[rank].key)

    def region(self, name: str, offsets: list[int], lengths: list[int]) -> torch.Tensor:
        """The box ``[offsets, offsets + lengths)`` of global tensor ``name``."""
        spec = self.lay["tensors"][name]
        dtype = fmt.DTYPES.get(spec["dtype"])
        if dtype is None:
            raise CorruptCheckpoint(f"{self.m.key}: unknown dtype of {name}", key=self.m.key)
        out = torch.empty(lengths, dtype=dtype)
        jobs = []
        for rank, entry, po, pl in spec["pieces"]:
            lo = [max(a, b) for a, b in zip(po, offsets, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(po, pl, offsets, lengths, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            jobs.append((rank, entry, po, pl, lo, hi))
        covered = sum(math.prod(h - low for low, h in zip(j[4], j[5], strict=True)) for j in jobs)
        if covered != math.prod(lengths):
            raise CorruptCheckpoint(
                f"{self.m.key}: the pieces of {name} cover {covered} of the "
                f"{math.prod(lengths)} elements needed",
                key=self.m.key,
            )

        def one(job: tuple[Any, ...]) -> None:
            rank, entry, po, pl, lo, hi = job
            dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets, strict=True))
            view = out[dst]
            if lo == po and [h - low for low, h in zip(lo, hi, strict=True)] == pl:
                if view.is_contiguous():  # the whole piece lands in place: no copy
                    self.entry(rank, entry, view)
                    return
            piece = torch.empty(pl, dtype=dtype)
            self.entry(rank, entry, piece)
            src = tuple(slice(low - p, h - p) for low, h, p in zip(lo, hi, po, strict=True))
            view.copy_(piece[src])

        if len(jobs) > 1:
            with ThreadPoolExecutor(min(READ_THREADS, len(jobs))) as pool:
                list(pool.map(one, jobs))
        elif jobs:
            one(jobs[0])
        return out


def _global(reader: _Reader, name: str, target: Any) -> Any:
    spec = reader.lay["tensors"].get(name)
    if spec is None:
        raise CorruptCheckpoint(f"{reader.m.key}: tree names {name}, layout does not")
    shape = list(spec["shape"])
    DTensor = dtensor_type()  # noqa: N806
    if DTensor is not None and isinstance(target, DTensor) and list(target.shape) == shape:
        offsets, lengths, _ = dtensor_box(target)
        local = reader.region(name, offsets, lengths)
        local = local.to(target.to_local().device)
        return DTensor.from_local(
            local,
            target.device_mesh,
            target.placements,
            run_check=False,
            shape=target.shape,
            stride=target.stride(),
        )
    full = reader.region(name, [0] * len(shape), shape)
    if isinstance(target, torch.Tensor) and target.device.type != "cpu":
        full = full.to(target.device)
    return full


def load_tree(
    storage: Storage,
    m: Manifest,
    *,
    source_rank: int,
    want: Mapping[str, Any],
    bulk: Callable[[], Mapping[str, Any]] | None = None,
) -> Any:
    """The state tree of format-2 checkpoint ``m`` for this rank (module docstring).

    Args:
        source_rank: the shard whose rank-local state and tree this rank takes.
        want: :func:`targets` of the state being restored (``{}``: whole tensors).
        bulk: called once the header and the rank-local entries are verified; returns
            global tensors already read and verified, by name
            (:func:`ckrun.checkpoint.inplace_load.read_globals`); the others are read
            here.

    Raises:
        CorruptCheckpoint: a missing or truncated shard, a checksum mismatch of a byte
            range read, a layout that does not cover a tensor.
        CheckpointError: a DTensor target whose placement cannot be loaded shard-wise.
    """
    reader = _Reader(storage, m)
    key = reader.keys[source_rank].key
    h = reader.header(source_rank)
    used = _local_indices(h.tree)
    tensors: list[Any] = []
    for i, e in enumerate(h.entries):
        if i in used:
            t = st_format.alloc(e)
            reader.entry(source_rank, e["name"], t)
            tensors.append(t)
        else:
            tensors.append(None)
    pre = bulk() if bulk is not None else {}
    return decode_tree(
        h.tree,
        tensors,
        key,
        resolve_global=lambda g: pre[g] if g in pre else _global(reader, g, target_for(want, g)),
    )


def _local_indices(tree: Any) -> set[int]:
    out: set[int] = set()

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if v.get(fmt.TAG) in ("tensor", "ndarray") and isinstance(v.get("i"), int):
                out.add(v["i"])
            else:
                for x in v.values():
                    walk(x)

    walk(tree)
    return out


def full_state(storage: Storage, m: Manifest, rank: int) -> Any:
    """Rank ``rank``'s tree of ``m`` with every global tensor whole (tools, export).

    Raises:
        CheckpointError: ``m`` is a format-1 checkpoint (read its shards directly).
    """
    if m.tensor_layout is None:
        raise CheckpointError(f"{m.key}: a format-1 checkpoint has no tensor layout")
    return load_tree(storage, m, source_rank=rank, want={})
