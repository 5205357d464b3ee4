"""Two-tier checkpoints: commit to the local tier, upload in the background.

:class:`TieredStorage` is a :class:`~ckrun.storage.base.Storage` over a fast *local*
tier (the VM's disk) and a durable *remote* tier (S3).  Give it to the Checkpointer as
its storage and the commit protocol runs unchanged on the local tier (fast commit); each
local commit of a manifest that the :class:`UploadPolicy` selects queues an upload that

1. copies the manifest's shards local → remote, hashing every byte read (CRC32C) and
   refusing a shard whose bytes no longer match the manifest; S3 checks the same CRC32C
   on receipt (:mod:`ckrun.storage.s3_transfer`);
2. writes the remote manifest last, with ``If-None-Match: *`` (the remote commit);
3. only then applies retention to the remote tier, never to the checkpoint just
   committed nor the one the run resumed from.

Reads fall through local → remote and listings are the union of both tiers, so a fresh
machine (empty local tier) discovers and resumes the newest remote checkpoint, streaming
it with CRC32C verification.  ``COMPLETE.json`` is uploaded after every queued upload, so
the remote marker never runs ahead of the final artifact.  Deletes act on the local tier
only; the remote tier has its own retention (step 3).

Deadline-sized emergency uploads: while a notice is pending (``notice.json``), the
selected checkpoint is always the emergency one; its expected upload time (bytes over the
measured upload throughput) is compared with the seconds left before the deadline minus
``margin_s``.  If it cannot finish, the upload is not started (the local commit stands and
the previous remote checkpoint is untouched); this is logged and recorded in
``events.jsonl`` as ``upload_skipped``.  At interpreter exit the queue is drained up to
that deadline (or fully when there is no notice).
"""

from __future__ import annotations

import atexit
import builtins
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import IO, Any

from ckrun.checkpoint.manifest import Manifest, ManifestKind, ShardInfo

from .. import control
from ..errors import ConfigError, ObjectExists, ObjectNotFound, StorageError
from ..storage.base import ObjectInfo, ObjectWriter, RangeReader, ReadsInOrder, Storage, lazy_delete
from . import layout, tiering_util
from .tiering_upload import CHUNK, copy_shard, retain_remote
from .tiering_util import HookedWriter, Pins, UploadPolicy, upload_keys

__all__ = ["CHUNK", "TieredStorage", "UploadPolicy", "open_from_env", "open_tiered"]

log = logging.getLogger(__name__)


