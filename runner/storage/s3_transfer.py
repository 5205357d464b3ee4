"""Streaming S3 writes with end-to-end CRC32C (used by :mod:`ckrun.storage.s3`; reads are
:mod:`ckrun.storage.s3_read`, the client and its errors :mod:`ckrun.storage.s3_client`).

:class:`S3Writer` buffers up to ``multipart_threshold_bytes``; a smaller object becomes one
``PutObject``, a larger one a multipart upload of ``multipart_chunk_bytes`` parts sent by
up to ``max_concurrency`` threads.  Every request carries its CRC32C (``x-amz-checksum-
crc32c``) and the multipart upload is created with ``ChecksumType=FULL_OBJECT``, so S3
verifies each part and the whole object against checksums computed here while the data
streamed through (S3 "Checking object integrity"; full-object CRC32C for multipart since
2025).  The object is invisible until :meth:`S3Writer.commit` (``CompleteMultipartUpload``
or the single PUT); any failure aborts the upload.  ``if_absent`` sends
``If-None-Match: *`` on the PUT / completion (S3 conditional writes), so two writers can
never both create one key.

The checksums are computed with the ``crc32c`` package instead of botocore's
``ChecksumAlgorithm="CRC32C"``, which needs the optional ``awscrt`` dependency.
"""

from __future__ import annotations

import base64
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import crc32c
from ckrun.errors import (
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    StorageError,
)
from ckrun.storage import priority
from ckrun.storage.base import ObjectInfo
from ckrun.storage.s3_options import S3Options

#: User metadata key holding the object's CRC32C (single PUTs), read back by every GET so
#: the check does not depend on the store returning ``x-amz-checksum-crc32c``.
CRC_META = "ckrun-crc32c"


