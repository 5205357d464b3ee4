"""Small durable-file helpers shared by the supervisor and the training-side library."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable
from typing import Any

__all__ = ["fsync_dir", "write_json_atomic", "write_pieces", "write_pieces_atomic"]


def write_json_atomic(path: str, body: dict[str, Any], *, durable: bool = True) -> None:
    """Write ``body`` to ``path`` via a temp file, (fsync) and ``os.replace``.

    Args:
        durable: fsync the file before the rename (skip for records that only matter
            while this process lives, such as the lock holder).
    """
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_pieces(path: str, pieces: Iterable[bytes | memoryview]) -> None:
    """Create ``path`` from ``pieces`` written in order, then fsync it (not atomic: for a
    temporary name that a rename publishes)."""
    with open(path, "wb") as f:
        for part in pieces:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


def write_pieces_atomic(path: str, pieces: Iterable[bytes | memoryview]) -> None:
    """Write ``pieces`` to ``path`` atomically: a temp file in the same directory, fsync,
    ``os.replace``, fsync of the directory.  An exception from ``pieces`` (a failed
    checksum, say) removes the temp file and leaves ``path`` as it was."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckrun-restore-", dir=d)
    os.close(fd)
    try:
        write_pieces(tmp, pieces)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def fsync_dir(d: str) -> None:
    """fsync the directory ``d`` (makes a rename or a new entry in it durable)."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
