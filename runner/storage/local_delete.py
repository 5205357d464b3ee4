"""Deleting local objects (:class:`ckrun.storage.local.LocalStorage`): unlinking keys,
removing the directories they leave empty, and sweeping temp files of killed writers.

A durable delete (:meth:`~ckrun.storage.local.LocalStorage.delete`, the storage
contract's) fsyncs the first directory left standing: one journal commit and one device
cache flush.  A lazy one (:meth:`~ckrun.storage.local.LocalStorage.delete_lazily`,
:class:`ckrun.storage.base.DeletesLazily`; retention) does not: its unlinks and
directory removals are visible at once and durable with the filesystem's next journal
commit (on ext4 and xfs the next save's fsync, which commits the whole journal, at the
latest the commit interval: 5 s on ext4; btrfs commits its unlinks at its own interval,
30 s).  ext4 and xfs journal metadata operations in order, so after a crash a prefix of
them holds.  Space freed lazily is reused once that commit is made; both filesystems
force the commit when an allocation would fail otherwise (ext4
``ext4_should_retry_alloc``, xfs busy extents).  Measured: two flushes fewer per
retention pass; on the benchmark's loop-device disk the saves after a pass fell into
its slow periods far less often (16 of 32 blocks against 2 of 32; bench/README.md,
"Twentieth session").
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from ckrun.errors import map_os_error
from ckrun.storage.local_writer import TEMP_PREFIX, fsync_dir


def unlink_all(root: str, paths: Iterable[str], *, sync: bool) -> None:
    """Unlink ``paths`` (missing ones ignored) and remove the directories left empty
    under ``root`` (never ``root``); with ``sync``, fsync the first directory left
    standing on each branch (a failure to fsync it is ignored: the unlinks are done).

    Raises:
        StorageError: a path could not be unlinked (``map_os_error``).
    """
    dirs: set[str] = set()
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise map_os_error(e, path=p) from e
        dirs.add(os.path.dirname(p))
    for d in sorted(dirs, key=len, reverse=True):
        while d != root and d.startswith(root + os.sep):
            try:
                os.rmdir(d)
            except OSError:  # not empty (or gone): it stays
                break
            d = os.path.dirname(d)
        if sync:
            try:
                fsync_dir(d)
            except OSError:
                pass


def sweep_temp(root: str, top: str, min_age_s: float) -> list[str]:
    """Remove temp files of other processes under ``top`` not modified for
    ``min_age_s`` seconds; returns their paths relative to ``root``."""
    removed: list[str] = []
    now = time.time()
    mine = f"{TEMP_PREFIX}{os.getpid()}-"
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            if not name.startswith(TEMP_PREFIX) or name.startswith(mine):
                continue
            p = os.path.join(dirpath, name)
            try:
                if now - os.stat(p).st_mtime >= min_age_s:
                    os.unlink(p)
                    removed.append(os.path.relpath(p, root))
            except OSError:
                continue
    return removed
