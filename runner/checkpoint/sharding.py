"""Save planning of sharded and replicated state: who writes which bytes (issue 14).

Every tensor of the captured state is one of three kinds:

* **DTensor** (FSDP2 ``fully_shard``, tensor parallel): each rank writes only its local
  shard, at the global offset ``compute_local_shape_and_global_offset`` gives for its
  mesh coordinate; a shard replicated over a mesh dimension is written by coordinate 0
  of that dimension only (DCP's deduplication, ``torch.distributed.checkpoint``'s
  ``dedup_save_plans``).  ``Partial`` placements are refused (reduce them first).
* **replicated**: a plain tensor whose dtype, shape and CRC32C are equal on every rank
  (DDP's model and optimizer state): one rank writes it.  Owners are assigned greedily,
  largest tensor first to the rank with the fewest bytes so far, so the bytes written
  per checkpoint equal the state size, spread evenly over the ranks.
* **rank-local**: the RNG states, numpy arrays and any tensor that differs between ranks:
  every rank writes its own, referenced from its own tree.

Replicated and DTensor tensors are *global*: the shard's tree names them
(``{"__ckrun__": "global", "name": g}``) and the manifest's ``layout`` records their
global shape, dtype and every saved piece (rank, entry, offsets, lengths), independent
of the parallelism, like DCP's ``Metadata``.  Pieces are cut along dimension 0 to at
most :data:`PIECE_BYTES` (``CKRUN_PIECE_BYTES``): a resharded load reads at most one
piece more than it needs at each end of a range, verified by the piece's CRC32C.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import crc32c
import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import st_format
from ckrun.checkpoint.tree_names import tensor_paths as tensor_paths  # its former home
from ckrun.errors import CheckpointError
from ckrun.storage.base import ObjectWriter


class Group(Protocol):
    """The collective :func:`plan` needs (:class:`ckrun.checkpoint.collective.Group`)."""

    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank, on every rank."""
        ...


TAG = fmt.TAG
PIECE_BYTES = 16 << 20
LAYOUT_VERSION = 1


def piece_bytes() -> int:
    """Largest piece in bytes: ``CKRUN_PIECE_BYTES`` or :data:`PIECE_BYTES`."""
    raw = os.environ.get("CKRUN_PIECE_BYTES", "")
    try:
        v = int(raw) if raw else PIECE_BYTES
    except ValueError:
        v = 0
    if v < 1:
        raise CheckpointError(f"CKRUN_PIECE_BYTES={raw!r}: expected a number of bytes >= 1")
    return v


@dataclass
class Planned(fmt.Snapshot):
    """A snapshot cut into this rank's shard entries (module docstring).

    Attributes (besides :class:`~ckrun.checkpoint.shard.Snapshot`'s, whose ``tensors``
    are the entries to write):
        names: entry names, one per tensor.
        pieces: ``[global name, entry name, offsets, lengths]`` of the pieces written.
        globals: global name → ``[dtype, shape]``.
    """

    names: list[str] = field(default_factory=list)
    pieces: list[list[Any]] = field(default_factory=list)
    globals: dict[str, list[Any]] = field(default_factory=dict)
    prepared: st_format.Prepared | None = None
    layout_tensors: dict[str, Any] | None = None


@dataclass(frozen=True)
class Structure:
    """What :func:`plan` decides apart from the tensors themselves: from their paths,
    dtypes and shapes alone (and, with several ranks, which are replicated), so one rank
    reuses it for a state of the same structure (:mod:`.plan_memo`).  ``paths``:
    :func:`tensor_paths` by tensor index; ``global_of``: tensor index → owner rank (-1:
    a DTensor, every rank writes its shard; absent: rank-local); ``local_index``:
    rank-local tensor index → entry index; ``take``: per entry ``(tensor index, first
    row, end row)``, rows None for a DTensor's local shard; the rest as Planned's."""

    paths: list[str]
    global_of: dict[int, int]
    local_index: dict[int, int]
    take: list[tuple[int, int | None, int | None]]
    names: list[str]
    pieces: list[list[Any]]
    globals: dict[str, list[Any]]


