"""The ckrun shard file: a JSON header plus raw tensor bytes, CRC32C while streaming.

Layout (all integers little-endian)::

    0   magic  b"CKRUNSH1"                           8 bytes
    8   header_len                                   u64
    16  crc32c(header)                               u32
    20  reserved (0)                                 u32
    24  header: UTF-8 JSON {format, format_version, tree, tensors, data_bytes}
        zero padding up to data_offset = align_up(24 + header_len, 4096)
    data_offset  tensor bytes, each tensor at a 64-byte aligned offset, zero padded

``tree`` is the state with every tensor / ndarray replaced by ``{"__ckrun__": "tensor",
"i": n}``; ``tensors[n]`` gives ``dtype`` (from an allowlist), ``shape``, ``offset``
(relative to data_offset) and ``nbytes``.  Non-JSON values (tuples, dicts with non-str
keys, bytes, non-finite floats, ``torch.dtype``/``Size``/``device``, numpy scalars,
``OrderedDict._metadata``) are tagged the same way.  Anything else is refused at save time.

Loading (:mod:`ckrun.checkpoint.shard_reader`) never executes code: the header is JSON,
tensor bytes are read into freshly allocated tensors, and the CRC32C of the whole file
is compared before the caller sees any of it (the header carries its own CRC so a
damaged header is reported before it is parsed).  Writing is zero-copy for CPU
tensors: the file is written straight from tensor memory and hashed from the same buffers.
"""

from __future__ import annotations

import base64
import ctypes
import json
import math
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import crc32c
import torch
from ckrun.errors import CheckpointError
from ckrun.storage.base import ObjectWriter

if TYPE_CHECKING:
    import numpy as np

    HostArray = torch.Tensor | np.ndarray[Any, Any]
else:
    HostArray = Any

MAGIC = b"CKRUNSH1"
FORMAT = "ckrun.shard"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sQII")
DATA_ALIGN = 4096
TENSOR_ALIGN = 64
MAX_HEADER_BYTES = 256 << 20
TAG = "__ckrun__"

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


@dataclass
class Snapshot:
    """A state ready to persist: the JSON tree and the tensors it references.

    Attributes:
        tree: JSON-able structure with tensor placeholders.
        tensors: contiguous tensors (CPU, or on an accelerator: copied per tensor while
            persisting) and numpy arrays, in placeholder order.
        nbytes: total tensor bytes.
        chains: per tensor, where :func:`snapshot` found it (the forms are in
            :mod:`ckrun.checkpoint.tree_names`); its name is a function of it, so equal
            chains name the tensors alike (:mod:`.plan_memo`), compared without a walk.
        slots: per tensor, its placeholder in ``tree`` (the plan names it in place).
    """

    tree: Any
    tensors: list[HostArray]
    nbytes: int
    chains: list[Any] = field(default_factory=list, repr=False, compare=False)
    slots: list[dict[str, Any]] = field(default_factory=list, repr=False, compare=False)


class _Found:
    """:class:`Snapshot`'s ``tensors``, ``chains`` and ``slots``, as :func:`_encode` finds them."""

    __slots__ = ("chains", "slots", "tensors")

    def __init__(self) -> None:
        self.tensors: list[HostArray] = []
        self.chains: list[Any] = []
        self.slots: list[dict[str, Any]] = []

    def add(self, t: HostArray, chain: Any, tag: str) -> dict[str, Any]:
        """Record ``t`` found at ``chain``; returns its placeholder."""
        slot = {TAG: tag, "i": len(self.tensors)}
        self.tensors.append(t)
        self.chains.append(chain)
        self.slots.append(slot)
        return slot


