"""The shard format: round trips of every supported value, refusal of others, damage."""

from __future__ import annotations

import io
import json
import math
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckrun import Checkpointer
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import shard_reader as reader
from ckrun.checkpoint.manifest import UnsupportedFormat
from ckrun.errors import CheckpointError, CorruptCheckpoint
from ckrun.storage.local import LocalStorage


def _write(obj: Any, tmp_path: Any) -> tuple[bytes, str]:
    st = LocalStorage(str(tmp_path))
    w = st.open_write("s.ckpt")
    size, crc = fmt.write_shard(w, fmt.snapshot(obj))
    w.commit()
    data = st.get("s.ckpt")
    assert len(data) == size
    return data, crc


def _read(data: bytes, crc: str, size: int | None = None) -> Any:
    return reader.read_shard(
        io.BytesIO(data), size_bytes=len(data) if size is None else size, checksum=crc, key="s.ckpt"
    )


def test_roundtrip_every_value_kind(tmp_path: Any) -> None:
    od: OrderedDict[str, Any] = OrderedDict(w=torch.arange(6.0).reshape(2, 3))
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    obj = {
        "dtypes": {
            str(d): torch.ones(3, dtype=d)
            for d in (
                torch.float32,
                torch.float16,
                torch.bfloat16,
                torch.int64,
                torch.bool,
                torch.uint8,
                torch.complex64,
                torch.float8_e4m3fn,
            )
        },
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        "np": np.arange(5, dtype=np.int32),
        "npscalar": np.float64(2.5),
        "tuple": (1, "a", None, True),
        "intkeys": {0: "x", (1, 2): "y"},
        "floats": [math.inf, -math.inf, 0.1],
        "nan": math.nan,
        "bytes": b"\x00\xff",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "odict": od,
        "__ckrun__": "user key that looks like a tag",
        "big": 2**70,
    }
    data, crc = _write(obj, tmp_path)
    got = _read(data, crc)
    for k, t in obj["dtypes"].items():
        g = got["dtypes"][k]
        assert g.dtype == t.dtype and torch.equal(g.view(torch.uint8), t.view(torch.uint8))
    assert torch.equal(got["noncontig"], obj["noncontig"])
    assert got["scalar"].shape == () and got["empty"].shape == (0, 4)
    assert np.array_equal(got["np"], obj["np"]) and got["np"].dtype == np.int32
    assert got["npscalar"] == 2.5 and isinstance(got["npscalar"], np.float64)
    assert got["tuple"] == (1, "a", None, True) and got["intkeys"] == {0: "x", (1, 2): "y"}
    assert got["floats"][:2] == [math.inf, -math.inf] and math.isnan(got["nan"])
    assert got["bytes"] == b"\x00\xff" and got["dtype"] is torch.bfloat16
    assert got["size"] == torch.Size([2, 3]) and got["device"] == torch.device("cpu")
    assert isinstance(got["odict"], OrderedDict) and got["odict"]._metadata == od._metadata
    assert got["__ckrun__"] == obj["__ckrun__"] and got["big"] == 2**70
    assert data[: len(fmt.MAGIC)] == fmt.MAGIC


def test_loaded_tensors_do_not_alias_the_file_buffer(tmp_path: Any) -> None:
    data, crc = _write({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path)
    got = _read(data, crc)
    got["a"].add_(1)
    assert torch.equal(got["b"], torch.zeros(4))


@pytest.mark.parametrize(
    "bad", [object(), lambda: 1, {1, 2}, torch.ones(2).to_sparse(), np.array([object()])]
)
def test_unsupported_values_refused(bad: Any) -> None:
    with pytest.raises(CheckpointError, match=r"state\.x"):
        fmt.snapshot({"x": bad})


def test_a_refused_value_is_named_by_its_path() -> None:
    with pytest.raises(CheckpointError, match=r"^state\.a\[1\]\.b\[0\]: cannot checkpoint a"):
        fmt.snapshot({"a": [0, {"b": (object(),)}]})


def test_snapshot_copy_is_independent() -> None:
    t = torch.ones(3)
    snap = fmt.snapshot({"t": t}, copy=True)
    t.add_(1)
    assert torch.equal(snap.tensors[0], torch.ones(3))  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["header", "data", "padding"])
def test_bit_flip_detected(tmp_path: Any, where: str) -> None:
    data, crc = _write({"w": torch.arange(1000.0)}, tmp_path)
    pos = {"header": 40, "padding": 2000, "data": fmt.DATA_ALIGN + 100}[where]
    flipped = bytearray(data)
    flipped[pos] ^= 0x10
    with pytest.raises(CorruptCheckpoint) as ei:
        _read(bytes(flipped), crc)
    assert ei.value.key == "s.ckpt" and "s.ckpt" in str(ei.value)


