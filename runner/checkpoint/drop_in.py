"""``ckrun.save(obj, path)`` / ``ckrun.load(path)``: a ``torch.save`` drop-in (issue 15).

For scripts that save a dict of tensors, ``state_dict()`` objects and primitives
(nanoGPT's ``{"model": ..., "optimizer": ..., "iter_num": ..., "best_val_loss": ...}``):

* ``save`` writes ``path`` in the ckrun shard codec (JSON header + raw tensor bytes, no
  pickle) followed by a 24-byte trailer ``b"CKRUNTR1" | u64 shard size | u32 CRC32C |
  u32 0`` (little-endian), as a temp file, fsync, rename, fsync of the directory: ``path``
  is the old version or the complete new one, never half-written.
* ``load`` checks the trailer, the size and the CRC32C of the whole file before it
  decodes anything, and returns the dict (tensors on CPU; ``state_dict()`` objects come
  back as their state dicts, as with ``torch.load``), or restores it in place with
  ``into=``.
* Under the supervisor (``CKRUN_STORAGE`` set) ``save`` also commits the file to the
  run's storage as a file-set checkpoint (:mod:`ckrun.checkpoint.fileset`), so a
  preemption after it exits 75 and a restart on another machine finds it: ``load``
  falls back to the newest verified commit when ``path`` is missing or damaged.

Live primitives: a value may be a zero-argument callable (called at save time), and
:func:`live` binds names of a namespace (``globals()``, a config object) so that
``save`` reads their current values and ``load(path, into=state)`` writes them back.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Mapping, MutableMapping
from typing import Any

from ckrun.errors import CheckpointError, CorruptCheckpoint

TRAILER = struct.Struct("<8sQII")
TRAILER_MAGIC = b"CKRUNTR1"
_STEP_KEYS = ("iter_num", "step", "global_step", "epoch")


class Live:
    """A live reference to ``name`` in ``ns`` (a dict such as ``globals()`` or an object)."""

    def __init__(self, ns: Any, name: str):
        self.ns, self.name = ns, name

    def get(self) -> Any:
        """The current value."""
        return self.ns[self.name] if isinstance(self.ns, Mapping) else getattr(self.ns, self.name)

    def set(self, value: Any) -> None:
        """Write ``value`` back into the namespace."""
        if isinstance(self.ns, MutableMapping):
            self.ns[self.name] = value
        else:
            setattr(self.ns, self.name, value)


def live(ns: Any, *names: str) -> dict[str, Live]:
    """``{name: Live(ns, name)}`` for a state dict: ``{**ckrun.live(globals(), "iter_num")}``."""
    return {n: Live(ns, n) for n in names}


def _resolve(obj: Any) -> Any:
    """Call callables, read live references, take ``state_dict()`` of objects."""
    from ckrun.checkpoint.state import capture_value

    if isinstance(obj, Live):
        return _resolve(obj.get())
    if isinstance(obj, Mapping):
        return {k: _resolve(v) for k, v in obj.items()}
    if callable(obj) and not hasattr(obj, "state_dict"):
        return _resolve(obj())
    return capture_value(obj)


class _Bounded(io.RawIOBase):
    """The first ``limit`` bytes of a binary file (the shard before the trailer)."""

    def __init__(self, f: Any, limit: int):
        self._f, self._left = f, limit

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = self._f.readinto(mv[: min(len(mv), self._left)]) if self._left else 0
        self._left -= n or 0
        return n or 0


def save(obj: Any, path: str) -> None:
    """Write ``obj`` (a dict, or a callable returning one) to ``path`` atomically.

    Raises:
        CheckpointError: a value cannot be saved (its path and type are named).
        StorageError: the directory is full or not writable; ``path`` is unchanged.
    """
    from ckrun.checkpoint import shard as fmt
    from ckrun.storage.local import LocalStorage

    tree = _resolve(obj)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"ckrun.save needs a dict, got {type(tree).__qualname__}")
    d = os.path.dirname(os.path.abspath(path))
    w = LocalStorage(d, direct=False).open_write(os.path.basename(path))
    try:
        size, checksum = fmt.write_shard(w, fmt.snapshot(tree))
        w.write(TRAILER.pack(TRAILER_MAGIC, size, int(checksum.split(":")[1], 16), 0))
        w.commit()
    except BaseException:
        w.abort()
        raise
    if os.environ.get("CKRUN_STORAGE"):
        _commit_to_run(tree, path)


def _commit_to_run(tree: Mapping[str, Any], path: str) -> None:
    from ckrun.checkpoint import fileset
    from ckrun.checkpoint.commit import StepAlreadyCommitted
    from ckrun.checkpoint.discovery import committed
    from ckrun.checkpoint.env import env_int
    from ckrun.storage import open_storage

    storage = open_storage(os.environ["CKRUN_STORAGE"])
    step = next((int(tree[k]) for k in _STEP_KEYS if isinstance(tree.get(k), int)), None)
    if step is None:  # no step in the dict: number the versions
        ms = committed(storage)
        step = (max(m.step for m in ms) + 1) if ms else 0
    compat = (
        {"launch_hash": os.environ["CKRUN_CONFIG_HASH"]}
        if "CKRUN_CONFIG_HASH" in os.environ
        else {}
    )
    try:
        fileset.commit_files(
            storage,
            step,
            {_name(path): path},
            run=os.environ.get("CKRUN_RUN", "run"),
            attempt=env_int("CKRUN_ATTEMPT", 0),
            compat=compat,
        )
    except StepAlreadyCommitted:
        pass  # the same step saved twice (e.g. periodic then preemption): the first stands


def _name(path: str) -> str:
    rel = os.path.relpath(os.path.abspath(path))
    return rel if not rel.startswith("..") else os.path.basename(path)


def _read(f: Any, size: int, key: str) -> dict[str, Any]:
    """Verify the trailer, size and CRC32C of a :func:`save` file, then decode it."""
    from ckrun.checkpoint.shard_reader import read_shard

    if size < TRAILER.size:
        raise CorruptCheckpoint(f"{key}: {size} bytes, too short for a ckrun file", key=key)
    f.seek(size - TRAILER.size)
    magic, n, crc, _ = TRAILER.unpack(f.read(TRAILER.size))
    if magic != TRAILER_MAGIC:
        raise CorruptCheckpoint(
            f"{key}: no ckrun trailer (not written by ckrun.save, or truncated)", key=key
        )
    if n != size - TRAILER.size:
        raise CorruptCheckpoint(f"{key}: trailer says {n} bytes, file has {size}", key=key)
    f.seek(0)
    tree = read_shard(
        io.BufferedReader(_Bounded(f, n)), size_bytes=n, checksum=f"crc32c:{crc:08x}", key=key
    )
    if not isinstance(tree, dict):
        raise CorruptCheckpoint(f"{key}: not a dict", key=key)
    return tree


def _read_file(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return _read(f, os.fstat(f.fileno()).st_size, path)


def loads(raw: bytes, *, key: str = "<bytes>") -> dict[str, Any]:
    """:func:`load` from the bytes of a :func:`save` file (verified the same way)."""
    return _read(io.BytesIO(raw), len(raw), key)


def load(path: str, into: MutableMapping[str, Any] | None = None) -> dict[str, Any]:
    """Read ``path`` written by :func:`save`, verified before anything is decoded.

    Args:
        into: a state dict like the one saved: ``state_dict()`` objects get
            ``load_state_dict``, tensors ``copy_``, :class:`Live` references ``set``,
            other entries are replaced.

    Returns:
        The saved dict.

    Raises:
        FileNotFoundError: no ``path`` and (under the supervisor) no committed copy.
        CorruptCheckpoint: ``path`` is damaged and no committed copy verifies.
    """
    try:
        tree = _read_file(path)
    except (FileNotFoundError, CorruptCheckpoint) as e:
        tree = _from_run(path, e)
    if into is not None:
        _restore(into, tree)
    return tree


def _from_run(path: str, err: Exception) -> dict[str, Any]:
    if not os.environ.get("CKRUN_STORAGE"):
        raise err
    from ckrun.checkpoint import fileset
    from ckrun.storage import open_storage

    fs = fileset.newest(open_storage(os.environ["CKRUN_STORAGE"]), prefix=_name(path))
    if fs is None or _name(path) not in fs.files:
        raise err
    fs.extract(_name(path), path)
    return _read_file(path)


def _restore(into: MutableMapping[str, Any], tree: Mapping[str, Any]) -> None:
    from ckrun.checkpoint.state import restore_into

    lives = {k: v for k, v in into.items() if isinstance(v, Live)}
    rest = {k: v for k, v in into.items() if k not in lives}
    restore_into(rest, {k: v for k, v in tree.items() if k in rest}, "ckrun.load", top=False)
    into.update({k: v for k, v in rest.items() if not isinstance(into.get(k), Live)})
    for k, ref in lives.items():
        if k in tree:
            ref.set(tree[k])
