"""Reading S3 objects: resumable ranged streams and concurrent downloads, CRC32C checked.

:class:`ResumableReader` streams one object (``S3Storage.open_read``).  botocore retries
a request until its response headers arrive; a connection dropped while the body streams
surfaces from ``StreamingBody.read`` and is the reader's business.  The reader then
re-issues ``GetObject`` with ``Range: bytes=<pos>-`` and ``If-Match: <ETag>`` (the same
object, never a newer one spliced in), up to ``s3_max_attempts`` times with exponential
back-off, on the errors s3transfer's downloader retries
(``s3transfer.utils.S3_RETRYABLE_DOWNLOAD_ERRORS``).  At the end of the object the
CRC32C of every byte read is compared with the object's full-object checksum:

* mismatch, or the object changed under the read (HTTP 412 on the resumed GET):
  :class:`ckrun.errors.CorruptObject` (the stored bytes are bad: the checkpoint layer
  falls back to an older checkpoint);
* retries exhausted: :class:`ckrun.errors.StorageError` (transient: nothing is concluded
  about the object).

:func:`download_file` (``S3Storage.get_file``) uses s3transfer's downloader: ranged GETs
of ``s3_multipart_chunk_bytes``, ``s3_max_concurrency`` in flight, ETag pinned, streaming
errors retried, bandwidth capped by ``s3_bandwidth_bytes_per_s``; then the file's CRC32C
is compared with the object's.
"""

from __future__ import annotations

import io
import os
import secrets
import threading
import time
from typing import Any

import crc32c
from ckrun.errors import CorruptObject, StorageError

#: Back-off before the n-th resumed GET: BACKOFF_S * 2**n, capped at BACKOFF_MAX_S.
BACKOFF_S = 0.05
BACKOFF_MAX_S = 2.0


def retryable_errors() -> tuple[type[BaseException], ...]:
    """Exceptions of a body read that a resumed GET can cure (s3transfer's list, plus
    botocore's connection errors)."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from s3transfer.utils import S3_RETRYABLE_DOWNLOAD_ERRORS

    return (*S3_RETRYABLE_DOWNLOAD_ERRORS, BotoConnectionError)


class ResumableReader(io.RawIOBase):
    """A raw reader of one S3 object that resumes dropped streams (module docstring).

    Args:
        client: the boto3 S3 client.
        bucket, obj_key: the object.
        key: the storage key (for messages).
        first: the ``GetObject`` response of the first request (whole object).
        expected_crc: the object's full CRC32C, or None when the store has none.
        max_attempts: total GETs allowed (the first one included).
        mapper: maps a client exception to a ``StorageError`` (``map_s3_error``).
        start: the object offset ``first`` starts at (bytes; a ranged GET), 0 for the
            whole object; resumed GETs ask for ``[pos, start + ContentLength)``.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        obj_key: str,
        key: str,
        first: dict[str, Any],
        expected_crc: int | None,
        max_attempts: int,
        mapper: Any,
        start: int = 0,
    ) -> None:
        super().__init__()
        self._client, self._bucket, self._obj, self._key = client, bucket, obj_key, key
        self._body = first["Body"]
        self._size = start + int(first["ContentLength"])  # end offset (exclusive)
        self._etag = first.get("ETag")
        self._expected = expected_crc
        self._left = max(0, max_attempts - 1)
        self._map = mapper
        self._retryable = retryable_errors()
        self.pos = start
        self.resumed = 0
        self._crc = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        while True:
            try:
                data = self._body.read(len(mv)) if len(mv) else b""
            except self._retryable as exc:
                self._resume(exc)
                continue
            except Exception as exc:
                if type(exc).__name__ == "FlexibleChecksumError":  # botocore's own check
                    raise CorruptObject(
                        f"checksum mismatch reading {self._key}: {exc}", key=self._key
                    ) from exc
                raise self._map(exc) from exc
            n = len(data)
            if n == 0 and len(mv) and self.pos < self._size:  # the stream ended early
                self._resume(None)
                continue
            mv[:n] = data
            if n:
                self._crc = crc32c.crc32c(data, self._crc)
                self.pos += n
            elif len(mv):
                self._check_end()
            return n

    def _check_end(self) -> None:
        if self._expected is not None and self._crc != self._expected:
            raise CorruptObject(
                f"CRC32C mismatch reading {self._key}: the stored object does not match "
                "its checksum (corrupt); fall back to an older checkpoint",
                key=self._key,
            )

    def _resume(self, exc: BaseException | None) -> None:
        """Re-open the stream at ``pos`` (same ETag) or raise when out of attempts."""
        why = f"{type(exc).__name__}: {exc}" if exc else "the body ended early"
        if self._left <= 0:
            raise StorageError(
                f"reading {self._key} kept failing at byte {self.pos} of {self._size} "
                f"({why}) after {self.resumed} resumed reads; check the network, or raise "
                "s3_max_attempts"
            ) from exc
        self._left -= 1
        time.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2**self.resumed))
        self.resumed += 1
        try:
            self._body.close()
        except Exception:  # noqa: BLE001 - the old connection is dead anyway
            pass
        kw: dict[str, Any] = {"Range": f"bytes={self.pos}-{self._size - 1}"}
        if self._etag:
            kw["IfMatch"] = self._etag
        try:
            resp = self._client.get_object(Bucket=self._bucket, Key=self._obj, **kw)
        except self._retryable as e:  # the re-open itself failed: count it, go again
            self._body = _Broken(e)
            return
        except Exception as e:
            status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412:
                raise CorruptObject(
                    f"{self._key} was replaced while it was read (ETag changed); read it again",
                    key=self._key,
                ) from e
            raise self._map(e) from e
        self._body = resp["Body"]

    def close(self) -> None:
        try:
            self._body.close()
        finally:
            super().close()