def test_truncated_and_trailing(tmp_path: Any) -> None:
    data, crc = _write({"w": torch.arange(1000.0)}, tmp_path)
    with pytest.raises(CorruptCheckpoint, match="truncated|describes"):
        _read(data[:-10], crc, size=len(data))
    with pytest.raises(CorruptCheckpoint, match="describes"):
        _read(data[:-10], crc)
    with pytest.raises(CorruptCheckpoint, match="trailing"):
        _read(data + b"x", crc, size=len(data))


def test_bad_magic_and_wrong_checksum(tmp_path: Any) -> None:
    data, crc = _write({"w": torch.ones(4)}, tmp_path)
    with pytest.raises(CorruptCheckpoint, match="magic"):
        _read(b"PK\x03\x04" + data[4:], crc)
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        _read(data, "crc32c:00000000")


def _rewrite_header(data: bytes, edit: Any) -> bytes:
    """Rebuild the file around an edited header (valid header CRC, same data offset)."""
    import crc32c

    _, hlen, _, _ = fmt.PREFIX.unpack(data[: fmt.PREFIX.size])
    meta = json.loads(data[fmt.PREFIX.size : fmt.PREFIX.size + hlen])
    edit(meta)
    header = json.dumps(meta, separators=(",", ":")).encode()
    head = struct.pack("<8sQII", fmt.MAGIC, len(header), crc32c.crc32c(header), 0) + header
    assert len(head) < fmt.DATA_ALIGN
    return head.ljust(fmt.DATA_ALIGN, b"\0") + data[fmt.DATA_ALIGN :]


def test_unknown_shard_version(tmp_path: Any) -> None:
    data, _ = _write({"w": torch.ones(4)}, tmp_path)
    bad = _rewrite_header(data, lambda m: m.update(format_version=99))
    with pytest.raises(UnsupportedFormat, match="upgrade ckrun"):
        _read(bad, "crc32c:00000000")


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["tensors"][0].update(dtype="object"),
        lambda m: m["tensors"][0].update(shape=[10**6]),
        lambda m: m["tensors"][0].update(offset=-64),
        lambda m: m.update(tree={"__ckrun__": "pickle", "data": "x"}),
        lambda m: m.update(tree={"__ckrun__": "tensor", "i": 7}),
    ],
)
def test_hostile_header_refused_without_allocation(tmp_path: Any, edit: Any) -> None:
    data, _ = _write({"w": torch.ones(4)}, tmp_path)
    with pytest.raises(CorruptCheckpoint):
        _read(_rewrite_header(data, edit), "crc32c:00000000")


def _big_shard(tmp_path: Any) -> tuple[LocalStorage, int, str, torch.Tensor]:
    st = LocalStorage(str(tmp_path / "big"))
    t = torch.arange(10 << 20, dtype=torch.float32)  # 40 MiB: the parallel read path
    w = st.open_write("s.ckpt")
    size, crc = fmt.write_shard(w, fmt.snapshot({"t": t, "small": torch.ones(3)}))
    w.commit()
    return st, size, crc, t


def test_parallel_read_path(tmp_path: Any) -> None:
    st, size, crc, t = _big_shard(tmp_path)
    assert size >= 2 * reader.PARALLEL_MIN_BYTES // 2
    with st.open_read("s.ckpt") as f:
        got = reader.read_shard(f, size_bytes=size, checksum=crc, key="s.ckpt")
    assert torch.equal(got["t"], t) and torch.equal(got["small"], torch.ones(3))
    path = st.local_path("s.ckpt")
    assert path is not None
    with open(path, "r+b") as fh:  # flip a bit in the second reader's half
        fh.seek(size - (5 << 20))
        b = fh.read(1)
        fh.seek(size - (5 << 20))
        fh.write(bytes([b[0] ^ 4]))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"), st.open_read("s.ckpt") as f:
        reader.read_shard(f, size_bytes=size, checksum=crc, key="s.ckpt")
    import os

    os.truncate(path, size - 1000)
    with pytest.raises(CorruptCheckpoint, match="truncated"), st.open_read("s.ckpt") as f:
        reader.read_shard(f, size_bytes=size, checksum=crc, key="s.ckpt")


def test_a_lazy_save_of_an_inference_tensor_in_a_list(tmp_path: Path) -> None:
    """A tensor made under inference_mode, reached through a list (not detached by
    capture) and owned by an optimizer: the snapshot still detaches it (its own version
    counter is not readable), so a lazy async save works."""
    with torch.inference_mode():
        frozen = torch.randn(4, 4)
    w = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([w, frozen], lr=0.1)
    state = {"tensors": [w, frozen], "opt": opt}

    def step() -> None:
        (frozen.sum() * w).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    with Checkpointer(str(tmp_path), rng=False, lock=False) as ck:
        ck.async_save(1, state, lazy=True)
        step()
        ck.wait()
        assert ck.latest() is not None and ck.latest().step == 1
