"""Fixtures for the cloud notice tests: loopback metadata servers, one per test."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckrun.notices import NoticeSource

# The S3 fixtures (moto's server) live with the storage tests; the spot end-to-end test
# here needs them too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "storage"))
from metaservers import AwsImds, AzureImds, GcpMetadata
from s3_server import moto_s3  # noqa: E402, F401


@pytest.fixture
def aws() -> Iterator[AwsImds]:
    srv = AwsImds()
    yield srv
    srv.close()


@pytest.fixture
def gcp() -> Iterator[GcpMetadata]:
    srv = GcpMetadata()
    yield srv
    srv.close()


@pytest.fixture
def azure() -> Iterator[AzureImds]:
    srv = AzureImds()
    yield srv
    srv.close()


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """Register sources to close at teardown: ``src = closing(AwsSpotSource(...))``."""
    sources: list[NoticeSource] = []

    def reg(src: Any) -> Any:
        sources.append(src)
        return src

    yield reg
    for s in sources:
        s.close()
