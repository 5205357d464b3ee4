"""Load at read speed (issue 19): format-2 tensors are read straight into the live
tensors, and a checkpoint that fails its CRC32C after part of it landed there is never
left in use (ckrun.checkpoint.inplace_load).  Real files, real flipped bytes."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import ckrun
import pytest
import torch
from ckrun.checkpoint import piece_read
from ckrun.errors import IncompatibleCheckpoint, StateUnusable


@pytest.fixture(params=["inline", "beside the next read"])
def checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where a piece's CRC32C is checked: these states' pieces (16 KB) are under
    OVERLAP_BYTES and checked inline; at 1 byte every piece is checked on the checker
    thread beside the next read, as a big model's are."""
    if request.param != "inline":
        monkeypatch.setattr(piece_read, "OVERLAP_BYTES", 1)
    return str(request.param)


def _state(seed: int, *, step: bool = True, reverse: bool = False) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)
    )
    params = list(model.parameters())
    opt = torch.optim.AdamW(params[::-1] if reverse else params, lr=1e-2)
    if step:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": opt, "extra": {"step": seed}}


def _ck(run_dir: Path, **kw: Any) -> ckrun.Checkpointer:
    return ckrun.Checkpointer(storage=str(run_dir), rng=False, lock=False, **kw)


def _values(s: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the state by a stable name: parameters by module name, optimizer
    state by the parameter's module name (not its position)."""
    names = {id(p): n for n, p in s["model"].named_parameters()}
    out = {f"model.{k}": v.detach().clone() for k, v in s["model"].state_dict().items()}
    for p, st in s["optimizer"].state.items():
        for k, v in st.items():
            out[f"opt.{names[id(p)]}.{k}"] = v.detach().clone()
    return out


def _pointers(s: dict[str, Any]) -> dict[str, int]:
    names = {id(p): n for n, p in s["model"].named_parameters()}
    out = {f"model.{k}": v.data_ptr() for k, v in s["model"].state_dict().items()}
    for p, st in s["optimizer"].state.items():
        for k, v in st.items():
            out[f"opt.{names[id(p)]}.{k}"] = v.data_ptr()
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1), b[k].view(-1)) for k in a
    )


def _flip_last_piece(run_dir: Path, m: ckrun.Manifest) -> None:
    """Flip one byte in the middle of the piece stored last in the shard file: every
    other piece is read (in place) before the damaged one is found."""
    assert m.tensor_layout is not None
    b, e, _ = max(m.tensor_layout["shards"][0]["entries"].values(), key=lambda x: x[0])
    _flip(run_dir / m.shards[0].key, (b + e) // 2)


def _flip(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())


def test_load_is_in_place_and_bitwise_equal(run_dir: Path, checks: str) -> None:
    saved = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, saved)
    want = _values(saved)
    fresh = _state(2)
    before = _pointers(fresh)
    assert not _equal(_values(fresh), want)
    with _ck(run_dir) as ck:
        m = ck.load(fresh)
    assert m is not None and m.step == 1
    assert _equal(_values(fresh), want)  # bitwise the checkpoint
    assert _pointers(fresh) == before  # the live tensors received the bytes: in place
    assert fresh["extra"] == {"step": 1}


def test_flipped_byte_mid_shard_restores_the_previous_good_checkpoint(
    run_dir: Path, caplog: pytest.LogCaptureFixture, checks: str
) -> None:
    s = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, s)
        good = _values(s)
        with torch.no_grad():
            for p in s["model"].parameters():
                p.add_(1.0)
        for st in s["optimizer"].state.values():
            st["exp_avg"].mul_(3.0)
        m2 = ck.save(2, s)
    assert m2.shards[0].size_bytes > 0
    _flip(run_dir / m2.shards[0].key, m2.shards[0].size_bytes // 2)  # the middle
    fresh = _state(3)
    before = _pointers(fresh)
    with _ck(run_dir) as ck, caplog.at_level(logging.WARNING):
        got = ck.load(fresh)
        assert got is not None and got.step == 1
        assert any("step 2" in x and "checksum mismatch" in x for x in ck.skipped)
        ck.save(3, fresh)  # the state is usable: saves are not refused
    # part of step 2 was read in place before its damage was found ...
    assert "tensors were read in place; checkpoint step 1 was restored over every" in caplog.text
    # ... and step 1 was restored over all of it, in place
    assert _equal(_values(fresh), good)
    assert _pointers(fresh) == before


def test_damaged_only_checkpoint_stops_and_refuses_saves(run_dir: Path, checks: str) -> None:
    """Nothing older to restore over a half-written state: the load raises
    StateUnusable (exit 5, the supervisor restarts the process) and no save of that
    state is ever committed."""
    with _ck(run_dir) as ck:
        m = ck.save(1, _state(1))
    _flip_last_piece(run_dir, m)
    fresh = _state(2)
    with _ck(run_dir) as ck:
        with pytest.raises(StateUnusable, match="unusable"):
            ck.load(fresh)
        with pytest.raises(StateUnusable):
            ck.save(2, fresh)
        with pytest.raises(StateUnusable):
            ck.async_save(2, fresh).result()
    assert StateUnusable.exit_code == 5
    with _ck(run_dir) as ck:  # nothing was committed from the half-loaded state
        from ckrun.checkpoint.discovery import scan

        assert [x.step for x in scan(ck.storage).manifests] == [1]


def test_older_checkpoint_that_lacks_a_written_tensor_stops(run_dir: Path) -> None:
    """Step 1 has no ``ema``; the damaged step 2 wrote it in place: restoring step 1
    leaves ``ema`` half-loaded and in use, so the load refuses to return."""
    s = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, s)
        s["ema"] = torch.full((4096,), 7.0)
        m2 = ck.save(2, s)
    _flip_last_piece(run_dir, m2)
    fresh = _state(2)
    fresh["ema"] = torch.zeros(4096)
    with _ck(run_dir) as ck, pytest.raises(StateUnusable, match="ema"):
        ck.load(fresh)


