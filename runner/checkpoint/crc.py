"""CRC32C helpers: combining the CRCs of adjacent byte ranges (for parallel reads, and
for a shard's whole-file CRC from its entries' CRCs without hashing twice).

``combine(crc_a, crc_b, len_b)`` is the CRC32C of ``a + b`` given the CRCs of ``a`` and
``b`` (zlib's ``crc32_combine``, Mark Adler: zlib 1.2.x's GF(2) matrix method and 1.2.12's
multiplication form), with the reflected Castagnoli polynomial 0x82F63B78.  Appending
``len_b`` zero bytes multiplies a CRC by x^(8·len_b) modulo the polynomial.  That
multiplier is found by applying the cached operators for 2**k zero bytes (32×32 GF(2)
matrices) to the polynomial 1, one product per set bit of ``len_b`` (tens of
microseconds), and is kept for recent lengths (a run saves the same entry sizes step
after step); a combine is then one 32-step multiplication (a few microseconds).
"""

from __future__ import annotations

import functools
import threading

POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected
_ONE = 1 << 31  # the polynomial 1 (x^0): bit 31 in the reflected representation


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
_ZEROS_LOCK = threading.Lock()  # combines run on save, persist and read threads at once


def _zeros(k: int) -> list[int]:
    with _ZEROS_LOCK:
        if not _ZEROS:
            odd = [POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
            _ZEROS.append(_square(_square(_square(odd))))  # 8 zero bits: one byte
        while len(_ZEROS) <= k:
            _ZEROS.append(_square(_ZEROS[-1]))
        return _ZEROS[k]


@functools.lru_cache(maxsize=4096)
def _shift(len_b: int) -> int:
    """x^(8·len_b) mod POLY: ``len_b`` zero bytes appended to the polynomial 1."""
    p, k = _ONE, 0
    while len_b > 0:
        if len_b & 1:
            p = _times(_zeros(k), p)
        len_b >>= 1
        k += 1
    return p


def _multmodp(a: int, b: int) -> int:
    """a·b modulo POLY, both reflected (bit 31 is x^0)."""
    p, m = 0, _ONE
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of the concatenation ``a + b`` (``crc32c.crc32c`` conventions).

    Args:
        crc_a: CRC32C of the first range.
        crc_b: CRC32C of the second range (computed from 0).
        len_b: length of the second range in bytes.
    """
    if len_b <= 0:
        return crc_a ^ crc_b
    return _multmodp(_shift(len_b), crc_a) ^ crc_b
