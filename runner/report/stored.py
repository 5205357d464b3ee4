"""A run's history as its storage keeps it, for machines that never ran it (read-only).

The machine-local state directory (``run.json``, ``events.jsonl``) is only a cache; the
run's storage holds ``supervisor/state.json`` (:mod:`ckrun.supervisor.runstate`: the
budgets and the newest :data:`~ckrun.supervisor.runstate.MAX_EVENTS` supervisor events,
whichever machine wrote them) and the lease.  ``ckrun status`` / ``logs`` / the timeline
page read the history from both: the local events merged with the stored ones, so a
fresh machine (an empty state directory) shows the run's attempts instead of nothing,
and a machine that took a run over shows its predecessor's attempts too.

Nothing here writes: the storage is opened without the write probe of
:func:`ckrun.supervisor.preflight.open_run_storage`, and a local storage directory that
does not exist is not created.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckrun.checkpoint import layout
from ckrun.config import RunConfig
from ckrun.errors import CkrunError, ObjectNotFound
from ckrun.notices import parse_utc
from ckrun.storage.base import Storage
from ckrun.supervisor.rundir import RunDir
from ckrun.supervisor.runstate import RunRecord


def open_readonly(cfg: RunConfig) -> Storage | None:
    """The run root's storage for reading, or None when a local run root does not exist.

    Raises:
        ckrun.errors.StorageError, ConfigError: the storage cannot be opened.
    """
    return _open_readonly(cfg.run_root, cfg)


def stored_run_names(cfg: RunConfig) -> list[str]:
    """The runs under the storage base ``cfg.storage`` whose storage holds their record
    (``supervisor/state.json``) or a lease: the runs any machine ran there, whether or
    not this one keeps state for them (a local base that does not exist has none).  On
    S3: one listing of the names below the base (``Delimiter``), then a ``HEAD`` or two
    per name; the checkpoints' objects are never listed.

    Raises:
        ckrun.errors.StorageError: the base cannot be listed (credentials, network).
    """
    from ckrun.storage.s3 import S3Storage

    kept = (layout.RUN_STATE, layout.LEASE)
    base = cfg.storage
    if not base.startswith("s3://"):
        d = base.removeprefix("file://")
        names = os.listdir(d) if os.path.isdir(d) else []
        return sorted(n for n in names if any(os.path.isfile(os.path.join(d, n, k)) for k in kept))
    st = _open_readonly(base, cfg)
    assert isinstance(st, S3Storage)
    return [n for n in st.child_names() if any(st.head(f"{n}/{k}") is not None for k in kept)]


def _open_readonly(root: str, cfg: RunConfig) -> Storage | None:
    from ckrun.storage import open_storage

    if root.startswith("s3://"):
        from ckrun.config import storage_keys
        from ckrun.storage.s3 import S3Storage

        keys = set(storage_keys())
        return S3Storage.from_url(root, {k: v for k, v in cfg.cloud.items() if k in keys})
    if not os.path.isdir(root.removeprefix("file://")):
        return None
    return open_storage(root)


class StoredRunDir(RunDir):
    """A run found only in its storage: this machine's state directory for it is empty.

    ``exists`` is True and :meth:`load_config` gives the configuration the run was
    located with (storage URL, run name, S3 keys) while nothing is frozen here.
    """

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg.state_root)
        self.located = cfg

    def exists(self) -> bool:
        return True

    def load_config(self) -> RunConfig | None:
        return super().load_config() or self.located


def find_in_storage(cfg: RunConfig) -> StoredRunDir | None:
    """The run ``cfg.run`` when its storage holds its record (``supervisor/state.json``)
    or its lease, else None (no such run there, or the storage cannot be read)."""
    try:
        st = open_readonly(cfg)
        if st is None:
            return None
        for key in (layout.RUN_STATE, layout.LEASE):
            try:
                if st.head(key) is not None:
                    return StoredRunDir(cfg)
            except ObjectNotFound:
                continue
    except (CkrunError, OSError):
        return None
    return None


def run_storage(rd: RunDir) -> Storage | None:
    """The storage of the run in ``rd`` for reading; None when unknown or unreadable."""
    try:
        cfg = rd.load_config()
        return None if cfg is None else open_readonly(cfg)
    except (CkrunError, OSError):
        return None


def stored_events(storage: Storage | None) -> list[dict[str, Any]]:
    """The supervisor events kept in the run's storage (oldest first; [] when none or
    unreadable)."""
    if storage is None:
        return []
    try:
        return RunRecord.load(storage).events
    except (CkrunError, OSError):
        return []


def _key(e: dict[str, Any]) -> str:
    return json.dumps(e, sort_keys=True, default=str)


def _when(e: dict[str, Any]) -> float:
    try:
        return parse_utc(str(e.get("utc", ""))).timestamp()
    except ValueError:
        return 0.0


def merge_events(local: list[dict[str, Any]], stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The local events plus the stored ones this machine does not have, in time order
    (``utc``; ties keep stored before local and each list's own order)."""
    have = {_key(e) for e in local}
    extra = [e for e in stored if _key(e) not in have]
    if not extra:
        return local
    return sorted([*extra, *local], key=_when)


def event_line(e: dict[str, Any]) -> str:
    """One event as a text line: ``UTC attempt N KIND key=value ...``."""
    rest = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("utc", "attempt", "kind", "run"))
    return (
        f"{e.get('utc', '?')} attempt {e.get('attempt', '?')} {e.get('kind', '?')} {rest}".rstrip()
    )