def test_optimizer_state_before_its_first_step_loads(run_dir: Path) -> None:
    saved = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, saved)
    fresh = _state(2, step=False)
    assert not fresh["optimizer"].state
    with _ck(run_dir) as ck:
        assert ck.load(fresh) is not None
    assert _equal(_values(fresh), _values(saved))


def test_optimizer_state_follows_parameter_names_in_place(run_dir: Path) -> None:
    """The loading optimizer lists the parameters in reverse order: each parameter gets
    the Adam moments saved under its own name, in its own existing tensors."""
    saved = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, saved)
    fresh = _state(2, reverse=True)
    before = _pointers(fresh)
    with _ck(run_dir) as ck:
        assert ck.load(fresh) is not None
    assert _equal(_values(fresh), _values(saved))
    assert _pointers(fresh) == before


def test_dtype_change_falls_back_to_a_fresh_tensor(run_dir: Path) -> None:
    saved = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, saved)
    fresh = _state(2)
    fresh["model"][1].double()  # the LayerNorm in float64: allowed, then converted
    with _ck(run_dir, allow_change=("signature",)) as ck:
        assert ck.load(fresh) is not None
    ln = fresh["model"][1]
    assert ln.weight.dtype == torch.float64
    assert torch.equal(ln.weight, saved["model"][1].weight.double())
    assert torch.equal(fresh["model"][0].weight, saved["model"][0].weight)


def test_shape_change_is_refused_before_anything_is_written(run_dir: Path) -> None:
    with _ck(run_dir) as ck:
        ck.save(1, _state(1))
    fresh = _state(2)
    fresh["model"][2] = torch.nn.Linear(64, 32)
    fresh["optimizer"] = torch.optim.AdamW(fresh["model"].parameters())
    before = _values(fresh)
    with _ck(run_dir) as ck, pytest.raises(IncompatibleCheckpoint):
        ck.load(fresh)
    assert _equal(_values(fresh), before)