def align_up(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def nbytes(t: HostArray) -> int:
    """Bytes of a tensor or ndarray."""
    return _nbytes(t)


def snapshot(obj: Any, *, copy: bool = False) -> Snapshot:
    """Flatten ``obj`` into a :class:`Snapshot`.

    Args:
        obj: nested dicts / lists / tuples of tensors, ndarrays and primitives.
        copy: clone tensors to host memory now (needed when the caller keeps training
            while the snapshot is persisted); False references CPU tensors in place.

    Raises:
        CheckpointError: an unsupported value (its path and type are named).
    """
    found = _Found()
    tree = _encode(obj, found, "state", copy)
    nbytes = sum(_nbytes(t) for t in found.tensors)
    return Snapshot(tree, found.tensors, nbytes, found.chains, found.slots)


def _nbytes(t: HostArray) -> int:
    if not isinstance(t, torch.Tensor):
        return int(t.nbytes)
    return t.numel() * t.element_size()


def _tag(kind: str, **kw: Any) -> dict[str, Any]:
    return {TAG: kind, **kw}


_SAVED_DTYPES = frozenset(DTYPES.values())


def _where(path: Any) -> str:
    """The dotted path of a value (``state.user.model[2]``) from the chain the encoder
    passes down (:attr:`Snapshot.chains`' form): built only for an error message, not for
    every value of every save."""
    parts = []
    while isinstance(path, tuple):
        path, sep, k = path
        if sep == "#":  # a non-string key (:func:`_named_by`)
            sep, k = ".", k[2] if len(k) == 3 else f"#{k[0]}"
        parts.append(f".{k}" if sep == "." else f"[{k}]" if sep == "[" else "")  # "@": a key
    return str(path) + "".join(reversed(parts))


def _encode(v: Any, found: _Found, path: Any, copy: bool) -> Any:
    if isinstance(v, torch.Tensor):  # the common leaves first (no ndarray is either)
        return _tensor(v, found, path, copy)
    if isinstance(v, dict) or isinstance(v, Mapping):
        return _mapping(v, found, path, copy)
    np = sys.modules.get("numpy")  # an ndarray exists only if numpy was imported
    if np is not None and isinstance(v, (np.ndarray, np.generic)):
        return _numpy_value(v, found, path, copy)
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else _tag("float", v=repr(v))
    if isinstance(v, list):
        return [_encode(x, found, (path, "[", i), copy) for i, x in enumerate(v)]
    if isinstance(v, torch.Size):
        return _tag("size", v=list(v))
    if isinstance(v, tuple):
        items = [_encode(x, found, (path, "[", i), copy) for i, x in enumerate(v)]
        return _tag("tuple", items=items)
    if isinstance(v, (bytes, bytearray)):
        return _tag("bytes", b64=base64.b64encode(bytes(v)).decode())
    if isinstance(v, torch.dtype):
        return _tag("dtype", v=str(v).removeprefix("torch."))
    if isinstance(v, torch.device):
        return _tag("device", v=str(v))
    raise CheckpointError(
        f"{_where(path)}: cannot checkpoint a value of type {type(v).__qualname__}; store "
        "tensors, numbers, strings, lists, tuples or dicts (or an object with state_dict())"
    )


def _numpy_value(v: Any, found: _Found, path: Any, copy: bool) -> Any:
    import numpy as np

    if isinstance(v, np.generic):
        return _tag("npscalar", dtype=v.dtype.str, v=_encode(v.item(), found, path, copy))
    if v.dtype.hasobject:
        raise CheckpointError(f"{_where(path)}: numpy arrays of Python objects cannot be saved")
    a = np.ascontiguousarray(v)
    return found.add(a.copy() if copy else a, path, "ndarray")


def _mapping(v: Mapping[Any, Any], found: _Found, path: Any, copy: bool) -> Any:
    meta = getattr(v, "_metadata", None)
    if TAG not in v and meta is None:
        if all(type(k) is str for k in v):
            return {k: _encode(x, found, (path, ".", k), copy) for k, x in v.items()}
        if all(isinstance(k, str) for k in v):  # a str subclass formats its own name
            return {
                k: _encode(x, found, (path, "#", _named_by(j, k)), copy)
                for j, (k, x) in enumerate(v.items())
            }
    items = [  # the key's position and type in the chain: they name the tensors below
        [
            _key(k, found, (path, "@", j), copy),
            _encode(x, found, (path, "#", _named_by(j, k)), copy),
        ]
        for j, (k, x) in enumerate(v.items())
    ]
    if meta is not None:
        return _tag("odict", items=items, meta=_key(meta, found, (path, "@", "meta"), copy))
    return _tag("dict", items=items)


def _key(k: Any, found: _Found, path: Any, copy: bool) -> Any:
    """A dict key (or an ``OrderedDict``'s ``_metadata``) encoded; raises CheckpointError
    (the dict's path named) when it holds a tensor or array, which would have no name."""
    n = len(found.tensors)
    out = _encode(k, found, path, copy)
    if len(found.tensors) != n:
        raise CheckpointError(
            f"{_where(path)}: a dict key (or an OrderedDict's _metadata) holds a tensor or "
            "array; keep tensors in the values and use strings or numbers as keys"
        )
    return out


def _named_by(j: int, k: Any) -> tuple[Any, ...]:
    """What names a value under the ``j``-th key ``k`` (:mod:`.tree_names`): a string or
    integer key's type and value; any other key's position alone (never compared)."""
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return (j, type(k), k)
    return (j,)


def _tensor(t: torch.Tensor, found: _Found, path: Any, copy: bool) -> Any:
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
        raise CheckpointError(f"{_where(path)}: only dense tensors can be saved (got {t.layout})")
    if t.dtype not in _SAVED_DTYPES:
        raise CheckpointError(f"{_where(path)}: unsupported tensor dtype {t.dtype}")
    if t.requires_grad or t.is_inference():  # an inference tensor's alias has a version
        t = t.detach()
    if copy:
        t = t.to("cpu", copy=True).contiguous()
    elif not t.is_contiguous():
        t = t.contiguous()
    slot = {TAG: "tensor", "i": len(found.tensors)}  # found.add, inline: the common leaf
    found.tensors.append(t)
    found.chains.append(path)
    found.slots.append(slot)
    return slot


def bytes_view(t: HostArray) -> memoryview:
    """Zero-copy byte view of a contiguous host tensor / array (keep ``t`` alive)."""
    if not isinstance(t, torch.Tensor):
        return memoryview(cast(Any, t.reshape(-1).view("uint8")))
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def data_table(snap: Snapshot) -> tuple[list[dict[str, Any]], int]:
    """The header's tensor table of ``snap`` (dtype or numpy type, shape, offset and
    bytes of each array in the data region, :data:`TENSOR_ALIGN`-aligned, in order) and
    the data region's size in bytes."""
    table, off = [], 0
    for t in snap.tensors:
        off = align_up(off, TENSOR_ALIGN)
        n = _nbytes(t)
        if not isinstance(t, torch.Tensor):
            entry = {"np": t.dtype.str, "shape": list(t.shape), "offset": off, "nbytes": n}
        else:
            dt = str(t.dtype).removeprefix("torch.")
            entry = {"dtype": dt, "shape": list(t.shape), "offset": off, "nbytes": n}
        table.append(entry)
        off += n
    return table, off


def write_shard(w: ObjectWriter, snap: Snapshot) -> tuple[int, str]:
    """Stream ``snap`` into ``w`` (not committed here), hashing the same buffers.

    Returns:
        ``(size_bytes, "crc32c:%08x")`` of the whole file.

    Raises:
        StorageError: from the writer (``StorageFull`` names the key and bytes).
    """
    table, data_bytes = data_table(snap)
    return write_stream(w, snap.tree, table, data_bytes, (_host_bytes(t) for t in snap.tensors))


def _host_bytes(t: HostArray) -> Iterator[memoryview]:
    if isinstance(t, torch.Tensor) and t.device.type != "cpu":
        t = t.to("cpu")  # one tensor at a time: host memory stays bounded
    if _nbytes(t):
        yield bytes_view(t)


def write_stream(
    w: ObjectWriter,
    tree: Any,
    table: list[dict[str, Any]],
    data_bytes: int,
    pieces: Iterable[Iterable[bytes | memoryview]],
) -> tuple[int, str]:
    """Write a shard whose arrays arrive in pieces (not committed here).

    ``table`` is the header's tensor table (:func:`data_table`'s form: offsets and
    ``nbytes`` known in advance) and ``pieces`` yields, per table entry in order, an
    iterable of buffers holding exactly that entry's bytes.  Each buffer is written
    (every writer copies it) and hashed before the next is pulled, so a producer may
    reuse one buffer: memory stays bounded by the producer's chunk, whatever the size.

    Returns:
        ``(size_bytes, "crc32c:%08x")`` of the whole file.

    Raises:
        CheckpointError: an entry's pieces do not add up to its ``nbytes``.
        StorageError: from the writer (``StorageFull`` names the key and bytes).
    """
    header = json.dumps(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tree": tree,
            "tensors": table,
            "data_bytes": data_bytes,
        },
        separators=(",", ":"),
        allow_nan=False,
    ).encode()
    head = PREFIX.pack(MAGIC, len(header), crc32c.crc32c(header), 0) + header
    data_offset = align_up(len(head), DATA_ALIGN)
    crc = 0
    pos = 0

    def emit(buf: bytes | memoryview) -> None:
        nonlocal crc, pos
        crc = crc32c.crc32c(buf, crc)
        w.write(buf)
        pos += len(buf)

    emit(head + bytes(data_offset - len(head)))
    for entry, piece in zip(table, pieces, strict=True):
        gap = data_offset + entry["offset"] - pos
        if gap:
            emit(bytes(gap))
        for buf in piece:
            emit(buf)
        if pos != data_offset + entry["offset"] + entry["nbytes"]:
            raise CheckpointError(
                f"{w.key}: array at offset {entry['offset']} got "
                f"{pos - data_offset - entry['offset']} bytes, its table says {entry['nbytes']}"
            )
    if pos != data_offset + data_bytes:
        emit(bytes(data_offset + data_bytes - pos))
    return pos, f"crc32c:{crc:08x}"


def write_object(w: ObjectWriter, snap: Snapshot) -> tuple[int, str]:
    """:func:`write_shard` into ``w``, then commit it; on any error abort ``w`` (nothing
    is left under the key) and re-raise.

    Returns:
        ``(size_bytes, checksum)`` as :func:`write_shard`.
    """
    try:
        size, checksum = write_shard(w, snap)
        w.commit()
    except BaseException:
        w.abort()
        raise
    return size, checksum
