"""Version tokens of local files: what a conditional write of
:class:`~ckrun.storage.local.LocalStorage` compares (``if_match``) and returns.

A token is the file's inode, its mtime in nanoseconds and the first 64 bits of the
SHA-256 of its bytes (:func:`version_of`).
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["read_versioned", "token", "version_of"]


def version_of(st: os.stat_result, data: bytes | memoryview) -> str:
    """A file's version token: inode, mtime (ns) and the first 64 bits of its SHA-256.

    A conditional write always renames a new file (a new inode while the old one
    exists), so a token names one write; the content hash keeps a reused inode number
    with a coarse mtime from ever matching an older token for different bytes.
    """
    return token(st, hashlib.sha256(memoryview(data).cast("B")).hexdigest())


def token(st: os.stat_result, sha256_hex: str) -> str:
    """The version token of a file with stat ``st`` and content SHA-256 ``sha256_hex``
    (:func:`version_of`)."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{sha256_hex[:16]}"


def read_versioned(path: str) -> tuple[bytes, str]:
    """The file's bytes and version token from one open.

    Raises:
        OSError: FileNotFoundError when absent, or another read error.
    """
    with open(path, "rb") as f:
        data = f.read()
        return data, version_of(os.fstat(f.fileno()), data)
