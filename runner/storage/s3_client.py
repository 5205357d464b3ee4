"""The S3 client ckrun uses and how its errors read (used by :mod:`ckrun.storage.s3`).

:func:`make_client` builds a boto3 client with the retry mode, attempts, timeouts and
connection pool of :class:`~ckrun.storage.s3_options.S3Options` (botocore ``Config``);
:func:`map_s3_error` turns a botocore exception into the most specific
:class:`~ckrun.errors.StorageError` (missing credentials, unreachable endpoint, missing
bucket or key, a lost conditional write, access denied, throttling), each naming the fix.
"""

from __future__ import annotations

from typing import Any

from ckrun.errors import ObjectExists, ObjectNotFound, StorageError, StoragePermissionError
from ckrun.storage.s3_options import S3Options


def make_client(options: S3Options) -> Any:
    """A boto3 S3 client with ckrun's retry, timeout and pool settings (boto3 lazy)."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    region = options.s3_region or session.region_name or "us-east-1"
    cfg = Config(
        retries={"mode": options.s3_retry_mode, "total_max_attempts": options.s3_max_attempts},
        connect_timeout=options.s3_timeout_s,
        read_timeout=options.s3_timeout_s,
        max_pool_connections=max(10, options.s3_max_concurrency * 2),
        s3={"addressing_style": options.s3_addressing_style},
    )
    return session.client("s3", region_name=region, endpoint_url=options.endpoint_url, config=cfg)


_DENIED = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "AccountProblem",
}


def map_s3_error(exc: BaseException, *, op: str, url: str, endpoint: str) -> StorageError:
    """Map a botocore exception to the most specific ``StorageError``, naming the fix."""
    if isinstance(exc, StorageError):
        return exc
    from botocore.exceptions import (
        ClientError,
        ConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return StoragePermissionError(
            f"no AWS credentials for {url}: boto3's default chain found none; set "
            "AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or attach an instance/pod "
            "role (ckrun never reads credentials from its config)"
        )
    if isinstance(exc, ConnectionError):
        return StorageError(
            f"cannot reach the S3 endpoint {endpoint} ({op} {url}): {exc}; "
            "check endpoint_url / AWS_ENDPOINT_URL_S3 and the network"
        )
    if not isinstance(exc, ClientError):
        return StorageError(f"S3 {op} on {url} failed: {type(exc).__name__}: {exc}")
    err = exc.response.get("Error", {})
    code = str(err.get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    bucket = url[5:].split("/", 1)[0]
    if code == "NoSuchBucket" or (op == "head_bucket" and code in ("404", "NotFound")):
        return StorageError(
            f"bucket {bucket!r} does not exist at {endpoint}: create it "
            f"(aws s3 mb s3://{bucket}) or fix --storage"
        )
    if code in ("NoSuchKey", "404", "NotFound", "NoSuchUpload"):
        return ObjectNotFound(f"{url} does not exist")
    if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
        return ObjectExists(
            f"{url} already exists (conditional create lost); another "
            "attempt committed this key first"
        )
    if code in _DENIED or status == 403:
        return StoragePermissionError(
            f"access denied: {op} on {url} ({code}); grant s3:ListBucket, s3:GetObject, "
            "s3:PutObject, s3:DeleteObject and s3:AbortMultipartUpload on the bucket/prefix to "
            "the credentials boto3 finds"
        )
    if code in ("SlowDown", "503", "ServiceUnavailable", "InternalError", "500"):
        return StorageError(
            f"S3 kept failing ({code}) on {op} {url} after retries: raise "
            "s3_max_attempts or use s3_retry_mode: adaptive"
        )
    return StorageError(f"S3 {op} on {url} failed: {code} {err.get('Message', '')}".rstrip())
