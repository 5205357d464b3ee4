"""The host buffers of async saves and the zero-copy O_DIRECT shard writer: the file is
byte-identical to the buffered writer's, across chunk boundaries, odd dtypes and sizes,
numpy arrays, a layout change in a reused arena; real files on the local disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint import sharding, st_format
from ckrun.checkpoint.host_buffers import CHUNK, ArenaWriter, HostBuffers
from ckrun.errors import ConfigError
from ckrun.storage.local import LocalStorage


def _tree(big: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(big, generator=g),  # spans several 32 MiB requests
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "flags": torch.rand(7, generator=g) > 0.5,
        "step": torch.tensor(seed),
        "empty": torch.zeros(0, 4),
        "t": torch.randn(6, 4, generator=g).t(),
        "rng": np.random.RandomState(seed).randint(0, 1 << 31, 624).astype(np.uint32),
        "meta": {"x": [1, "a"]},
    }


def _write(
    st: LocalStorage, key: str, snap: fmt.Snapshot, open_shard: object = None
) -> tuple[bytes, int, str]:
    w = (open_shard or st.open_write)(key)  # type: ignore[operator]
    # the production writer (format 2, issue 14), whose layout the arena follows
    out = st_format.write(w, snap.tree, snap.tensors, sharding.tensor_paths(snap.tree))
    w.commit()
    return (Path(st.root) / key).read_bytes(), out.size_bytes, out.checksum


def test_zero_copy_file_is_byte_identical(tmp_path: Path) -> None:
    ref_st = LocalStorage(str(tmp_path / "ref"), direct=False)
    st = LocalStorage(str(tmp_path / "zc"))
    hb = HostBuffers()
    for i, big in enumerate(((2 * CHUNK) // 4 + 1234, CHUNK // 4 + 3, 1000)):
        snap = fmt.snapshot(_tree(big, i))
        staged = hb.stage(snap)
        opener = hb.writer_for(st)
        assert opener is not None
        probe = opener(f"probe{i}.ckpt")
        assert isinstance(probe, ArenaWriter)
        probe.abort()
        ref = _write(ref_st, f"s{i}.ckpt", snap)
        got = _write(st, f"s{i}.ckpt", staged, opener)
        assert got[1:] == ref[1:] and got[0] == ref[0], f"layout {i} differs"
    assert hb.allocations == 1  # shrinking layouts reuse the first arena (zeroed padding)


def test_stage_is_a_copy_and_writer_for_falls_back(tmp_path: Path) -> None:
    t = torch.arange(10, dtype=torch.float32)
    hb = HostBuffers()
    snap = hb.stage(fmt.snapshot({"t": t}))
    t.add_(100)
    assert torch.equal(snap.tensors[0], torch.arange(10, dtype=torch.float32))  # type: ignore[arg-type]
    assert hb.writer_for(LocalStorage(str(tmp_path), direct=False)) is None

    class Sub(LocalStorage):
        pass

    assert hb.writer_for(Sub(str(tmp_path))) is None  # a subclass keeps its open_write


def test_rate_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import ckrun

    state = {"w": torch.ones(10 << 20 >> 2)}  # 10 MiB
    monkeypatch.setenv("CKRUN_PERSIST_MAX_MBPS", "50")
    with ckrun.Checkpointer(storage=str(tmp_path / "run"), rng=False) as ck:
        t = time.monotonic()
        ck.async_save(1, state).result(60)
        assert time.monotonic() - t >= 10.4e6 / 50e6 * 0.9  # the cap holds it back
        monkeypatch.setenv("CKRUN_PERSIST_MAX_MBPS", "fast")
        h = ck.async_save(2, state)
        with pytest.raises(ConfigError, match="CKRUN_PERSIST_MAX_MBPS"):
            h.result(60)
