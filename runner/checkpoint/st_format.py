"""Shard format 2: a valid safetensors file with ckrun's tree under ``__metadata__``.

Layout (the safetensors format, https://github.com/huggingface/safetensors#format)::

    0   N: u64 little-endian                      8 bytes
    8   header: UTF-8 JSON, N bytes, padded with spaces (0x20, which the spec allows)
        so that the data starts at 8 + N, a multiple of 4096 (DATA_ALIGN)
    8+N tensor bytes, packed without holes (the spec forbids them)

The header maps each entry name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data start) and holds ``__metadata__``, a string → string map:
``format`` = ``ckrun.shard``, ``format_version`` = ``"2"`` and ``ckrun`` = the JSON text
of ``{"tree", "entries": [{"name", "dtype" | "np", "shape"}], "data_bytes"}`` where
``tree`` is the state with tensors replaced by ``{"__ckrun__": "tensor", "i": n}``
(``entries[n]``) or ``{"__ckrun__": "global", "name": g}`` (a tensor assembled from the
pieces the manifest's layout lists, :mod:`ckrun.checkpoint.reshard`).

Entries are stored in order of decreasing element size, so every entry starts at a
multiple of its own element size without padding (the async saver's arena views each
entry in place, :mod:`ckrun.checkpoint.host_buffers`).  A dtype safetensors has no name
for (``complex128``, numpy arrays of other dtypes) is stored as ``U8`` bytes; its real
dtype and shape are in the ckrun metadata.

The CRC32C of the whole file goes to the manifest as before, and so do the CRC32C of the
header and of every entry (:class:`Written`), so a ranged read of one entry is verified
without reading the rest of the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.crc import combine
from ckrun.checkpoint.crc_beside import Beside
from ckrun.errors import CorruptCheckpoint
from ckrun.storage.base import ObjectWriter

FORMAT_VERSION = 2
DATA_ALIGN = fmt.DATA_ALIGN
MAX_HEADER_BYTES = fmt.MAX_HEADER_BYTES
LEN = struct.Struct("<Q")
#: Entries smaller than this (bytes) are hashed a second time into the file's CRC32C,
#: which costs less than :func:`ckrun.checkpoint.crc.combine` in Python (tens of µs);
#: larger ones are hashed once and combined (issue 19: the persist's CPU is compute
#: taken from training; hashing 1 GiB twice cost 0.27 s of CPU here instead of 0.14).
REHASH_BELOW = 256 << 10

#: torch dtype name (as in the v1 table) → safetensors dtype name
ST_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "complex64": "C64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_NP_ST = {"<f8": "F64", "<f4": "F32", "<f2": "F16", "<i8": "I64", "<i4": "I32", "<i2": "I16"}
_NP_ST.update({"|i1": "I8", "|u1": "U8", "|b1": "BOOL", "<u2": "U16", "<u4": "U32", "<u8": "U64"})


@dataclass(frozen=True)
class Written:
    """What writing one shard produced (reported to the manifest).

    Attributes:
        size_bytes: file size in bytes.
        checksum: ``"crc32c:%08x"`` of the whole file.
        header_bytes: bytes before the data (8 + N, a multiple of 4096).
        header_crc: ``"crc32c:%08x"`` of those bytes.
        entries: entry name → ``[begin, end, "crc32c:%08x"]``, absolute file offsets.
    """

    size_bytes: int
    checksum: str
    header_bytes: int
    header_crc: str
    entries: dict[str, list[Any]]


def _itemsize(t: fmt.HostArray) -> int:
    return int(t.element_size()) if isinstance(t, torch.Tensor) else int(t.dtype.itemsize)


def entry_meta(t: fmt.HostArray) -> tuple[dict[str, Any], str, list[int]]:
    """(ckrun entry description, safetensors dtype, safetensors shape) of one array."""
    nbytes = fmt.nbytes(t)
    if isinstance(t, torch.Tensor):
        dt = str(t.dtype).removeprefix("torch.")
        desc: dict[str, Any] = {"dtype": dt, "shape": list(t.shape)}
        st = ST_DTYPES.get(dt)
    else:
        desc = {"np": t.dtype.str, "shape": list(t.shape)}
        st = _NP_ST.get(t.dtype.str)
    if st is None:
        return desc, "U8", [nbytes]
    return desc, st, list(t.shape)


def table(tensors: Sequence[fmt.HostArray]) -> tuple[list[dict[str, Any]], int]:
    """Data-region offsets of ``tensors`` (in their order): ``[{"offset", "nbytes"}]`` and
    the data size in bytes.  Entries are placed by decreasing element size (stable), so
    each offset is a multiple of its element size and there are no holes."""
    order = sorted(range(len(tensors)), key=lambda i: -_itemsize(tensors[i]))
    out: list[dict[str, Any]] = [{} for _ in tensors]
    off = 0
    for i in order:
        n = fmt.nbytes(tensors[i])
        out[i] = {"offset": off, "nbytes": n}
        off += n
    return out, off


@dataclass(frozen=True)
class Prepared:
    """The part of a shard's header that depends only on its entries' names, dtypes and
    shapes (not on their values nor on the tree's other leaves): computed once per
    structure and reused by the saves of the same structure
    (:mod:`ckrun.checkpoint.plan_memo`).

    Attributes:
        entries: JSON text of ckrun's entry descriptions (``[{"name", "dtype" | "np",
            "shape"}]``).
        head: JSON text of the safetensors entries (``"name":{"dtype","shape",
            "data_offsets"}`` joined by commas, without braces).
        table: per entry ``{"offset", "nbytes"}`` in the data region (:func:`table`).
        data_bytes: the data region's size in bytes.
        order: entry indices by increasing offset (the order they are written in).
    """

    entries: str
    head: str
    table: list[dict[str, Any]]
    data_bytes: int
    order: list[int]


_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def prepare(tensors: Sequence[fmt.HostArray], names: Sequence[str]) -> Prepared:
    """The structure-only part of the header of a shard of ``tensors`` named ``names``.

    Raises:
        ValueError: duplicate names, or an entry named ``__metadata__``.
    """
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ValueError("shard entry names must be unique and not __metadata__")
    tab, data_bytes = table(tensors)
    descs, head = [], {}
    for t, name, e in zip(tensors, names, tab, strict=True):
        desc, st, shape = entry_meta(t)
        descs.append({"name": name, **desc})
        head[name] = {
            "dtype": st,
            "shape": shape,
            "data_offsets": [e["offset"], e["offset"] + e["nbytes"]],
        }
    order = sorted(range(len(tensors)), key=lambda i: tab[i]["offset"])
    return Prepared(_JSON(descs), _JSON(head)[1:-1], tab, data_bytes, order)


def header_block(tree: Any, p: Prepared) -> bytes:
    """The header block (8-byte length + JSON padded to :data:`DATA_ALIGN`) of a shard
    whose tree is ``tree`` and whose entries ``p`` describes.  The JSON is assembled from
    ``p``'s texts: the same bytes as ``json.dumps`` of the whole header (compact
    separators, ASCII), which ``tests/checkpoint/test_plan_memo.py`` checks.

    Raises:
        ValueError: ``tree`` holds a NaN or infinite float (encoded trees never do).
    """
    ck = f'{{"tree":{_JSON(tree)},"entries":{p.entries},"data_bytes":{p.data_bytes}}}'
    meta = _JSON({"format": fmt.FORMAT, "format_version": str(FORMAT_VERSION), "ckrun": ck})
    body = f'{{"__metadata__":{meta}{"," if p.head else ""}{p.head}}}'.encode()
    total = fmt.align_up(LEN.size + len(body), DATA_ALIGN)
    body += b" " * (total - LEN.size - len(body))
    return LEN.pack(len(body)) + body


def build_header(
    tree: Any, tensors: Sequence[fmt.HostArray], names: Sequence[str]
) -> tuple[bytes, list[dict[str, Any]], int]:
    """The header block (8-byte length + padded JSON), the table and the data size."""
    p = prepare(tensors, names)
    return header_block(tree, p), p.table, p.data_bytes


def write(
    w: ObjectWriter,
    tree: Any,
    tensors: Sequence[fmt.HostArray],
    names: Sequence[str],
    prepared: Prepared | None = None,
) -> Written:
    """Stream one shard into ``w`` (not committed), hashing each entry once.

    Args:
        prepared: :func:`prepare` of ``tensors`` and ``names`` when the caller kept it
            from a save of the same structure (their dtypes and shapes unchanged).

    Raises:
        StorageError: from the writer.
    """
    return write_unhashed(w, tree, tensors, names, prepared).hash()


@dataclass
class Unhashed:
    """A shard whose bytes are written and whose host entries are not hashed yet
    (:func:`write_unhashed`); :meth:`hash` computes the CRC32Cs from the same arrays.

    Attributes:
        header: the header block (written first).
        pending: per entry in file order, ``(name, file offset, bytes, the array's
            bytes or None, the CRC32C computed during the write or its future)``.
        size_bytes: the file size in bytes.
        beside: the thread hashing big entries (:mod:`ckrun.checkpoint.crc_beside`).
    """

    header: bytes
    pending: list[tuple[str, int, int, memoryview | None, int | Future[int]]]
    size_bytes: int
    beside: Beside

    def hash(self) -> Written:
        """The :class:`Written` of the shard: each entry's CRC32C from its array (the
        caller keeps the arrays unchanged until then: a synchronous save's state, an
        async save's host copies), the file's from the header's and the entries'."""
        hcrc = crc32c.crc32c(self.header)
        crc = hcrc
        entries: dict[str, list[Any]] = {}
        try:
            for name, pos, n, buf, got in self.pending:
                ecrc = got.result() if isinstance(got, Future) else got
                if buf is not None and not isinstance(got, Future):
                    ecrc = crc32c.crc32c(buf)
                    # each byte hashed once: the file's CRC extends by the entry's
                    crc = crc32c.crc32c(buf, crc) if n < REHASH_BELOW else combine(crc, ecrc, n)
                elif n:
                    crc = combine(crc, ecrc, n)
                entries[name] = [pos, pos + n, f"crc32c:{ecrc:08x}"]
        finally:
            self.beside.close()
        return Written(
            self.size_bytes, f"crc32c:{crc:08x}", len(self.header), f"crc32c:{hcrc:08x}", entries
        )


def write_unhashed(
    w: ObjectWriter,
    tree: Any,
    tensors: Sequence[fmt.HostArray],
    names: Sequence[str],
    prepared: Prepared | None = None,
) -> Unhashed:
    """Stream one shard into ``w`` (not committed); :meth:`Unhashed.hash` hashes its
    host entries once the caller has committed ``w`` (issue 19, small states: the CRC32C
    then runs while the disk writes the shard back), a big one beside its own write
    (:mod:`ckrun.checkpoint.crc_beside`), a device entry here from its one host copy.

    Raises:
        StorageError: from the writer.
    """
    p = prepared or prepare(tensors, names)
    head, tab = header_block(tree, p), p.table
    beside = Beside()
    try:
        w.write(head)
        pos = len(head)
        pending: list[tuple[str, int, int, memoryview | None, int | Future[int]]] = []
        for i in p.order:
            t = tensors[i]
            n = tab[i]["nbytes"]
            buf: memoryview | None = None
            ecrc: int | Future[int] = 0
            if n:
                if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                    # one tensor at a time: host memory stays bounded: hash its copy now
                    host = t.to("cpu")  # named: the view below does not keep it alive
                    copied = fmt.bytes_view(host)
                    ecrc = crc32c.crc32c(copied)
                    w.write(copied)
                else:
                    buf = fmt.bytes_view(t)
                    ecrc = beside.start(buf, t) or 0  # a big entry: hashed while written
                    w.write(buf)
            pending.append((names[i], pos, n, buf, ecrc))
            pos += n
    except BaseException:
        beside.close()
        raise
    return Unhashed(head, pending, pos, beside)


@dataclass(frozen=True)
class Header:
    """A parsed format-2 header: ckrun's metadata and each entry's file range."""

    tree: Any
    entries: list[dict[str, Any]]  # ckrun descriptions, placeholder order
    ranges: dict[str, tuple[int, int]]  # name -> absolute [begin, end)
    header_bytes: int
    data_bytes: int


def parse_header(buf: bytes, key: str) -> Header:
    """Validate a format-2 header block (``buf`` = the 8-byte length + the JSON).

    Raises:
        CorruptCheckpoint: malformed JSON, missing metadata, overlapping or holed
            entries, an entry whose size does not match its dtype and shape.
        UnsupportedFormat: a newer ``format_version``.
    """
    from ckrun.checkpoint.manifest import UnsupportedFormat

    try:
        head = json.loads(buf[LEN.size :])
        meta = head["__metadata__"]
        ck = json.loads(meta["ckrun"]) if meta.get("format") == fmt.FORMAT else None
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{key}: unparsable safetensors header ({e})", key=key) from e
    if ck is None:
        raise CorruptCheckpoint(f"{key}: a safetensors file, but not a ckrun shard", key=key)
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise UnsupportedFormat(
            f"{key}: unknown shard format_version {meta.get('format_version')!r} (this ckrun "
            f"reads 1 and {FORMAT_VERSION}); upgrade ckrun to read it",
            key=key,
        )
    base = len(buf)
    ranges: dict[str, tuple[int, int]] = {}
    try:
        entries, data_bytes = list(ck["entries"]), int(ck["data_bytes"])
        spans = []
        for ent in entries:
            h = head[ent["name"]]
            b, end = (int(x) for x in h["data_offsets"])
            if not 0 <= b <= end or _entry_nbytes(ent, key) != end - b:
                raise ValueError(f"entry {ent['name']!r} has bad offsets or size")
            ranges[ent["name"]] = (base + b, base + end)
            spans.append((b, end))
        pos = 0
        for b, end in sorted(spans):
            if b != pos:
                raise ValueError("entries overlap or leave holes")
            pos = end
        if pos != data_bytes or len(head) - 1 != len(entries):
            raise ValueError("entries do not cover the data section")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"{key}: malformed shard header ({e})", key=key) from e
    return Header(ck.get("tree"), entries, ranges, base, data_bytes)


def _entry_nbytes(e: Mapping[str, Any], key: str) -> int:
    """Bytes of one entry from its ckrun dtype and shape (allowlisted dtypes only)."""
    shape = e["shape"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"bad shape {shape!r}")
    n = 1
    for s in shape:
        n *= s
    if "np" in e:
        import numpy as np

        dt = np.dtype(e["np"])
        if dt.hasobject:
            raise ValueError("numpy object arrays are refused")
        return n * int(dt.itemsize)
    dtype = fmt.DTYPES.get(e.get("dtype", ""))
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {e.get('dtype')!r}")
    return n * dtype.itemsize


def alloc(e: Mapping[str, Any]) -> fmt.HostArray:
    """A fresh array for entry ``e`` (validated by :func:`parse_header`)."""
    shape = tuple(e["shape"])
    if "np" in e:
        import numpy as np

        return np.empty(shape, dtype=np.dtype(e["np"]))
    return torch.empty(shape, dtype=fmt.DTYPES[e["dtype"]])
