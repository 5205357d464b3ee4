"""CRC32C helpers: combining the CRCs of adjacent byte ranges (for parallel reads).

``combine(crc_a, crc_b, len_b)`` is the CRC32C of ``a + b`` given the CRCs of ``a`` and
``b``: zlib's ``crc32_combine`` (Mark Adler, zlib 1.2.x, GF(2) matrix method) with the
reflected Castagnoli polynomial 0x82F63B78.  About 30 32×32 matrix squarings for a 1 GiB
range; the operators for 2**k zero bytes are cached, so a combine costs a few 32x32
matrix-vector products (tens of microseconds).
"""

from __future__ import annotations

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


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of the concatenation ``a + b`` (``crc32c.crc32c`` conventions).

    Args:
        crc_a: CRC32C of the first range.
        crc_b: CRC32C of the second range (computed from 0).
        len_b: length of the second range in bytes.
    """
    k = 0
    while len_b > 0:  # apply len_b zero bytes to crc_a, one set bit of len_b at a time
        if len_b & 1:
            crc_a = _times(_zeros(k), crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
