"""Reading a ckrun shard (layout in :mod:`ckrun.checkpoint.shard`): verified, no code run.

The header is checked (magic, length, its own CRC32C, schema, dtype allowlist, offsets
and sizes consistent with the manifest) before anything is allocated; tensors are read
into fresh memory with large ``preadv`` calls in parallel threads; the whole-file CRC32C
is compared before the tree is returned, so a caller never sees unverified data.  The
reads themselves, with their CRC32C, are :mod:`ckrun.checkpoint.segment_read`'s.
"""

from __future__ import annotations

import base64
import json
import math
from collections import OrderedDict
from typing import IO, Any, cast

import crc32c
import torch
from ckrun.checkpoint import st_format
from ckrun.checkpoint.manifest import UnsupportedFormat
from ckrun.checkpoint.segment_read import (
    PARALLEL_MIN_BYTES,
    READ_BATCH,
    READ_CHUNK,
    READ_IOV,
    READ_THREADS,
    read_segments,
    readinto_crc,
)
from ckrun.checkpoint.shard import (
    DATA_ALIGN,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    TAG,
    HostArray,
    align_up,
    bytes_view,
    nbytes,
)
from ckrun.errors import CheckpointError, CorruptCheckpoint

__all__ = [
    "PARALLEL_MIN_BYTES",
    "READ_BATCH",
    "READ_CHUNK",
    "READ_IOV",
    "READ_THREADS",
    "decode_tree",
    "read_header",
    "read_shard",
]


def read_shard(f: IO[bytes], *, size_bytes: int, checksum: str, key: str) -> Any:
    """Read and verify one shard; returns the state tree with fresh CPU tensors.

    Args:
        f: the shard opened for reading at offset 0 (``Storage.open_read``).
        size_bytes: the size the manifest records.
        checksum: the manifest's ``"crc32c:%08x"``.
        key: the shard key, for messages.

    Raises:
        CorruptCheckpoint: bad magic, header CRC, header content, truncation, trailing
            bytes or a whole-file checksum mismatch (the message names the key).
        UnsupportedFormat: a shard format version this ckrun cannot read.
    """
    first = bytearray(len(MAGIC))
    crc = readinto_crc(f, memoryview(first), 0, key)
    if bytes(first) != MAGIC:  # format 2: a safetensors file
        return _read_v2(f, bytes(first), crc, size_bytes=size_bytes, checksum=checksum, key=key)
    meta, hlen, crc = _read_v1_header(f, bytes(first), crc, size_bytes=size_bytes, key=key)
    data_offset = align_up(PREFIX.size + hlen, DATA_ALIGN)
    segs = [memoryview(bytearray(data_offset - PREFIX.size - hlen))]
    tensors: list[Any] = []
    pos = 0
    for entry in meta["tensors"]:
        if entry["offset"] > pos:
            segs.append(memoryview(bytearray(entry["offset"] - pos)))
        t = _alloc(entry, key)
        if entry["nbytes"]:
            segs.append(bytes_view(t))
        tensors.append(t)
        pos = entry["offset"] + entry["nbytes"]
    if pos < meta["data_bytes"]:
        segs.append(memoryview(bytearray(meta["data_bytes"] - pos)))
    crc = read_segments(f, segs, crc, key)
    if f.read(1):
        raise CorruptCheckpoint(f"{key}: trailing bytes after {size_bytes}", key=key)
    got = f"crc32c:{crc:08x}"
    if got != checksum:
        raise CorruptCheckpoint(
            f"{key}: checksum mismatch (manifest {checksum}, file {got})", key=key
        )
    return _decode(meta["tree"], tensors, key)


def read_header(f: IO[bytes], *, size_bytes: int, key: str) -> tuple[dict[str, Any], int]:
    """The parsed header of a format-1 shard and its data region's offset (bytes), read
    from ``f`` at offset 0 without reading the data (the header's own CRC32C is checked;
    the data is not: callers check the whole-file or per-array checksums they hold).

    Raises:
        CorruptCheckpoint: not a format-1 shard, a damaged or inconsistent header.
        UnsupportedFormat: a shard format version this ckrun cannot read.
    """
    first = bytearray(len(MAGIC))
    crc = readinto_crc(f, memoryview(first), 0, key)
    meta, hlen, _ = _read_v1_header(f, bytes(first), crc, size_bytes=size_bytes, key=key)
    return meta, align_up(PREFIX.size + hlen, DATA_ALIGN)


