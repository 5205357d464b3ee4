"""Profile keys of the S3 backend (:class:`S3Options`) and its URLs (:func:`parse_s3_url`),
shared by the storage and its transfers (:mod:`ckrun.storage.s3`,
:mod:`ckrun.storage.s3_transfer`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ckrun.errors import ConfigError
from ckrun.options import coerce_fields
from ckrun.storage.base import validate_key

__all__ = ["MiB", "S3Options", "parse_s3_url"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class S3Options:
    """Profile keys of the S3 backend (flat YAML; env ``CKRUN_<KEY>``).

    Attributes:
        endpoint_url: S3-compatible endpoint; None: boto3 decides (``AWS_ENDPOINT_URL_S3``).
        s3_region: signing region; None: boto3's chain, else ``us-east-1``.
        s3_addressing_style: ``auto``, ``path`` or ``virtual``.
        s3_retry_mode: botocore retry mode, ``standard`` or ``adaptive``.
        s3_max_attempts: total attempts per request, first included.
        s3_multipart_threshold_bytes: objects larger than this use multipart uploads.
        s3_multipart_chunk_bytes: part size (S3's minimum: 5 MiB; at most 10 000 parts).
        s3_max_concurrency: parts in flight per object upload, and ranged GETs in flight
            per ``get_file`` download (s3transfer).
        s3_bandwidth_bytes_per_s: cap on upload + download bytes/s (0: no cap).
        s3_timeout_s: connect and read timeout per request, seconds.
    """

    endpoint_url: str | None = None
    s3_region: str | None = None
    s3_addressing_style: str = "auto"
    s3_retry_mode: str = "standard"
    s3_max_attempts: int = 8
    s3_multipart_threshold_bytes: int = 64 * MiB
    s3_multipart_chunk_bytes: int = 16 * MiB
    s3_max_concurrency: int = 8
    s3_bandwidth_bytes_per_s: int = 0
    s3_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        """Coerce every value to its field's type (:func:`ckrun.options.coerce`).

        Raises:
            ConfigError: a value that does not convert, naming its key.
        """
        coerce_fields(self)

    @property
    def multipart_threshold_bytes(self) -> int:
        return self.s3_multipart_threshold_bytes

    @property
    def multipart_chunk_bytes(self) -> int:
        return self.s3_multipart_chunk_bytes

    @property
    def max_concurrency(self) -> int:
        return self.s3_max_concurrency

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> S3Options:
        """Pick this dataclass's keys out of a config mapping (others ignored), validated.

        Raises:
            ConfigError: an invalid retry mode, addressing style, part size or count.
        """
        kw = {f.name: config[f.name] for f in fields(cls) if config.get(f.name) not in (None, "")}
        opts = cls(**kw)
        if opts.s3_retry_mode not in ("standard", "adaptive", "legacy"):
            raise ConfigError(f"s3_retry_mode={opts.s3_retry_mode!r}: use standard or adaptive")
        if opts.s3_addressing_style not in ("auto", "path", "virtual"):
            raise ConfigError("s3_addressing_style must be auto, path or virtual")
        if opts.s3_multipart_chunk_bytes < 5 * MiB:
            raise ConfigError("s3_multipart_chunk_bytes must be >= 5 MiB (S3's minimum part)")
        if opts.s3_max_attempts < 1 or opts.s3_max_concurrency < 1:
            raise ConfigError("s3_max_attempts and s3_max_concurrency must be >= 1")
        return opts

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Options:
        """Options from ``CKRUN_<KEY>`` variables (``CKRUN_ENDPOINT_URL``, ...)."""
        env = os.environ if environ is None else environ
        return cls.from_mapping({f.name: env.get("CKRUN_" + f.name.upper()) for f in fields(cls)})


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` → (``bucket``, ``a/b``).

    Raises:
        ConfigError: not an ``s3://`` URL, or no bucket, or an invalid prefix.
    """
    if not url.startswith("s3://"):
        raise ConfigError(f"{url!r} is not an s3:// URL: use s3://bucket/prefix")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise ConfigError(f"{url!r} names no bucket: use s3://bucket/prefix")
    if prefix:
        validate_key(prefix)
    return bucket, prefix