def dtensor_type() -> Any:
    """The ``DTensor`` class when ``torch.distributed.tensor`` is imported, else None (a
    DTensor cannot exist before; importing it would cost a save ~1 s)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def dtensor_box(t: Any) -> tuple[list[int], list[int], bool]:
    """``(global offsets, local lengths, writes)`` of a DTensor's local shard on this
    rank; ``writes`` is False for a copy replicated over a mesh dimension at a non-zero
    coordinate (written by coordinate 0).

    Raises:
        CheckpointError: a ``Partial`` or strided-shard placement.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    coord = t.device_mesh.get_coordinate()
    writes = coord is not None
    for d, p in enumerate(t.placements):
        if p.is_partial() or type(p).__name__ == "_StridedShard":
            raise CheckpointError(
                f"a DTensor with placement {p} cannot be saved shard by shard; "
                "redistribute it to Shard/Replicate placements first"
            )
        if p.is_replicate() and coord is not None and coord[d] != 0:
            writes = False
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(offset), list(shape), writes


def _cut(
    shape: list[int], itemsize: int, offsets: list[int], limit: int
) -> list[tuple[int | None, int | None, list[int], list[int]]]:
    """A tensor of ``shape`` (at global ``offsets``) cut along dimension 0 into pieces
    <= ``limit`` bytes: ``(first row, end row, offsets, shape)`` of each piece; rows
    None for one piece that is the tensor itself (not a view of it)."""
    numel = math.prod(shape)
    if numel == 0:
        return []
    if not shape:
        return [(None, None, [], [])]
    if numel * itemsize <= limit:
        return [(None, None, list(offsets), list(shape))]
    row = max(1, numel // shape[0] * itemsize)
    rows = max(1, limit // row)
    return [
        (
            a,
            min(a + rows, shape[0]),
            [offsets[0] + a, *offsets[1:]],
            [min(rows, shape[0] - a), *shape[1:]],
        )
        for a in range(0, shape[0], rows)
    ]


def _fingerprint(t: torch.Tensor) -> int:
    c = t.detach().to("cpu").contiguous()
    return int(crc32c.crc32c(fmt.bytes_view(c))) if c.numel() else 0


def plan(snap: fmt.Snapshot, group: Group, *, limit: int | None = None) -> Planned:
    """Cut ``snap`` into this rank's entries; a collective when ``group`` has > 1 rank.

    Raises:
        CheckpointError: the ranks hold differently structured states, or a DTensor
            placement that cannot be saved shard by shard.
    """
    return materialize(snap, structure(snap, group, limit or piece_bytes()))


def structure(
    snap: fmt.Snapshot, group: Group, limit: int, paths: list[str] | None = None
) -> Structure:
    """:func:`plan`'s decisions for ``snap`` (a collective with > 1 rank; ``paths``: its
    :func:`tensor_paths` when known); raises as :func:`plan`."""
    dtensor = dtensor_type()
    names = tensor_paths(snap.tree) if paths is None else paths
    kinds: list[list[Any]] = []
    for name, t in zip(names, snap.tensors, strict=True):
        if dtensor is not None and isinstance(t, dtensor):
            kinds.append(["dtensor", str(t.dtype).removeprefix("torch."), list(t.shape)])
        elif not isinstance(t, torch.Tensor) or name.startswith("rng."):
            kinds.append(["local"])
        else:
            fp = _fingerprint(t) if group.world_size > 1 else 0
            kinds.append(["plain", str(t.dtype).removeprefix("torch."), list(t.shape), fp])
    listing = group.all_gather([names, kinds])
    for r, (n, k) in enumerate(listing):
        if n != names or [x[0] for x in k] != [x[0] for x in kinds]:
            raise CheckpointError(
                f"rank {group.rank} and rank {r} hold differently structured states "
                "(other tensors, other sharding); every rank must save the same state keys"
            )
    sizes = [0] * group.world_size
    global_of: dict[int, int] = {}  # tensor index -> owner rank (-1: DTensor, every rank)
    others = [lst[1] for lst in listing if lst[1] is not kinds]  # one rank: none
    replicated: list[tuple[int, int]] = []  # (bytes, tensor index)
    for i, k in enumerate(kinds):
        if k[0] == "dtensor":
            global_of[i] = -1
        elif k[0] == "plain" and all(o[i] == k for o in others):
            replicated.append((_bytes_of(k), i))
        else:  # rank-local
            for r, lst in enumerate(listing):
                sizes[r] += _bytes_of(lst[1][i])
    for nbytes, i in sorted(replicated, key=lambda bi: (-bi[0], names[bi[1]])):
        owner = sizes.index(min(sizes))  # the least loaded rank, the lowest on a tie
        global_of[i] = owner
        sizes[owner] += nbytes
    return _decide(snap, names, kinds, global_of, group.rank, limit)


def _bytes_of(kind: list[Any]) -> int:
    if kind[0] == "local":
        return 0
    return int(math.prod(kind[2]) * fmt.DTYPES[kind[1]].itemsize)


def _decide(
    snap: fmt.Snapshot,
    names: list[str],
    kinds: list[list[Any]],
    global_of: dict[int, int],
    rank: int,
    limit: int,
) -> Structure:
    take: list[tuple[int, int | None, int | None]] = []
    entry_names: list[str] = []
    pieces: list[list[Any]] = []
    globals_: dict[str, list[Any]] = {}
    local_index: dict[int, int] = {}
    for i, t in enumerate(snap.tensors):
        name = names[i]
        if i not in global_of:
            local_index[i] = len(take)
            take.append((i, None, None))
            entry_names.append(name)
            continue
        globals_[name] = [kinds[i][1], kinds[i][2]]
        if global_of[i] == -1:
            offsets, _, writes = dtensor_box(t)
            lengths = list(cast(Any, t).to_local().shape)
        else:
            offsets, lengths, writes = [0] * len(kinds[i][2]), kinds[i][2], global_of[i] == rank
        if not writes:
            continue
        for a, b, off, shape in _cut(lengths, fmt.DTYPES[kinds[i][1]].itemsize, offsets, limit):
            entry = name if shape == kinds[i][2] else f"{name}@{','.join(map(str, off))}"
            take.append((i, a, b))
            entry_names.append(entry)
            pieces.append([name, entry, off, shape])
    return Structure(names, global_of, local_index, take, entry_names, pieces, globals_)


def materialize(snap: fmt.Snapshot, st: Structure, **cached: Any) -> Planned:
    """The :class:`Planned` of ``snap`` under ``st`` (the tensors of ``snap`` cut as
    ``st`` says, its tree with the global tensors named); ``cached``: the header and
    layout parts kept with ``st`` (``prepared``, ``layout_tensors``).  The placeholders
    the encoder recorded (:attr:`~ckrun.checkpoint.shard.Snapshot.slots`) are replaced
    in place: ``snap``'s tree becomes the plan's, with no walk of it (a snapshot is
    planned once)."""
    tensors: list[fmt.HostArray] = []
    local: dict[int, Any] = {}  # a DTensor's local shard, made contiguous once
    for i, a, b in st.take:
        t: Any = snap.tensors[i]
        if st.global_of.get(i) == -1:
            t = local[i] if i in local else local.setdefault(i, t.to_local().contiguous())
        tensors.append(t if a is None else t[a:b])
    names, global_of, local_index = st.paths, st.global_of, st.local_index

    def placeholder(i: int, tag: str) -> dict[str, Any]:
        if i in global_of:
            return {TAG: "global", "name": names[i]}
        return {TAG: tag, "i": local_index[i]}

    def rebind(v: Any) -> Any:
        if isinstance(v, list):
            return [rebind(x) for x in v]
        if not isinstance(v, dict):
            return v
        tag = v.get(TAG)
        if tag in ("tensor", "ndarray"):
            return placeholder(int(v["i"]), tag)
        return {k: rebind(x) for k, x in v.items()}

    tree = snap.tree
    if len(snap.slots) == len(snap.tensors):
        for i, slot in enumerate(snap.slots):
            new = placeholder(i, slot[TAG])
            slot.clear()
            slot.update(new)
    else:  # a snapshot not from the encoder
        tree = rebind(tree)
    same = len(tensors) == len(snap.tensors) and all(map(operator.is_, tensors, snap.tensors))
    nbytes = snap.nbytes if same else sum(fmt.nbytes(t) for t in tensors)
    return Planned(
        tree, tensors, nbytes, names=st.names, pieces=st.pieces, globals=st.globals, **cached
    )


def restaged(p: Planned, tensors: list[Any]) -> Planned:
    """``p`` with its entries replaced by copies (host buffers of an async save)."""
    return dataclasses.replace(p, tensors=tensors)


def write_object(w: ObjectWriter, p: Planned) -> st_format.Unhashed:
    """Write ``p`` as a format-2 shard into ``w`` and commit it; on any error abort ``w``
    (nothing is left under the key) and re-raise.  Returns the committed shard unhashed:
    the caller hashes it (under the write-back) where a failure removes the shard."""
    out: st_format.Unhashed | None = None
    try:
        out = st_format.write_unhashed(w, p.tree, p.tensors, p.names, p.prepared)
        w.commit()
        return out
    except BaseException:
        if out is not None:  # its hashes will not be collected: end their thread
            out.beside.close()
        w.abort()
        raise


def layout_part(p: Planned, written: st_format.Written) -> dict[str, Any]:
    """This rank's contribution to the manifest's layout (JSON)."""
    return {
        "header_bytes": written.header_bytes,
        "header_crc": written.header_crc,
        "entries": written.entries,
        "pieces": p.pieces,
        "globals": p.globals,
    }


def merge_layout(
    parts: list[dict[str, Any]], tensors: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The manifest's ``layout`` from every rank's :func:`layout_part`, by rank, with
    ``tensors`` (their :func:`layout_tensors`) when kept from a save of the same structure
    (:class:`Planned`'s ``layout_tensors``); raises
    :class:`~ckrun.errors.CheckpointError` as :func:`layout_tensors`."""
    shards = [{k: part[k] for k in ("header_bytes", "header_crc", "entries")} for part in parts]
    if tensors is None:
        tensors = layout_tensors(parts)
    return {"version": LAYOUT_VERSION, "shards": shards, "tensors": tensors}


def layout_tensors(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The layout's global tensors (dtype, shape, pieces by rank) from every rank's
    ``pieces`` and ``globals`` (:func:`layout_part`), by rank.

    Raises:
        CheckpointError: the pieces of a tensor do not cover it exactly once (the ranks
            planned differently), or the ranks disagree on a global tensor's shape.
    """
    tensors: dict[str, dict[str, Any]] = {}
    for part in parts:
        for g, (dt, shape) in part["globals"].items():
            spec = tensors.setdefault(g, {"dtype": dt, "shape": shape, "pieces": []})
            if [spec["dtype"], spec["shape"]] != [dt, shape]:
                raise CheckpointError(f"ranks disagree on the dtype/shape of {g}")
    for r, part in enumerate(parts):
        for g, entry, off, lengths in part["pieces"]:
            tensors[g]["pieces"].append([r, entry, off, lengths])
    for g, spec in tensors.items():
        covered = sum(math.prod(p[3]) for p in spec["pieces"])
        if covered != math.prod(spec["shape"]):
            raise CheckpointError(
                f"the saved pieces of {g} cover {covered} of {math.prod(spec['shape'])} "
                "elements: the ranks did not plan the same save"
            )
    return tensors