def _read_v1_header(
    f: IO[bytes], first: bytes, crc: int, *, size_bytes: int, key: str
) -> tuple[dict[str, Any], int, int]:
    """The rest of the prefix and the header after the magic: (meta, header_len, crc)."""
    rest = bytearray(PREFIX.size - len(MAGIC))
    crc = readinto_crc(f, memoryview(rest), crc, key)
    magic, hlen, hcrc, _ = PREFIX.unpack(first + bytes(rest))
    if magic != MAGIC:
        raise CorruptCheckpoint(f"{key}: not a ckrun shard (bad magic {magic!r})", key=key)
    if hlen > min(MAX_HEADER_BYTES, size_bytes - PREFIX.size):
        raise CorruptCheckpoint(f"{key}: header length {hlen} exceeds the file", key=key)
    header = bytearray(hlen)
    crc = readinto_crc(f, memoryview(header), crc, key)
    if crc32c.crc32c(header) != hcrc:
        raise CorruptCheckpoint(f"{key}: header checksum mismatch (damaged header)", key=key)
    meta = _parse_header(bytes(header), key)
    data_offset = align_up(PREFIX.size + hlen, DATA_ALIGN)
    if data_offset + meta["data_bytes"] != size_bytes:
        raise CorruptCheckpoint(
            f"{key}: header describes {data_offset + meta['data_bytes']} bytes, "
            f"manifest says {size_bytes}",
            key=key,
        )
    return meta, hlen, crc


def _read_v2(
    f: IO[bytes], first: bytes, crc: int, *, size_bytes: int, checksum: str, key: str
) -> Any:
    """Format 2 (:mod:`ckrun.checkpoint.st_format`): the whole shard, verified."""
    (hlen,) = st_format.LEN.unpack(first)
    if hlen > min(MAX_HEADER_BYTES, size_bytes - len(first)) or hlen < 2:
        raise CorruptCheckpoint(
            f"{key}: not a ckrun shard (bad magic {first[:4]!r}: neither format 1 nor a "
            "safetensors header)",
            key=key,
        )
    header = bytearray(hlen)
    crc = readinto_crc(f, memoryview(header), crc, key)
    if header[:1] != b"{":
        raise CorruptCheckpoint(f"{key}: not a ckrun shard (bad magic {first[:4]!r})", key=key)
    h = st_format.parse_header(first + bytes(header), key)
    if h.header_bytes + h.data_bytes != size_bytes:
        raise CorruptCheckpoint(
            f"{key}: header describes {h.header_bytes + h.data_bytes} bytes, "
            f"manifest says {size_bytes}",
            key=key,
        )
    tensors = [st_format.alloc(e) for e in h.entries]
    order = sorted(range(len(tensors)), key=lambda i: h.ranges[h.entries[i]["name"]][0])
    segs = [bytes_view(tensors[i]) for i in order if nbytes(tensors[i])]
    crc = read_segments(f, segs, crc, key)
    if f.read(1):
        raise CorruptCheckpoint(f"{key}: trailing bytes after {size_bytes}", key=key)
    got = f"crc32c:{crc:08x}"
    if got != checksum:
        raise CorruptCheckpoint(
            f"{key}: checksum mismatch (manifest {checksum}, file {got})", key=key
        )
    by_name = {e["name"]: t for e, t in zip(h.entries, tensors, strict=True)}

    def whole(name: str) -> Any:
        if name not in by_name:
            raise CheckpointError(
                f"{key}: tensor {name!r} is sharded over several shards; load it through "
                "the checkpoint's manifest (Checkpointer.load or ckrun.checkpoint.reshard)"
            )
        return by_name[name]

    return decode_tree(h.tree, tensors, key, resolve_global=whole)


def decode_tree(tree: Any, tensors: list[Any], key: str, *, resolve_global: Any = None) -> Any:
    """The state tree of a shard header with its placeholders replaced: ``tensor`` by
    ``tensors[i]``, ``global`` (format 2) by ``resolve_global(name)``.

    Raises:
        CorruptCheckpoint: a malformed or unknown tag.
    """
    extra: list[Any] = []

    def bind(v: Any) -> Any:
        if isinstance(v, list):
            return [bind(x) for x in v]
        if not isinstance(v, dict):
            return v
        if v.get(TAG) == "global" and resolve_global is not None:
            name = v.get("name")
            if not isinstance(name, str):
                raise CorruptCheckpoint(f"{key}: malformed global entry {v!r:.80}", key=key)
            extra.append(resolve_global(name))
            return {TAG: "tensor", "i": len(tensors) + len(extra) - 1}
        return {k: bind(x) for k, x in v.items()}

    bound = bind(tree)
    return _decode(bound, tensors + extra, key)


