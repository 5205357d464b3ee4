"""The Storage contract (DESIGN.md §3), backend-agnostic; collected by test_contract.py.

Every test takes the parametrized ``storage`` fixture (tests/storage/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from ckrun.errors import InvalidKey, ObjectExists, ObjectNotFound
from ckrun.storage.base import ObjectWriter, Storage

BAD_KEYS = ["../escape", "a/../../b", "/abs/key", "a//b", "a/./b", "", "a\\b", "a/b/", "x\x00"]


def test_is_a_storage(storage: Any) -> None:
    assert isinstance(storage, Storage)


def test_put_get_head_roundtrip(storage: Storage) -> None:
    info = storage.put("a/b/obj.bin", b"hello")
    assert info.key == "a/b/obj.bin" and info.size_bytes == 5
    assert storage.get("a/b/obj.bin") == b"hello"
    head = storage.head("a/b/obj.bin")
    assert head is not None and head.size_bytes == 5


def test_put_replaces_whole_object(storage: Storage) -> None:
    storage.put("k", b"x" * 100)
    storage.put("k", memoryview(b"short"))
    assert storage.get("k") == b"short"


def test_empty_object(storage: Storage) -> None:
    storage.put("empty", b"")
    assert storage.get("empty") == b""
    head = storage.head("empty")
    assert head is not None and head.size_bytes == 0


def test_missing_object(storage: Storage) -> None:
    assert storage.head("nope") is None
    with pytest.raises(ObjectNotFound):
        storage.get("nope")
    with pytest.raises(ObjectNotFound):
        storage.open_read("nope")


def test_conditional_create(storage: Storage) -> None:
    storage.put("once", b"1", if_absent=True)
    with pytest.raises(ObjectExists):
        storage.put("once", b"2", if_absent=True)
    assert storage.get("once") == b"1"


def test_streaming_write_invisible_until_commit(storage: Storage) -> None:
    w = storage.open_write("stream/obj")
    assert isinstance(w, ObjectWriter)
    w.write(b"a" * 1000)
    w.write(memoryview(bytearray(b"b" * 24)))
    assert storage.head("stream/obj") is None
    assert [o.key for o in storage.list("stream/")] == []
    info = w.commit()
    assert info.size_bytes == 1024
    assert storage.get("stream/obj") == b"a" * 1000 + b"b" * 24


def test_abort_leaves_nothing(storage: Storage) -> None:
    w = storage.open_write("gone/obj")
    w.write(b"partial")
    w.abort()
    w.abort()  # idempotent
    assert storage.head("gone/obj") is None
    with pytest.raises(RuntimeError), storage.open_write("gone/obj2") as w2:
        w2.write(b"partial")
        raise RuntimeError("boom")
    assert storage.head("gone/obj2") is None
    assert storage.list("gone/") == []


def test_context_manager_commits(storage: Storage) -> None:
    with storage.open_write("cm/obj") as w:
        w.write(b"data")
    assert storage.get("cm/obj") == b"data"


def test_large_streaming_write(storage: Storage) -> None:
    chunk = os.urandom(1 << 20)
    with storage.open_write("big/obj") as w:
        for _ in range(40):
            w.write(chunk)
    head = storage.head("big/obj")
    assert head is not None and head.size_bytes == 40 << 20
    with storage.open_read("big/obj") as f:
        assert f.read(1 << 20) == chunk


def test_list_prefix_sorted(storage: Storage) -> None:
    for k in ["p/b", "p/a", "p/c/d", "pq/x", "other"]:
        storage.put(k, k.encode())
    assert [o.key for o in storage.list("p/")] == ["p/a", "p/b", "p/c/d"]
    assert [o.key for o in storage.list("p")] == ["p/a", "p/b", "p/c/d", "pq/x"]
    assert [o.key for o in storage.list()] == ["other", "p/a", "p/b", "p/c/d", "pq/x"]
    assert {o.key: o.size_bytes for o in storage.list("p/c")} == {"p/c/d": 5}
    assert storage.list("nothing/") == []


def test_delete_idempotent(storage: Storage) -> None:
    storage.put("d/1", b"1")
    storage.put("d/2", b"2")
    storage.delete(["d/1", "d/missing"])
    assert storage.head("d/1") is None and storage.get("d/2") == b"2"
    storage.delete(["d/1"])
    storage.delete([])


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_rejected(storage: Storage, key: str) -> None:
    with pytest.raises(InvalidKey):
        storage.put(key, b"x")
    with pytest.raises(InvalidKey):
        storage.get(key)
    with pytest.raises(InvalidKey):
        storage.head(key)
    with pytest.raises(InvalidKey):
        storage.delete([key])


def test_put_file_get_file(storage: Storage, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    data = os.urandom(3 << 20)
    src.write_bytes(data)
    assert storage.put_file("files/f", str(src)).size_bytes == len(data)
    dst = tmp_path / "out" / "dst.bin"
    dst.parent.mkdir()
    storage.get_file("files/f", str(dst))
    assert dst.read_bytes() == data


def test_open_read_streams(storage: Storage) -> None:
    storage.put("r", bytes(range(256)) * 10)
    with storage.open_read("r") as f:
        assert f.read(3) == b"\x00\x01\x02"
        assert len(f.read()) == 2560 - 3


def test_read_into_reads_a_byte_range(storage: Storage) -> None:
    """Ranged reads (issue 14): exactly the bytes asked for; a range past the end or a
    missing object is an error, never a short buffer."""
    from ckrun.errors import StorageError

    data = os.urandom(300_000)
    storage.put("r/obj.bin", data)
    buf = bytearray(1000)
    storage.read_into("r/obj.bin", 123_457, memoryview(buf))
    assert bytes(buf) == data[123_457:124_457]
    storage.read_into("r/obj.bin", 0, memoryview(buf)[:0])  # empty range: nothing to read
    with pytest.raises(StorageError):
        storage.read_into("r/obj.bin", len(data) - 10, memoryview(bytearray(20)))
    with pytest.raises(ObjectNotFound):
        storage.read_into("r/missing.bin", 0, memoryview(bytearray(4)))
