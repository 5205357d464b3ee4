"""CRC32C combine (parallel reads) against crc32c over the concatenation."""

from __future__ import annotations

import crc32c
from ckrun.checkpoint.crc import combine
from hypothesis import given
from hypothesis import strategies as st


@given(st.binary(max_size=3000), st.binary(max_size=3000), st.binary(max_size=50))
def test_combine_matches_concatenation(a: bytes, b: bytes, c: bytes) -> None:
    ab = combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b))
    assert ab == crc32c.crc32c(a + b)
    assert combine(ab, crc32c.crc32c(c), len(c)) == crc32c.crc32c(a + b + c)


def test_combine_long_range() -> None:
    b = bytes(range(256)) * 4099
    assert combine(crc32c.crc32c(b"x"), crc32c.crc32c(b), len(b)) == crc32c.crc32c(b"x" + b)


def test_a_remembered_length_combines_other_prefixes() -> None:
    """The multiplier of a length is kept between calls: it must not depend on the
    first call's CRCs."""
    b = bytes(range(256)) * 1303  # 333,568 bytes: a shard entry's size
    for a in (b"", b"x", b"another prefix" * 99):
        assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
