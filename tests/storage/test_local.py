"""LocalStorage beyond the contract: real ENOSPC and EROFS, killed writers, temp files."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckrun.errors import StorageFull, StoragePermissionError
from ckrun.storage import local as local_mod
from ckrun.storage.local import TEMP_PREFIX, LocalStorage


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_enospc_on_a_full_filesystem(small_fs: Path) -> None:
    st = LocalStorage(str(small_fs / "run"))
    st.put("keep", b"previous")
    w = st.open_write("big/obj")
    with pytest.raises(StorageFull) as ei:
        for _ in range(8):
            w.write(b"\0" * (1 << 20))
        w.commit()
    w.abort()
    assert "big/obj" in str(ei.value) and "bytes" in str(ei.value)
    assert ei.value.path.endswith("big/obj") and ei.value.needed_bytes
    assert st.head("big/obj") is None
    assert st.get("keep") == b"previous"
    assert _files(small_fs / "run") == ["keep"]


def test_put_enospc_leaves_no_temp(small_fs: Path) -> None:
    st = LocalStorage(str(small_fs / "run"))
    with pytest.raises(StorageFull):
        st.put("x", b"\0" * (4 << 20))
    assert _files(small_fs / "run") == []


def test_read_only_filesystem(ro_fs: Path) -> None:
    st = LocalStorage(str(ro_fs))
    assert st.get("existing") == b"x"
    with pytest.raises(StoragePermissionError, match="read-only"):
        st.put("new", b"y")
    with pytest.raises(StoragePermissionError):
        st.open_write("dir/new")
    with pytest.raises(StoragePermissionError):
        LocalStorage(str(ro_fs / "sub"))


def test_enospc_at_nth_write_fault_injection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (the OS write is replaced for this module only): the 3rd write
    of a streaming object fails with ENOSPC, on any filesystem and without root."""
    st = LocalStorage(str(tmp_path / "run"))
    real_write = os.write
    calls = {"n": 0}

    def failing_write(fd: int, data: object) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)  # type: ignore[arg-type]

    monkeypatch.setattr(local_mod.os, "write", failing_write)
    w = LocalStorage(str(tmp_path / "run"), direct=False).open_write("obj")
    with pytest.raises(StorageFull, match="no space left"):
        for _ in range(5):
            w.write(b"z" * (64 << 10))  # not gathered: each one a write(2)
    w.abort()
    assert st.head("obj") is None and _files(tmp_path / "run") == []
    calls["n"] = 2  # small writes are gathered: the failure surfaces at the commit
    w = LocalStorage(str(tmp_path / "run"), direct=False).open_write("obj")
    with pytest.raises(StorageFull, match="no space left"):
        for _ in range(5):
            w.write(b"z" * 1000)
        w.commit()
    w.abort()
    assert st.head("obj") is None and _files(tmp_path / "run") == []
    calls["n"] = 0
    d = st.open_write("obj2")  # the O_DIRECT writer: the error surfaces from its thread
    with pytest.raises(StorageFull, match="no space left"):
        for _ in range(5):
            d.write(b"z" * (16 << 20))
        d.commit()
    d.abort()
    assert st.head("obj2") is None and _files(tmp_path / "run") == []