def b64crc(value: int) -> str:
    """The wire form of a CRC32C (base64 of the 4 big-endian bytes), as S3 sends it."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class RateLimiter:
    """A token bucket shared by all uploads of one storage: at most ``bytes_per_s``.

    ``bytes_per_s <= 0`` disables the cap.  Burst: a quarter second's worth.
    """

    BURST_S = 0.25

    def __init__(self, bytes_per_s: int) -> None:
        self.rate = float(bytes_per_s)
        self._lock = threading.Lock()
        self._tokens = self.rate * self.BURST_S
        self._t = time.monotonic()

    def acquire(self, n: int) -> None:
        """Block until ``n`` bytes may be sent."""
        if self.rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate * self.BURST_S, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class S3Bucket(Protocol):
    """What :class:`S3Writer` uses of its storage (:class:`ckrun.storage.s3.S3Storage`)."""

    @property
    def options(self) -> S3Options: ...

    @property
    def limiter(self) -> RateLimiter: ...

    def object_key(self, key: str) -> str: ...

    def call(self, op: str, key: str, **kw: Any) -> Any: ...


class S3Writer:
    """A streaming write to one key (see :class:`ckrun.storage.base.ObjectWriter`).

    Attributes:
        key: the destination key (relative to the storage root).
        bytes_written: bytes accepted so far.
        crc: running CRC32C of the bytes written (int).
        version: the ETag S3 returned for the committed object (None before commit).

    ``if_absent`` sends ``If-None-Match: *`` and ``if_match`` sends ``If-Match: <ETag>``
    with the PUT or the multipart completion (S3 conditional writes, AWS S3 User Guide
    "Add preconditions to S3 operations with conditional requests"): a 412 becomes
    ``ObjectExists`` or ``PreconditionFailed``; for ``if_match`` a missing key (404) and a
    concurrent conditional write (409 ``ConditionalRequestConflict``) are
    ``PreconditionFailed`` too.
    """

    def __init__(
        self,
        storage: S3Bucket,
        key: str,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
    ) -> None:
        if if_absent and if_match is not None:
            raise ValueError("S3Writer: if_absent and if_match are exclusive")
        self.key = key
        self.version: str | None = None
        self._if_match = if_match
        self.bytes_written = 0
        self.crc = 0
        self._s = storage
        self._obj = storage.object_key(key)
        self._if_absent = if_absent
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._pending: deque[Future[dict[str, Any]]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._done = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; uploads full parts as the buffer fills.

        Host memory is bounded whatever the size of ``data`` (a whole 2 GiB tensor
        included): ``data`` is consumed one part at a time, so the writer holds at most
        ``max(multipart_threshold_bytes, multipart_chunk_bytes)`` of buffer plus
        ``max_concurrency + 1`` parts being uploaded or copied
        (:attr:`max_buffered_bytes`).

        Raises:
            StorageError: a part upload failed (the upload is aborted first).
        """
        if self._done:
            raise StorageError(f"write to {self.key} after commit/abort")
        mv = memoryview(data).cast("B")
        n = len(mv)
        self.crc = crc32c.crc32c(mv, self.crc)
        self.bytes_written += n
        opts = self._s.options
        threshold, chunk = opts.multipart_threshold_bytes, opts.multipart_chunk_bytes
        off = 0
        try:
            while off < n:
                left = n - off
                if self._upload_id is None and len(self._buf) + left <= threshold:
                    self._buf += mv[off:]  # may still become a single PutObject
                    break
                while len(self._buf) >= chunk:  # a buffer from below the threshold
                    self._submit(bytes(memoryview(self._buf)[:chunk]))
                    del self._buf[:chunk]
                if not self._buf and left >= chunk:  # a whole part straight from data
                    self._submit(bytes(mv[off : off + chunk]))
                    off += chunk
                    continue
                take = min(left, chunk - len(self._buf))
                self._buf += mv[off : off + take]
                off += take
                if len(self._buf) == chunk:
                    self._submit(bytes(self._buf))
                    self._buf = bytearray()
        except BaseException:
            self.abort()
            raise
        return n

    @property
    def max_buffered_bytes(self) -> int:
        """Upper bound of the host memory this writer holds, bytes (see :meth:`write`)."""
        o = self._s.options
        return (
            max(o.multipart_threshold_bytes, o.multipart_chunk_bytes)
            + (o.max_concurrency + 1) * o.multipart_chunk_bytes
        )

    def _submit(self, part: bytes) -> None:
        s = self._s
        if self._upload_id is None:
            resp = s.call(
                "create_multipart_upload",
                self.key,
                Key=self._obj,
                ChecksumAlgorithm="CRC32C",
                ChecksumType="FULL_OBJECT",
            )
            self._upload_id = str(resp["UploadId"])
            self._pool = priority.inheriting_pool(s.options.max_concurrency, "ckrun-s3-part")
        while len(self._pending) >= s.options.max_concurrency:
            self._parts.append(self._pending.popleft().result())
        number = len(self._parts) + len(self._pending) + 1
        assert self._pool is not None
        self._pending.append(self._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        self._s.limiter.acquire(len(part))
        crc = b64crc(crc32c.crc32c(part))
        resp = self._s.call(
            "upload_part",
            self.key,
            Key=self._obj,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=part,
            ChecksumCRC32C=crc,
        )
        return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": crc}

    def commit(self) -> ObjectInfo:
        """Make the object visible under its key (single PUT or multipart completion).

        Raises:
            ObjectExists: ``if_absent`` and the key exists (HTTP 412).
            StorageError: any other failure; the multipart upload is aborted.
        """
        if self._done:
            raise StorageError(f"commit of {self.key} after commit/abort")
        cond = {"IfNoneMatch": "*"} if self._if_absent else {}
        if self._if_match is not None:
            cond = {"IfMatch": self._if_match}
        try:
            if self._upload_id is None:
                self._s.limiter.acquire(len(self._buf))
                resp = self._s.call(
                    "put_object",
                    self.key,
                    Key=self._obj,
                    Body=bytes(self._buf),
                    ChecksumCRC32C=b64crc(self.crc),
                    Metadata={CRC_META: b64crc(self.crc)},
                    **cond,
                )
            else:
                if self._buf:
                    self._submit(bytes(self._buf))
                while self._pending:
                    self._parts.append(self._pending.popleft().result())
                resp = self._s.call(
                    "complete_multipart_upload",
                    self.key,
                    Key=self._obj,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                    ChecksumCRC32C=b64crc(self.crc),
                    ChecksumType="FULL_OBJECT",
                    **cond,
                )
        except (ObjectExists, ObjectNotFound) as exc:
            self.abort()
            if self._if_match is None:
                raise
            raise PreconditionFailed(
                f"{self._obj} changed or is gone (expected version "
                f"{self._if_match}): a conditional update lost the race"
            ) from exc
        except StorageError as exc:
            self.abort()
            if self._if_match is not None and "ConditionalRequestConflict" in str(exc):
                raise PreconditionFailed(
                    f"{self._obj}: a concurrent conditional write won"
                ) from exc
            raise
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._shutdown()
        self._buf = bytearray()
        self.version = str(resp.get("ETag") or "") or None
        return ObjectInfo(self.key, self.bytes_written, time.time(), self.version)

    def abort(self) -> None:
        """Discard the write; aborts the multipart upload (idempotent, never raises)."""
        if self._done:
            return
        self._done = True
        for f in self._pending:
            f.cancel()
        self._shutdown()
        self._buf = bytearray()
        if self._upload_id is not None:
            try:
                self._s.call(
                    "abort_multipart_upload", self.key, Key=self._obj, UploadId=self._upload_id
                )
            except StorageError:
                pass  # left for abort_incomplete_uploads / the bucket lifecycle rule

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> S3Writer:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
