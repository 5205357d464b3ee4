"""S3 storage backend (boto3, imported lazily): the :class:`Storage` contract on S3.

``S3Storage.from_url("s3://bucket/prefix")``.  Endpoint: the ``endpoint_url`` profile key,
else boto3's own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (MinIO, Ceph, moto...).
Credentials come only from boto3's default chain (environment, ``~/.aws``, SSO, instance
or pod role); ckrun never reads, stores or logs them.

Contract (DESIGN.md §3) on S3:

* a reader sees nothing or the whole object: one ``PutObject`` or a multipart upload that
  is completed or aborted (:class:`ckrun.storage.s3_transfer.S3Writer`); an upload cut off by
  SIGKILL leaves only an incomplete multipart upload, which no listing shows
  (:meth:`S3Storage.abort_incomplete_uploads` or a bucket lifecycle rule removes it);
* ``put``/``commit`` return once S3 answered 200 (S3 is strongly read-after-write
  consistent since December 2020);
* ``put(..., if_absent=True)`` sends ``If-None-Match: *``: a 412 becomes ``ObjectExists``;
* CRC32C end to end: sent with every write, checked by S3, checked again on every read;
* retries: botocore ``standard`` (or ``adaptive``) mode with ``s3_max_attempts``, which
  retries 5xx, throttling and connection errors with exponential back-off and jitter.
"""

from __future__ import annotations

import builtins
import os
import secrets
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import IO, Any

from ckrun.errors import (
    ObjectNotFound,
    StorageError,
    map_os_error,
)
from ckrun.storage.base import ObjectInfo, validate_key
from ckrun.storage.progress import Progress
from ckrun.storage.s3_client import make_client, map_s3_error
from ckrun.storage.s3_options import MiB, S3Options, parse_s3_url
from ckrun.storage.s3_read import ResumableReader, download_verified
from ckrun.storage.s3_transfer import CRC_META, RateLimiter, S3Writer