def test_direct_writer_sizes_and_fallback(tmp_path: Path, small_fs: Path) -> None:
    from ckrun.storage.direct import DirectWriter

    st = LocalStorage(str(tmp_path / "run"))
    for n in (0, 1, 4095, 4096, 4097, (16 << 20) + 3):
        data = os.urandom(n)
        w = st.open_write(f"o{n}")
        assert isinstance(w, DirectWriter)
        w.write(data[: n // 2])
        w.write(data[n // 2 :])
        assert w.commit().size_bytes == n
        assert st.get(f"o{n}") == data
    tiny = LocalStorage(str(small_fs / "r"))  # tmpfs: O_DIRECT may be refused → buffered
    with tiny.open_write("x") as w2:
        w2.write(b"abc")
    assert tiny.get("x") == b"abc"


def test_killed_writer_leaves_only_an_invisible_temp(tmp_path: Path) -> None:
    root = tmp_path / "run"
    code = (
        "import sys; from ckrun.storage.local import LocalStorage\n"
        f"w = LocalStorage({str(root)!r}).open_write('a/obj')\n"
        "w.write(b'x' * 4096); print('ready', flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    st = LocalStorage(str(root))
    assert st.head("a/obj") is None and st.list() == []
    temps = [f for f in _files(root) if os.path.basename(f).startswith(TEMP_PREFIX)]
    assert len(temps) == 1
    assert st.sweep_temp("a", min_age_s=3600) == []  # too young
    old = time.time() - 7200
    os.utime(root / temps[0], (old, old))
    assert st.sweep_temp("a", min_age_s=3600) == temps
    assert _files(root) == []


def test_sweep_keeps_own_temp_files(tmp_path: Path) -> None:
    st = LocalStorage(str(tmp_path))
    w = st.open_write("k")
    w.write(b"1")
    assert st.sweep_temp("", min_age_s=0) == []
    w.commit()
    assert st.get("k") == b"1"


def test_symlinks_are_not_objects(tmp_path: Path) -> None:
    st = LocalStorage(str(tmp_path / "r"))
    st.put("real", b"1")
    (tmp_path / "outside").write_bytes(b"secret")
    os.symlink(tmp_path / "outside", tmp_path / "r" / "link")
    assert [o.key for o in st.list()] == ["real"]
    assert st.head("link") is None


def test_delete_prunes_empty_directories(tmp_path: Path) -> None:
    st = LocalStorage(str(tmp_path / "r"))
    st.put("a/b/c", b"1")
    st.put("a/keep", b"2")
    st.delete(["a/b/c"])
    assert not (tmp_path / "r" / "a" / "b").exists()
    assert (tmp_path / "r" / "a" / "keep").exists()


def test_list_skips_an_object_deleted_while_it_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention deletes old step directories on a background thread while a save,
    finalize or load lists the run: an entry that vanishes between the directory read and
    its stat is no longer an object, never a FileNotFoundError out of ``list`` (seen in a
    spot end-to-end run: finalize died listing a step retention had just removed)."""
    st = LocalStorage(str(tmp_path))
    for step in (1, 2):
        st.put(f"checkpoints/step-{step}/manifest.json", b"{}")
        st.put(f"checkpoints/step-{step}/shard.bin", b"x" * 10)
    real = os.scandir
    doomed = tmp_path / "checkpoints" / "step-1"

    def scandir_then_retention(d: str):  # type: ignore[no-untyped-def]
        entries = list(real(d))  # what the walk read ...
        if os.path.realpath(d) == os.path.realpath(doomed):
            for p in doomed.iterdir():  # ... before retention removed the step
                p.unlink()
        return iter(entries)

    monkeypatch.setattr(local_mod.os, "scandir", scandir_then_retention)
    keys = [o.key for o in st.list("checkpoints/")]
    assert keys == ["checkpoints/step-2/manifest.json", "checkpoints/step-2/shard.bin"]


def test_conditional_put_takes_its_version_without_reading_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 (small saves): a manifest's conditional create hashed its bytes while
    writing; reading the file back for the version token cost a second open and read
    per commit.  The token is the same one ``get_versioned`` reads."""
    from ckrun.storage import local_writer

    st = LocalStorage(str(tmp_path))

    def no_read_back(path: str) -> tuple[bytes, str]:
        raise AssertionError(f"read back {path}")

    with monkeypatch.context() as m:
        m.setattr(local_writer, "read_versioned", no_read_back)
        created = st.put("cas/obj", b"v1" * 1000, if_absent=True)
        other = st.put("cas/obj2", b"x", if_absent=True)
    assert st.get_versioned("cas/obj") == (b"v1" * 1000, created.version)
    assert st.get_versioned("cas/obj2")[1] == other.version


def test_a_small_unreferenced_object_skips_the_staging_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19 (small states): an object that fits in one O_DIRECT staging buffer was
    copied into it and then written through the page cache at the commit anyway; a
    caller that knows the size gets the buffered writer at once (no staging copy, no
    I/O thread pool).  Larger or unknown sizes keep the probe's O_DIRECT writer."""
    import torch
    from ckrun import Checkpointer
    from ckrun.storage.direct import DirectWriter, stage_bytes
    from ckrun.storage.local_writer import LocalWriter

    monkeypatch.setenv("CKRUN_WRITER", "direct:4")
    st = LocalStorage(str(tmp_path / "run"))
    small = st.open_unreferenced("u/a", size_hint=stage_bytes(4))
    assert type(small) is LocalWriter
    for key, hint in (("u/b", stage_bytes(4) + 1), ("u/c", None)):
        w = st.open_unreferenced(key, size_hint=hint)
        assert isinstance(w, DirectWriter) or not st.direct  # tmpfs refuses O_DIRECT
        assert w is not None
        w.abort()
    assert small is not None
    data = os.urandom(300_000)
    small.write(data)
    small.commit()
    st.put_after("u/manifest", b"names u/a", [small], if_absent=True)
    assert st.get("u/a") == data

    def no_direct_writer(*a: object, **k: object) -> None:
        raise AssertionError("a 1 MB shard was staged for O_DIRECT")

    monkeypatch.setattr(DirectWriter, "__init__", no_direct_writer)
    state = {"w": torch.arange(250_000, dtype=torch.float32)}
    ck = Checkpointer(storage=str(tmp_path / "ck"), rng=False, lock=False)
    ck.save(1, state)
    back = {"w": torch.zeros(250_000)}
    assert ck.load(back) is not None and torch.equal(back["w"], state["w"])
    ck.close()


def test_make_dirs_creates_missing_parents_and_names_each_new_entrys_parent(
    tmp_path: Path,
) -> None:
    """``make_dirs`` makes a missing directory and its missing parents (the ``mkdir``
    first, the parents only when it reports one missing) and returns the directories
    whose entries changed, deepest first; an existing directory changes nothing; a file
    in the way is a storage error naming its path."""
    from ckrun.errors import StorageError
    from ckrun.storage.fsutil import make_dirs

    root = str(tmp_path)
    assert make_dirs(root, f"{root}/a", sync=False) == [root]
    assert make_dirs(root, f"{root}/a/b/c", sync=False) == [f"{root}/a/b", f"{root}/a"]
    assert os.path.isdir(f"{root}/a/b/c")
    assert make_dirs(root, f"{root}/a/b/c", sync=False) == []
    assert make_dirs(root, root, sync=False) == []
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(StorageError, match=re.escape(f"{root}/f:")):
        make_dirs(root, f"{root}/f", sync=False)
    with pytest.raises(StorageError, match=re.escape(f"{root}/f")):
        make_dirs(root, f"{root}/f/g", sync=False)
    with pytest.raises(StorageError):  # the storage's root itself is never made
        make_dirs(f"{root}/gone", f"{root}/gone/x", sync=False)
