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


def test_threads_building_the_operator_table_at_once_agree() -> None:
    """The 2**k operators are built on first use, by whichever threads combine first (a
    save's persist beside a parallel read): built twice at once, the table got an
    operator twice and every longer length a wrong CRC."""
    import sys
    import threading

    from ckrun.checkpoint import crc

    crc._ZEROS.clear()
    crc._shift.cache_clear()
    lengths = [(1 << 40) + i for i in range(8)]
    start = threading.Barrier(8)
    got: dict[int, int] = {}

    def run(n: int) -> None:
        start.wait()
        got[n] = crc._shift(n)

    threads = [threading.Thread(target=run, args=(n,)) for n in lengths]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside the table's construction
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    table = list(crc._ZEROS)
    crc._ZEROS.clear()
    crc._shift.cache_clear()
    assert len(table) == 41
    for n in lengths:  # the same multipliers built alone, one thread
        assert got[n] == crc._shift(n), n