class S3Storage:
    """Objects under ``s3://bucket/prefix`` (see the module docstring).

    Attributes:
        url: ``s3://bucket[/prefix]``.
        bucket, prefix: the parts of the URL (prefix without slashes, may be empty).
        options: the :class:`S3Options` in force.
        limiter: the shared upload bandwidth limiter.
    """

    def __init__(
        self, bucket: str, prefix: str = "", options: S3Options | None = None, client: Any = None
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.options = options or S3Options.from_env()
        self.limiter = RateLimiter(self.options.s3_bandwidth_bytes_per_s)
        self._client = client or make_client(self.options)

    @classmethod
    def from_url(cls, url: str, options: S3Options | Mapping[str, Any] | None = None) -> S3Storage:
        """Open ``s3://bucket/prefix``; ``options`` default to :meth:`S3Options.from_env`."""
        bucket, prefix = parse_s3_url(url)
        if options is not None and not isinstance(options, S3Options):
            options = S3Options.from_mapping(options)
        return cls(bucket, prefix, options)

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    @property
    def client(self) -> Any:
        """The boto3 S3 client (thread-safe)."""
        return self._client

    def object_key(self, key: str) -> str:
        """The S3 object key of storage ``key`` (prefix joined)."""
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def call(self, op: str, key: str, **kw: Any) -> Any:
        """Call client method ``op`` on this bucket, mapping errors to ``StorageError``."""
        try:
            return getattr(self._client, op)(Bucket=self.bucket, **kw)
        except Exception as exc:
            raise map_s3_error(
                exc,
                op=op,
                url=f"{self.url}/{key}" if key else self.url,
                endpoint=self._client.meta.endpoint_url,
            ) from exc

    # -- writes -----------------------------------------------------------------------
    def open_write(
        self, key: str, *, if_absent: bool = False, if_match: str | None = None
    ) -> S3Writer:
        """A streaming writer, invisible under ``key`` until commit (see ``S3Writer``)."""
        self.object_key(key)
        return S3Writer(self, key, if_absent=if_absent, if_match=if_match)

    def put(
        self,
        key: str,
        data: bytes | memoryview,
        *,
        if_absent: bool = False,
        if_match: str | None = None,
    ) -> ObjectInfo:
        """Store ``data`` under ``key`` (``If-None-Match: *`` when ``if_absent``,
        ``If-Match: <ETag>`` with ``if_match``; see :class:`S3Writer` for the errors)."""
        with self.open_write(key, if_absent=if_absent, if_match=if_match) as w:
            w.write(data)
        return ObjectInfo(key, w.bytes_written, time.time(), w.version)

    def _resumable(
        self, key: str, resp: dict[str, Any], expected_crc: int | None, start: int = 0
    ) -> ResumableReader:
        """A reader of ``resp``'s body that resumes dropped streams (:mod:`.s3_read`);
        ``expected_crc`` None when the caller verifies the bytes itself (a range)."""
        return ResumableReader(
            self._client,
            self.bucket,
            self.object_key(key),
            key,
            resp,
            expected_crc,
            self.options.s3_max_attempts,
            lambda e: map_s3_error(
                e, op="get_object", url=f"{self.url}/{key}", endpoint=self.endpoint
            ),
            start=start,
        )

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object (CRC32C checked) and its ETag, from one GET.

        Raises:
            ObjectNotFound: ``key`` does not exist.
        """
        resp = self.call("get_object", key, Key=self.object_key(key), ChecksumMode="ENABLED")
        raw = self._resumable(key, resp, self._expected_crc(resp))
        with raw:
            data = raw.readall()
        return data, str(resp["ETag"])

    def put_file(self, key: str, path: str) -> ObjectInfo:
        """Upload the local file ``path`` under ``key`` (multipart when large)."""
        chunk = self.options.multipart_chunk_bytes
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise map_os_error(exc, path=path) from exc
        size = os.fstat(f.fileno()).st_size
        with f, self.open_write(key) as w, Progress(f"upload {key}", size) as bar:
            while True:
                try:
                    data = f.read(chunk)
                except OSError as exc:
                    raise map_os_error(exc, path=path) from exc
                if not data:
                    break
                w.write(data)
                bar.update(len(data))
        return ObjectInfo(key, w.bytes_written, time.time())

    # -- reads ------------------------------------------------------------------------
    def _expected_crc(self, resp: Mapping[str, Any]) -> int | None:
        """The object's full CRC32C: S3's full-object checksum, else ckrun's metadata."""
        import base64

        value = resp.get("ChecksumCRC32C")
        if not value or resp.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
            value = (resp.get("Metadata") or {}).get(CRC_META)
        if not value:
            return None

        return int.from_bytes(base64.b64decode(value), "big")

    def open_read(self, key: str) -> IO[bytes]:
        """Stream ``key``: a dropped connection resumes with a ranged GET of the same
        ETag; the CRC32C is checked when the end is read (:mod:`.s3_read`).

        Raises:
            ObjectNotFound: ``key`` does not exist.
            CorruptObject: (while reading) the bytes do not match the object's CRC32C.
            StorageError: (while reading) the stream kept failing after
                ``s3_max_attempts`` resumed reads.
        """
        import io

        resp = self.call("get_object", key, Key=self.object_key(key), ChecksumMode="ENABLED")
        raw = self._resumable(key, resp, self._expected_crc(resp))
        return io.BufferedReader(raw, buffer_size=1 * MiB)

    @property
    def endpoint(self) -> str:
        """The endpoint URL the client talks to."""
        return str(self._client.meta.endpoint_url)

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset`` of ``key`` with a ranged ``GetObject`` (see
        ``Storage``; the caller verifies the range by its own CRC32C). A dropped stream
        resumes with a ranged GET of the rest, pinned to the same ETag (:mod:`.s3_read`).

        Raises:
            ObjectNotFound: ``key`` does not exist.
            CorruptObject: the object was replaced while it was read (ETag changed).
            StorageError: the object ends before ``offset + len(buf)`` (truncated), or the
                stream kept failing after ``s3_max_attempts`` resumed reads.
        """
        n = len(buf)
        if not n:
            return
        resp = self.call(
            "get_object", key, Key=self.object_key(key), Range=f"bytes={offset}-{offset + n - 1}"
        )
        raw = self._resumable(key, resp, None, start=offset)
        done = 0
        try:
            while done < n:
                got = raw.readinto(buf[done:])
                if not got:
                    raise StorageError(
                        f"{self.url}/{key}: ends before byte {offset + n} (read "
                        f"{offset + done}); the object is truncated"
                    )
                done += got
        finally:
            raw.close()

    def get(self, key: str) -> bytes:
        """The whole object (CRC32C checked); ``ObjectNotFound`` if absent."""
        with self.open_read(key) as f:
            try:
                return f.read()
            except StorageError:
                raise
            except Exception as exc:
                raise map_s3_error(
                    exc,
                    op="get_object",
                    url=f"{self.url}/{key}",
                    endpoint=self._client.meta.endpoint_url,
                ) from exc

    def get_file(self, key: str, path: str) -> None:
        """Download ``key`` to ``path``: temp file, CRC32C check, fsync, atomic rename.

        s3transfer's downloader (:func:`ckrun.storage.s3_read.download_file`): ranged
        GETs of ``s3_multipart_chunk_bytes``, ``s3_max_concurrency`` in flight, the ETag
        pinned, dropped streams retried (``s3_max_attempts``).

        Raises:
            ObjectNotFound: ``key`` does not exist.
            CorruptObject: the downloaded bytes do not match the object's CRC32C.
            StorageError: the download failed after its retries; ``path`` is untouched.
        """
        head = self.call("head_object", key, Key=self.object_key(key), ChecksumMode="ENABLED")
        try:
            download_verified(
                self._client,
                self.bucket,
                self.object_key(key),
                path,
                key=key,
                size=int(head["ContentLength"]),
                expected_crc=self._expected_crc(head),
                options=self.options,
                mapper=lambda e: map_s3_error(
                    e, op="get_object", url=f"{self.url}/{key}", endpoint=self.endpoint
                ),
            )
        except OSError as exc:
            raise map_os_error(exc, path=path) from exc

    def crc32c(self, key: str) -> int | None:
        """The object's full CRC32C as S3 (or ckrun's metadata) records it; None if unknown.

        Raises:
            ObjectNotFound: ``key`` does not exist.
        """
        r = self.call("head_object", key, Key=self.object_key(key), ChecksumMode="ENABLED")
        return self._expected_crc(r)

    def local_path(self, key: str) -> str | None:
        """Always None: S3 objects have no POSIX path."""
        return None

    def head(self, key: str) -> ObjectInfo | None:
        """Size and mtime of ``key``, or None when absent."""
        try:
            r = self.call("head_object", key, Key=self.object_key(key))
        except ObjectNotFound:
            return None
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"].timestamp())

    def _pages(self, prefix: str, **kw: Any) -> Iterator[dict[str, Any]]:
        """The pages of ``list_objects_v2`` under ``prefix`` (after the storage's own
        prefix), errors mapped to ``StorageError``."""
        try:
            pages = self._client.get_paginator("list_objects_v2")
            yield from pages.paginate(Bucket=self.bucket, Prefix=self._root + prefix, **kw)
        except Exception as exc:
            raise map_s3_error(
                exc,
                op="list_objects_v2",
                url=f"{self.url}/{prefix}",
                endpoint=self._client.meta.endpoint_url,
            ) from exc

    @property
    def _root(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def child_names(self, prefix: str = "") -> builtins.list[str]:
        """The names one level below ``prefix`` (``list_objects_v2`` with ``Delimiter="/"``:
        the common prefixes, without the objects under them), sorted.

        Raises:
            StorageError: the listing failed.
        """
        start = self._root + prefix
        names = (
            p["Prefix"][len(start) :].rstrip("/")
            for page in self._pages(prefix, Delimiter="/")
            for p in page.get("CommonPrefixes", [])
        )
        return sorted(names)

    def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        n = len(self._root)
        out = [
            ObjectInfo(o["Key"][n:], int(o["Size"]), o["LastModified"].timestamp())
            for page in self._pages(prefix)
            for o in page.get("Contents", [])
        ]
        return sorted(out, key=lambda i: i.key)

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (batches of 1000); missing keys are ignored."""
        objs = [{"Key": self.object_key(k)} for k in keys]
        for i in range(0, len(objs), 1000):
            r = self.call(
                "delete_objects", "", Delete={"Objects": objs[i : i + 1000], "Quiet": True}
            )
            errs = r.get("Errors") or []
            if errs:
                e = errs[0]
                raise StorageError(
                    f"cannot delete s3://{self.bucket}/{e.get('Key')}: "
                    f"{e.get('Code')} {e.get('Message')} ({len(errs)} failed)"
                )

    # -- maintenance ------------------------------------------------------------------
    def check(self, *, write: bool = True) -> None:
        """Preflight: the bucket exists and (``write``) we may put, read and delete.

        Raises:
            StorageError: missing bucket or unreachable endpoint, naming the fix.
            StoragePermissionError: access denied or no credentials.
        """
        self.call("head_bucket", "")
        if write:
            key = f".ckrun-preflight-{secrets.token_hex(6)}"
            self.put(key, b"ckrun preflight probe")
            try:
                if self.get(key) != b"ckrun preflight probe":
                    raise StorageError(f"{self.url}: the preflight probe read back differently")
            finally:
                self.delete([key])

    def abort_incomplete_uploads(self, older_than_s: float = 24 * 3600.0) -> int:
        """Abort multipart uploads under the prefix started more than ``older_than_s`` ago.

        Returns:
            the number aborted.  (A bucket lifecycle rule
            ``AbortIncompleteMultipartUpload`` does the same server-side.)
        """
        r = self.call("list_multipart_uploads", "", Prefix=self._root)
        n = 0
        for u in r.get("Uploads", []):
            if time.time() - u["Initiated"].timestamp() >= older_than_s:
                self.call("abort_multipart_upload", "", Key=u["Key"], UploadId=u["UploadId"])
                n += 1
        return n


__all__ = ["S3Options", "S3Storage", "make_client", "map_s3_error", "parse_s3_url"]
