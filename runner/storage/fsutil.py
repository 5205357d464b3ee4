"""Small durable-file helpers shared by the supervisor and the training-side library."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

__all__ = ["write_json_atomic"]


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