class _Broken:
    """A body whose every read raises ``exc`` (a failed re-open, retried by the reader)."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def read(self, n: int) -> bytes:
        raise self._exc

    def close(self) -> None:
        pass


def download_file(
    client: Any,
    bucket: str,
    obj_key: str,
    path: str,
    *,
    chunk_bytes: int,
    max_concurrency: int,
    max_attempts: int,
    bandwidth_bytes_per_s: int,
    callback: Any = None,
) -> None:
    """Download one object to ``path`` with s3transfer (ranged, concurrent, retried).

    Raises:
        botocore/s3transfer errors, unmapped (the caller maps them).
    """
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(
        multipart_threshold=chunk_bytes,
        multipart_chunksize=chunk_bytes,
        max_concurrency=max_concurrency,
        num_download_attempts=max_attempts,
        max_bandwidth=bandwidth_bytes_per_s or None,
        use_threads=max_concurrency > 1,
    )
    client.download_file(bucket, obj_key, path, Config=cfg, Callback=callback)


def download_verified(
    client: Any,
    bucket: str,
    obj_key: str,
    path: str,
    *,
    key: str,
    size: int,
    expected_crc: int | None,
    options: Any,
    mapper: Any,
) -> None:
    """:func:`download_file` into a temp file beside ``path``, CRC32C check, fsync, atomic
    rename (``S3Storage.get_file``); ``options`` is the storage's ``S3Options``.

    Raises:
        CorruptObject: the downloaded bytes do not match ``expected_crc``.
        StorageError: the download failed (``mapper`` maps botocore's error).
        OSError: the local file system failed (the caller maps it).
    """
    from ckrun.storage.progress import Progress

    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".ckrun-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    lock = threading.Lock()
    try:
        os.makedirs(d, exist_ok=True)
        with Progress(f"download {key}", size) as bar:

            def progress(n: int) -> None:  # s3transfer calls it from its threads
                with lock:
                    bar.update(n)

            try:
                download_file(
                    client,
                    bucket,
                    obj_key,
                    tmp,
                    chunk_bytes=options.multipart_chunk_bytes,
                    max_concurrency=options.max_concurrency,
                    max_attempts=options.s3_max_attempts,
                    bandwidth_bytes_per_s=options.s3_bandwidth_bytes_per_s,
                    callback=progress,
                )
            except OSError:
                raise
            except Exception as exc:
                raise mapper(exc) from exc
        if expected_crc is not None and file_crc32c(tmp) != expected_crc:
            raise CorruptObject(
                f"CRC32C mismatch downloading {key}: the stored object does not match its "
                "checksum (corrupt)",
                key=key,
            )
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def file_crc32c(path: str, chunk: int = 16 << 20) -> int:
    """CRC32C of a local file."""
    crc = 0
    with open(path, "rb") as f:
        while data := f.read(chunk):
            crc = crc32c.crc32c(data, crc)
    return crc
