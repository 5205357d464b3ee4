"""Fixtures for the cloud notice tests: loopback metadata servers, one per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ckrun.notices import NoticeSource
from metaservers import AwsImds, AzureImds, GcpMetadata


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
