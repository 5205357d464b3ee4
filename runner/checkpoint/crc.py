"""CRC32C helpers: combining the CRCs of adjacent byte ranges (for parallel reads).

``combine(crc_a, crc_b, len_b)`` is the CRC32C of ``a + b`` given the CRCs of ``a`` and
``b``: zlib's ``crc32_combine`` (Mark Adler, zlib 1.2.x, GF(2) matrix method) with the
reflected Castagnoli polynomial 0x82F63B78.  About 30 32×32 matrix squarings for a 1 GiB
range; the operators for 2**k zero bytes are cached, and so is the operator of each
recent ``len_b`` (a run saves the same entry sizes step after step): a repeated combine
costs one 32x32 matrix-vector product (a few microseconds), a new length one product
per set bit of ``len_b`` (tens of microseconds).
"""

from __future__ import annotations

import functools

POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _times(mat: list[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


_ZEROS: list[list[int]] = []  # _ZEROS[k]: the operator appending 2**k zero bytes


def _zeros(k: int) -> list[int]:
    if not _ZEROS:
        odd = [POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
        _ZEROS.append(_square(_square(_square(odd))))  # 8 zero bits: one byte
    while len(_ZEROS) <= k:
        _ZEROS.append(_square(_ZEROS[-1]))
    return _ZEROS[k]


@functools.lru_cache(maxsize=1024)
def _operator(len_b: int) -> list[int]:
    """The operator appending ``len_b`` zero bytes (``len_b`` > 0): the product of the
    cached 2**k operators of its set bits (they commute: powers of one operator)."""
    op: list[int] | None = None
    k = 0
    while len_b > 0:
        if len_b & 1:
            z = _zeros(k)
            op = z if op is None else [_times(z, col) for col in op]
        len_b >>= 1
        k += 1
    assert op is not None
    return op


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of the concatenation ``a + b`` (``crc32c.crc32c`` conventions).

    Args:
        crc_a: CRC32C of the first range.
        crc_b: CRC32C of the second range (computed from 0).
        len_b: length of the second range in bytes.
    """
    if len_b <= 0:
        return crc_a ^ crc_b
    return _times(_operator(len_b), crc_a) ^ crc_b