def _parse_header(header: bytes, key: str) -> dict[str, Any]:
    try:
        meta = json.loads(header)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{key}: unparsable header ({e})", key=key) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{key}: not a {FORMAT} header", key=key)
    v = meta.get("format_version")
    if v != FORMAT_VERSION:
        raise UnsupportedFormat(
            f"{key}: unknown shard format_version {v!r} (this ckrun reads {FORMAT_VERSION}); "
            "upgrade ckrun to read it",
            key=key,
        )
    tensors, data = meta.get("tensors"), meta.get("data_bytes")
    if not isinstance(tensors, list) or not isinstance(data, int) or data < 0:
        raise CorruptCheckpoint(f"{key}: malformed tensor table", key=key)
    pos = 0
    for ent in tensors:
        ok = (
            isinstance(ent, dict)
            and isinstance(ent.get("offset"), int)
            and isinstance(ent.get("nbytes"), int)
            and isinstance(ent.get("shape"), list)
            and all(isinstance(s, int) and s >= 0 for s in ent["shape"])
            and ent["offset"] >= pos
            and ent["nbytes"] >= 0
        )
        if not ok:
            raise CorruptCheckpoint(f"{key}: malformed tensor entry {ent!r:.120}", key=key)
        pos = ent["offset"] + ent["nbytes"]
    if pos > data:
        raise CorruptCheckpoint(f"{key}: tensor table runs past the data section", key=key)
    return meta


def _alloc(e: dict[str, Any], key: str) -> HostArray:
    shape = tuple(e["shape"])
    if "np" in e:
        np = _numpy(key)
        try:
            dt = np.dtype(e["np"])
        except TypeError as exc:
            raise CorruptCheckpoint(f"{key}: bad numpy dtype {e['np']!r}", key=key) from exc
        if dt.hasobject or math.prod(shape) * dt.itemsize != e["nbytes"]:
            raise CorruptCheckpoint(f"{key}: inconsistent array entry {e!r:.120}", key=key)
        return cast(HostArray, np.empty(shape, dtype=dt))
    dtype = DTYPES.get(e.get("dtype", ""))
    if dtype is None:
        raise CorruptCheckpoint(f"{key}: unknown tensor dtype {e.get('dtype')!r}", key=key)
    if math.prod(shape) * dtype.itemsize != e["nbytes"]:
        raise CorruptCheckpoint(f"{key}: shape {shape} does not match {e['nbytes']} bytes", key=key)
    return torch.empty(shape, dtype=dtype)


def _decode(v: Any, tensors: list[Any], key: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors, key) for x in v]
    if not isinstance(v, dict):
        return v
    tag = v.get(TAG)
    if tag is None:
        return {k: _decode(x, tensors, key) for k, x in v.items()}
    try:
        return _decode_tag(tag, v, tensors, key)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpoint(
            f"{key}: malformed {tag!r} entry in the header ({e})", key=key
        ) from e


def _decode_tag(tag: str, v: dict[str, Any], tensors: list[Any], key: str) -> Any:
    if tag in ("tensor", "ndarray"):
        return tensors[v["i"]]
    if tag == "float":
        return float(v["v"])
    if tag == "tuple":
        return tuple(_decode(x, tensors, key) for x in v["items"])
    if tag == "size":
        return torch.Size(v["v"])
    if tag == "bytes":
        return base64.b64decode(v["b64"])
    if tag == "dtype":
        return DTYPES[v["v"]]
    if tag == "device":
        return torch.device(v["v"])
    if tag == "npscalar":
        return _numpy(key).dtype(v["dtype"]).type(_decode(v["v"], tensors, key))
    if tag in ("dict", "odict"):
        d: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
        for k, x in v["items"]:
            d[_decode(k, tensors, key)] = _decode(x, tensors, key)
        if tag == "odict":
            d._metadata = _decode(v["meta"], tensors, key)  # type: ignore[attr-defined]
        return d
    raise CorruptCheckpoint(f"{key}: unknown tag {tag!r} in the header", key=key)


def _numpy(key: str) -> Any:
    try:
        import numpy
    except ImportError as e:
        raise CheckpointError(f"{key} holds numpy values: install numpy to load it") from e
    return numpy