def test_many_pieces_per_tensor_land_in_place(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces of 3 rows: each tensor is many ranged reads, several in flight, each into
    its own rows of the destination."""
    monkeypatch.setenv("CKRUN_PIECE_BYTES", str(3 * 64 * 4))
    saved = _state(1)
    with _ck(run_dir) as ck:
        m = ck.save(1, saved)
    assert m.tensor_layout is not None
    assert len(m.tensor_layout["tensors"]["user.model.0.weight"]["pieces"]) == 22
    fresh = _state(2)
    before = _pointers(fresh)
    with _ck(run_dir) as ck:
        assert ck.load(fresh) is not None
    assert _equal(_values(fresh), _values(saved))
    assert _pointers(fresh) == before


def test_local_shard_is_read_front_to_back_through_one_descriptor(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19: on a local disk the pieces of a shard are read in file order through one
    descriptor with the sequential readahead hint (parallel ranged reads on fresh
    descriptors were 0.66× the cold read of the same bytes: bench/README.md)."""
    from ckrun.storage.local import LocalStorage
    from ckrun.storage.local_read import LocalRanges

    monkeypatch.setenv("CKRUN_PIECE_BYTES", str(3 * 64 * 4))
    saved = _state(1)
    with _ck(run_dir) as ck:
        m = ck.save(1, saved)
    opened: list[str] = []
    offsets: list[int] = []
    advice: list[int] = []
    real_open, real_read = LocalStorage.open_ranges, LocalRanges.read_into
    real_fadvise = os.posix_fadvise

    def open_ranges(self: LocalStorage, key: str) -> LocalRanges:
        opened.append(key)
        return real_open(self, key)

    def read_into(self: LocalRanges, offset: int, buf: memoryview) -> None:
        if not inside:  # not through LocalStorage.read_into
            offsets.append(offset)
        real_read(self, offset, buf)

    ranged: list[int] = []
    real_ranged = LocalStorage.read_into

    inside: list[bool] = []

    def one_range(self: LocalStorage, key: str, offset: int, buf: memoryview) -> None:
        ranged.append(offset)  # the header and the rank-local entries (RNG) only
        inside.append(True)
        try:
            real_ranged(self, key, offset, buf)
        finally:
            inside.clear()

    def fadvise(fd: int, offset: int, length: int, adv: int) -> None:
        advice.append(adv)
        real_fadvise(fd, offset, length, adv)

    monkeypatch.setattr(LocalStorage, "open_ranges", open_ranges)
    monkeypatch.setattr(LocalRanges, "read_into", read_into)
    monkeypatch.setattr(LocalStorage, "read_into", one_range)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    fresh = _state(2)
    with _ck(run_dir) as ck:
        assert ck.load(fresh) is not None
    assert m.tensor_layout is not None
    entries = m.tensor_layout["shards"][0]["entries"]
    pieces = {entries[p[1]][0] for t in m.tensor_layout["tensors"].values() for p in t["pieces"]}
    assert opened == [m.shards[0].key]
    assert len(offsets) > 22 and offsets == sorted(offsets) and set(offsets) == pieces
    assert not pieces & set(ranged)
    assert advice == [os.POSIX_FADV_SEQUENTIAL]
    assert _equal(_values(fresh), _values(saved))


def test_a_storage_declining_ordered_reads_reads_pieces_in_flight(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage whose ``open_ranges`` declines (a remote tier) gets independent ranged
    reads, several in flight, with the same result in place."""
    from ckrun.storage.local import LocalStorage

    monkeypatch.setenv("CKRUN_PIECE_BYTES", str(3 * 64 * 4))
    saved = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, saved)
    ranged: list[int] = []
    real_read = LocalStorage.read_into

    def read_into(self: LocalStorage, key: str, offset: int, buf: memoryview) -> None:
        ranged.append(offset)
        real_read(self, key, offset, buf)

    monkeypatch.setattr(LocalStorage, "open_ranges", lambda self, key: None)
    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    fresh = _state(2)
    before = _pointers(fresh)
    with _ck(run_dir) as ck:
        assert ck.load(fresh) is not None
    assert len(ranged) > 22
    assert _equal(_values(fresh), _values(saved)) and _pointers(fresh) == before


def test_a_piece_is_checked_while_the_next_one_is_read(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19: a local shard's big pieces are checked (CRC32C) on a second thread
    while the next piece is read, not between the reads: the first check waits until
    a read starts after it began, which a check in series never sees (it waits out its
    10 s and records False)."""
    from ckrun.storage.local_read import LocalRanges

    monkeypatch.setenv("CKRUN_PIECE_BYTES", str(3 * 64 * 4))
    monkeypatch.setattr(piece_read, "OVERLAP_BYTES", 1)
    saved = _state(1)
    with _ck(run_dir) as ck:
        ck.save(1, saved)
    reads: list[int] = []
    check_began, read_beside = threading.Event(), threading.Event()
    overlapped: list[bool] = []
    checkers: set[str] = set()
    real_read, real_crc = LocalRanges.read_into, piece_read.crc32c.crc32c

    def read_into(self: LocalRanges, offset: int, buf: memoryview) -> None:
        reads.append(offset)
        if check_began.is_set():
            read_beside.set()
        real_read(self, offset, buf)

    class Crc:
        @staticmethod
        def crc32c(data: memoryview) -> int:
            if not overlapped:
                check_began.set()
                overlapped.append(read_beside.wait(10))
            checkers.add(threading.current_thread().name)
            return int(real_crc(data))

    monkeypatch.setattr(LocalRanges, "read_into", read_into)
    monkeypatch.setattr(piece_read, "crc32c", Crc)
    fresh = _state(2)
    before = _pointers(fresh)
    with _ck(run_dir) as ck:
        assert ck.load(fresh) is not None
    assert overlapped == [True]
    assert len(reads) > 22 and all(n.startswith("ckrun-verify") for n in checkers)
    assert _equal(_values(fresh), _values(saved)) and _pointers(fresh) == before