class TieredStorage:
    """Local tier first, remote tier in the background (see the module docstring).

    Args:
        local: the fast tier (a :class:`~ckrun.storage.local.LocalStorage`).
        remote: the durable tier (an :class:`~ckrun.storage.s3.S3Storage`).
        policy: which commits are uploaded.
        keep_last, milestone_every: remote retention (same meaning as the Checkpointer's).
        margin_s: seconds kept free before a notice deadline.
        events_path: ``events.jsonl`` to record uploads in; default: next to
            ``CKRUN_CONTROL_DIR`` when supervised, else none.

    Attributes:
        stats: ``uploads``, ``skipped``, ``superseded`` (queued uploads of checkpoints
            the local tier deleted first), ``failed``, ``bytes``, ``upload_bps``
            (measured EWMA, bytes/s, None until the first upload), ``last_upload_s``.
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        *,
        policy: UploadPolicy | None = None,
        keep_last: int = 3,
        milestone_every: int | None = None,
        margin_s: float = 5.0,
        events_path: str | None = None,
    ) -> None:
        self.local, self.remote = local, remote
        self.url = remote.url
        self.policy = policy or UploadPolicy()
        self.keep_last, self.milestone_every, self.margin_s = keep_last, milestone_every, margin_s
        self.stats: dict[str, Any] = {
            "uploads": 0,
            "skipped": 0,
            "superseded": 0,
            "failed": 0,
            "bytes": 0,
            "upload_bps": None,
            "last_upload_s": None,
        }
        self._events_path = events_path or tiering_util.default_events_path()
        self._ordinal = 0
        self._jobs: deque[tuple[str, Any]] = deque()
        self._busy = 0
        # retire(): the running upload's files stay until read; no flush (lazy_delete)
        self._pins = Pins(lazy_delete(local))
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        from .lease import Fence

        self.fence = Fence.from_env(self)  # the supervisor's epoch: remote commits fenced

    def __repr__(self) -> str:
        return f"TieredStorage(local={self.local.url!r}, remote={self.remote.url!r})"

    # -- Storage protocol: writes go to the local tier --------------------------------
    def put(
        self,
        key: str,
        data: bytes | memoryview,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
    ) -> ObjectInfo:
        """Write to the local tier; a conditional update (``if_match``) goes to the
        remote tier, where compare-and-swap objects (the run's lease) live."""
        if if_match is not None:
            return self.remote.put(key, data, if_match=if_match)
        info = self.local.put(key, data, if_absent=if_absent)
        self._committed(key)
        return info

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """From the remote tier (compare-and-swap objects live there)."""
        return self.remote.get_versioned(key)

    def put_file(self, key: str, path: str) -> ObjectInfo:
        info = self.local.put_file(key, path)
        self._committed(key)
        return info

    def open_write(self, key: str) -> ObjectWriter:
        return HookedWriter(self.local.open_write(key), self._committed)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete from the local tier only (the remote tier has its own retention), now
        (a withdrawn or corrupt manifest); queued uploads of them are dropped."""
        keys = list(keys)
        self._drop_queued(keys)
        self.local.delete(keys)

    def retire(self, keys: Iterable[str]) -> None:
        """Retention's delete (:func:`~ckrun.checkpoint.retention.apply`): queued uploads
        of these keys are dropped (``superseded``) and what the running upload reads is
        deleted once it is done (:class:`Pins`): local disk stays bounded, no upload fails."""
        keys = list(keys)
        self._drop_queued(keys)
        self._pins.delete(keys)

    def _drop_queued(self, keys: list[str]) -> None:
        ks = set(keys)
        with self._cv:
            gone = [j for j in self._jobs if j[0] == "checkpoint" and j[1].key in ks]
            self._jobs = deque(j for j in self._jobs if all(j is not g for g in gone))
            self.stats["superseded"] += len(gone)
        for _, m in gone:
            log.info("upload of step %d dropped: the local tier deleted it first", m.step)

    def local_path(self, key: str) -> str | None:
        return self.local.local_path(key)

    def sweep_temp(self, prefix: str = "", min_age_s: float = 900.0) -> builtins.list[str]:
        """The local tier's temp-file sweep (used by retention), when it has one."""
        fn = getattr(self.local, "sweep_temp", None)
        return list(fn(prefix, min_age_s)) if callable(fn) else []

    # -- reads: local, then remote ----------------------------------------------------
    def get(self, key: str) -> bytes:
        try:
            return self.local.get(key)
        except ObjectNotFound:
            return self.remote.get(key)

    def get_file(self, key: str, path: str) -> None:
        tier = self.local if self.local.head(key) is not None else self.remote
        tier.get_file(key, path)

    def open_read(self, key: str) -> IO[bytes]:
        tier = self.local if self.local.head(key) is not None else self.remote
        return tier.open_read(key)

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        tier = self.local if self.local.head(key) is not None else self.remote
        tier.read_into(key, offset, buf)

    def open_ranges(self, key: str) -> RangeReader | None:
        """The tier holding ``key``'s in-order reader, when that tier offers one."""
        tier = self.local if self.local.head(key) is not None else self.remote
        return tier.open_ranges(key) if isinstance(tier, ReadsInOrder) else None

    def head(self, key: str) -> ObjectInfo | None:
        return self.local.head(key) or self.remote.head(key)

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        merged = {i.key: i for i in self.remote.list(prefix)}
        merged.update({i.key: i for i in self.local.list(prefix)})
        return [merged[k] for k in sorted(merged)]

    # -- upload queue -----------------------------------------------------------------
    def _committed(self, key: str) -> None:
        """Hook after a local write: queue what the remote tier needs."""
        if key == layout.COMPLETE:
            return self._enqueue("marker", key)
        p = layout.parse(key)
        if p is None or not p.is_manifest:
            return None
        m = Manifest.loads(self.local.get(key), key=key)
        emergency = control.preemption_requested()
        ordinal = self._ordinal
        if m.kind != ManifestKind.FINAL:
            self._ordinal += 1
        if not self.policy.selects(m, emergency=emergency, ordinal=ordinal):
            log.info(
                "step %d committed locally; not uploaded (upload_policy %s)",
                m.step,
                self.policy.mode,
            )
            return None
        if emergency and not self._fits_deadline(m):
            return None
        if emergency:
            with self._cv:  # a newer checkpoint supersedes queued, unstarted uploads
                self._jobs = deque(j for j in self._jobs if j[0] != "checkpoint")
        return self._enqueue("checkpoint", m)

    def _fits_deadline(self, m: Manifest) -> bool:
        notice = control.read_notice()
        bps = self.stats["upload_bps"]
        if notice is None or not bps:
            return True
        left = notice.seconds_left() - self.margin_s
        expected = m.total_size_bytes / bps
        if expected <= left:
            return True
        self.stats["skipped"] += 1
        msg = (
            f"emergency checkpoint step {m.step} committed to the local tier only: its "
            f"upload needs ~{expected:.1f} s at {bps / 1e6:.1f} MB/s and {left:.1f} s are "
            "left before the deadline; the previous remote checkpoint stands"
        )
        log.warning("%s", msg)
        self._event("upload_skipped", m.step, expected, seconds_left=round(left, 3), message=msg)
        return False

    def _enqueue(self, kind: str, item: Any) -> None:
        with self._cv:
            self._jobs.append((kind, item))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ckrun-upload", daemon=True)
                self._thread.start()
                atexit.register(self._drain_at_exit)
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                kind, item = self._jobs.popleft()
                self._busy += 1
                if kind == "checkpoint":  # under the lock: retire() sees it running
                    self._pins.pin(upload_keys(item))
            try:
                if kind == "checkpoint":
                    self.upload(item)
                else:
                    self.fence.check("remote completion marker")
                    self.remote.put(item, self.local.get(item))
            except Exception as e:  # logged and counted; the local commit stands
                self.stats["failed"] += 1
                step = item.step if isinstance(item, Manifest) else None
                log.error(
                    "upload of %s to %s failed: %s",
                    getattr(item, "key", item),
                    self.remote.url,
                    e,
                )
                self._event("upload_failed", step, None, error=str(e))
            finally:
                if kind == "checkpoint":
                    self._unpin(item)
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _unpin(self, m: Manifest) -> None:
        try:
            self._pins.unpin(upload_keys(m))
        except StorageError as e:  # the local tier's retention retries these deletes
            log.warning("deferred local deletes after step %d failed: %s", m.step, e)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued upload finished; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(timeout=left)
        return True

    def _drain_at_exit(self) -> None:
        notice = control.read_notice()
        timeout = None if notice is None else max(0.0, notice.seconds_left() - self.margin_s)
        if not self.flush(timeout):
            log.warning(
                "exiting with uploads unfinished (deadline); the remote tier "
                "keeps its previous checkpoint"
            )

    # -- one upload ---------------------------------------------------------------------
    def upload(self, m: Manifest) -> None:
        """Copy ``m``'s shards, then its manifest, then apply remote retention.

        Raises:
            CorruptCheckpoint: a local shard no longer matches the manifest's CRC32C.
            StorageError: the remote tier failed (nothing is committed remotely).
        """
        t0 = time.monotonic()
        nbytes = sum(self._copy_shard(s) for s in m.shards)
        body = self.local.get(m.key)
        self.fence.check(f"remote commit of step {m.step}")
        try:
            self.remote.put(m.key, body, if_absent=True)
        except ObjectExists:
            if self.remote.get(m.key) != body:
                log.warning("remote %s was committed by another attempt; kept as is", m.key)
        dt = max(time.monotonic() - t0, 1e-6)
        if nbytes:
            bps = nbytes / dt
            old = self.stats["upload_bps"]
            self.stats["upload_bps"] = bps if old is None else 0.5 * old + 0.5 * bps
        self.stats.update(
            uploads=self.stats["uploads"] + 1, last_upload_s=dt, bytes=self.stats["bytes"] + nbytes
        )
        log.info(
            "step %d committed to %s (%d bytes in %.2f s)",
            m.step,
            self.remote.url,
            nbytes,
            dt,
        )
        self._event("uploaded", m.step, dt, bytes=nbytes, remote=self.remote.url)
        self._retain_remote(m)

    def _copy_shard(self, s: ShardInfo) -> int:
        """Upload one shard unless the remote tier has it; returns bytes sent."""
        return copy_shard(self.local, self.remote, s)

    def _retain_remote(self, m: Manifest) -> None:
        self.fence.check(f"remote retention after step {m.step}")
        retain_remote(
            self.remote, m, keep_last=self.keep_last, milestone_every=self.milestone_every
        )

    def _event(self, kind: str, step: int | None, seconds: float | None, **fields: Any) -> None:
        tiering_util.record_event(self._events_path, kind, step, seconds, **fields)


def open_tiered(remote_url: str, local_dir: str, **kw: Any) -> TieredStorage:
    """``TieredStorage(LocalStorage(local_dir), open_storage(remote_url), **kw)``."""
    from ckrun.storage import open_storage
    from ckrun.storage.local import LocalStorage

    return TieredStorage(LocalStorage(local_dir), open_storage(remote_url), **kw)


def open_from_env(url: str, environ: Mapping[str, str] | None = None) -> TieredStorage | None:
    """Two-tier storage for a remote ``url`` when ``CKRUN_LOCAL_TIER`` names a directory.

    Used by :func:`ckrun.checkpoint.env.open_storage_from_env` (``ckrun.open_storage``):
    with ``CKRUN_LOCAL_TIER=/mnt/nvme/ckrun`` the run root ``s3://b/runs/NAME`` becomes
    local ``/mnt/nvme/ckrun/NAME`` + remote ``s3://b/runs/NAME``.  ``CKRUN_UPLOAD_POLICY``
    (``every``, ``milestones``, ``emergency``, ``every:N``) and ``CKRUN_REMOTE_KEEP_LAST``
    (default 3) tune it.

    Returns:
        None for a local ``url`` or when ``CKRUN_LOCAL_TIER`` is unset.

    Raises:
        ConfigError: an invalid policy or keep-last value.
    """
    env = os.environ if environ is None else environ
    base = env.get("CKRUN_LOCAL_TIER")
    if not base or "://" not in url or url.startswith("file://"):
        return None
    keep = env.get("CKRUN_REMOTE_KEEP_LAST", "3")
    if not keep.isdigit() or int(keep) < 1:
        raise ConfigError(f"CKRUN_REMOTE_KEEP_LAST={keep!r}: use an integer >= 1")
    name = url.rstrip("/").rsplit("/", 1)[-1]
    policy = UploadPolicy.parse(env.get("CKRUN_UPLOAD_POLICY", "every"))
    return open_tiered(url, os.path.join(base, name), policy=policy, keep_last=int(keep))
