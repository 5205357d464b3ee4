"""File-set commits stream their files (issue 15, left over: bounded memory).

A framework's checkpoint directory can be tens of GB; the commit and the restore must
hold one chunk of it in memory, not whole files.  tracemalloc sees every buffer ckrun
allocates here (bytearrays and numpy arrays are traced).
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import crc32c
import pytest
from ckrun.checkpoint import fileset, verify
from ckrun.checkpoint import shard as fmt
from ckrun.checkpoint.verify import verify_manifest
from ckrun.errors import CorruptCheckpoint
from ckrun.storage import open_storage

MiB = 1 << 20


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while b := f.read(MiB):
            crc = crc32c.crc32c(b, crc)
    return crc


def _big(path: Path, size: int) -> None:
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for i in range(size // MiB):
            f.write(block[i % 7 :] + block[: i % 7])  # no two blocks alike


def test_commit_and_restore_hold_one_chunk_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fileset, "CHUNK", 1 * MiB, raising=False)
    src = tmp_path / "out" / "checkpoint-7"
    src.mkdir(parents=True)
    _big(src / "model.bin", 40 * MiB)  # 40 chunks
    (src / "trainer_state.json").write_text('{"global_step": 7}')
    files = {f"checkpoint-7/{p.name}": str(p) for p in src.iterdir()}
    st = open_storage(str(tmp_path / "run"))

    tracemalloc.start()
    try:
        m = fileset.commit_files(st, 7, files, run="r", attempt=0)
        _, commit_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        fs = fileset.newest(st, prefix="checkpoint-")
        assert fs is not None
        dest = fileset.restore_dir(fs, str(tmp_path / "restored"), "checkpoint-7")
        _, restore_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # the 40 MiB file went through a few 1 MiB chunks at a time (the restore also
    # re-hashes the shard through verify's own fixed buffer)
    assert commit_peak < 4 * MiB, f"commit peak {commit_peak / MiB:.1f} MiB"
    bound = verify.CHUNK + 4 * MiB
    assert restore_peak < bound, f"restore peak {restore_peak / MiB:.1f} MiB"
    # same protocol: one shard whose CRC32C re-hashes, the manifest lists names and sizes
    assert verify_manifest(st, m) == []
    assert m.metrics[fileset.METRIC] == {n: os.path.getsize(p) for n, p in files.items()}
    # contents and per-file CRC32C unchanged
    for name, path in files.items():
        assert fs.files[name].crc32c == _file_crc(path)
        assert _file_crc(os.path.join(dest, os.path.basename(path))) == _file_crc(path)


def test_a_file_damaged_in_the_shard_never_replaces_the_local_one(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.pt"
    p.write_bytes(b"good" * 5000)
    st = open_storage(str(tmp_path / "run"))
    m = fileset.commit_files(st, 3, {"ckpt.pt": str(p)}, run="r", attempt=0)
    fs = fileset.read_files(st, m)
    shard = tmp_path / "run" / m.shards[0].key
    data = bytearray(shard.read_bytes())
    data[fs.files["ckpt.pt"].offset + 100] ^= 0xFF
    shard.write_bytes(bytes(data))
    p.write_bytes(b"local")
    with pytest.raises(CorruptCheckpoint, match="ckpt.pt fails its checksum"):
        fs.extract("ckpt.pt", str(p))
    assert p.read_bytes() == b"local"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ckrun-restore")]
    assert fileset.newest(st) is None  # the whole-shard re-hash refuses it too


def test_a_file_that_shrinks_during_the_commit_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.pt"
    p.write_bytes(b"x" * (3 * MiB))
    st = open_storage(str(tmp_path / "run"))
    real = fileset._stream

    def cut_after_stat(path: str, before: tuple[int, int, int], crcs: list[int]):  # type: ignore[no-untyped-def]
        os.truncate(path, MiB)  # a writer restarted the file after ckrun's stat
        return real(path, before, crcs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fileset, "_stream", cut_after_stat)
        with pytest.raises(fileset.FileSetChanged):
            fileset.commit_files(st, 1, {"ckpt.pt": str(p)}, run="r", attempt=0)
    assert st.list("checkpoints") == []  # nothing committed, no shard left


def test_commits_written_before_streaming_still_restore(tmp_path: Path) -> None:
    """The earlier layout: each entry carries its own CRC32C and the tree its bytes."""
    import numpy as np
    from ckrun.checkpoint import layout
    from ckrun.checkpoint.commit import commit_manifest
    from ckrun.checkpoint.manifest import Manifest, ManifestKind, ShardInfo, utc_now

    st = open_storage(str(tmp_path / "run"))
    data = np.frombuffer(b"older commit" * 100, dtype=np.uint8)
    entry = {"name": "ckpt.pt", "size": len(data), "crc32c": crc32c.crc32c(data), "data": data}
    key = layout.shard_key(2, 0, 0, "checkpoints")
    snap = fmt.snapshot({"format": fileset.FORMAT, "files": [entry]})
    size, checksum = fmt.write_object(st.open_write(key), snap)
    commit_manifest(
        st,
        Manifest(
            run="r",
            step=2,
            kind=ManifestKind.RECOVERY,
            attempt=0,
            world_size=1,
            shards=(ShardInfo(key, 0, size, checksum),),
            compat={},
            metrics={fileset.METRIC: {"ckpt.pt": len(data)}},
            resumed_from=None,
            created_utc=utc_now(),
            committed_utc=utc_now(),
            save_duration_s=0.0,
            versions={},
            key=layout.manifest_key(2, "checkpoints"),
        ),
    )
    fs = fileset.newest(st)
    assert fs is not None
    fs.extract("ckpt.pt", str(tmp_path / "ckpt.pt"))
    assert (tmp_path / "ckpt.pt").read_bytes() == b"older commit" * 100
