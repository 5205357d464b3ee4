"""Checkpoint storage backends behind one :class:`~ckrun.storage.base.Storage` protocol."""

from __future__ import annotations

from ckrun.storage.base import ObjectInfo, ObjectWriter, Storage, validate_key

__all__ = ["ObjectInfo", "ObjectWriter", "Storage", "open_storage", "validate_key"]


def open_storage(url: str) -> Storage:
    """Open the storage named by ``url``: ``s3://bucket/prefix`` opens the S3 backend
    (boto3, lazy import); anything else is a local directory (``file://`` prefix
    optional), created if missing.

    The environment plays no part here; ``ckrun.open_storage``
    (:func:`ckrun.checkpoint.env.open_storage_from_env`) adds the local tier that
    ``CKRUN_LOCAL_TIER`` configures.

    Raises:
        ckrun.errors.ConfigError: for an unsupported URL scheme.
    """
    from ckrun.errors import ConfigError

    if url.startswith("s3://"):
        from ckrun.storage.s3 import S3Storage

        return S3Storage.from_url(url)
    if "://" in url and not url.startswith("file://"):
        raise ConfigError(
            f"unsupported storage URL {url!r}: use a local directory or s3://bucket/prefix"
        )
    from ckrun.storage.local import LocalStorage

    return LocalStorage(url.removeprefix("file://"))
