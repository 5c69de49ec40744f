"""The CRC-32 of a concatenation, from the CRC-32s of its parts: many at once, with numpy.

[Note: checking pieces where they land]
A rank reading a checkpoint written by many more ranks reads, from each shard file, one small piece of each of a few
hundred tensors, and the pieces of one tensor from consecutive files land one after the other in its target. Reading
them straight into their targets leaves no per-file copy of the bytes to check against the file's checksums; the
per-piece check would be one ``zlib.crc32`` call per piece (~100,000 of them). Instead, each target's run of ``k``
pieces is checked with one call: the CRC-32 of the run's bytes must equal the CRC-32 its pieces' recorded CRC-32s
give when combined, ``crc(A + B) = shift(crc(A), len(B)) ^ crc(B)`` (zlib's ``crc32_combine``), where ``shift(c, n)``
is the effect of ``n`` zero bytes on a CRC register: linear over GF(2), so a table lookup per byte of ``c``
(``ShiftTable``). For ``k`` pieces of ``n`` bytes the combination is ``XOR_i shift(c_i, n * (k - 1 - i))``; it is
evaluated as a tree (pairs, then pairs of pairs: ``log2 k`` levels, the shift doubling at each), all runs of one
piece size at once. A zero CRC-32 in front changes nothing (``shift(0, m) = 0``), so runs are padded to a power of
two. A mismatch says only that the run holds a wrong byte; the caller then finds the piece with one call each.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_POLYNOMIAL = 0xEDB88320  # zlib's CRC-32, bit-reflected

ShiftTable = Any  # a (4, 256) uint32 array: the effect of some number of zero bytes on each byte of a CRC register


def _byte_table() -> Any:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLYNOMIAL), table >> 1).astype(np.uint32)
    return table


_CRC_TABLE = _byte_table()
_NO_BYTES = np.arange(256, dtype=np.uint32) << (8 * np.arange(4, dtype=np.uint32)[:, None])  # lane j: byte j, as is


def _apply(table: ShiftTable, crcs: Any) -> Any:
    """``shift(crcs, n)`` for the ``n`` zero bytes ``table`` stands for, elementwise."""
    return table[0][crcs & 255] ^ table[1][(crcs >> 8) & 255] ^ table[2][(crcs >> 16) & 255] ^ table[3][crcs >> 24]


def _after(second: ShiftTable, first: ShiftTable) -> ShiftTable:
    """The table of ``first``'s zero bytes followed by ``second``'s."""
    return _apply(second, first.reshape(-1)).reshape(4, 256)


@functools.lru_cache(maxsize=64)
def _power_of_two(m: int) -> ShiftTable:
    """The table of ``2**m`` zero bytes."""
    if m:
        half = _power_of_two(m - 1)
        return _after(half, half)
    return (_NO_BYTES >> 8) ^ _CRC_TABLE[_NO_BYTES & 255]  # one zero byte through the CRC register


@functools.lru_cache(maxsize=256)
def _levels(nbytes: int, count: int) -> list[ShiftTable]:
    """The tables of ``nbytes``, ``2 * nbytes``, ... ``2**(count - 1) * nbytes`` zero bytes."""
    table, m, n = None, 0, nbytes
    while n:
        if n & 1:
            table = _power_of_two(m) if table is None else _after(_power_of_two(m), table)
        n, m = n >> 1, m + 1
    levels = [table if table is not None else _NO_BYTES]
    for _ in range(count - 1):
        levels.append(_after(levels[-1], levels[-1]))
    return levels


def combined(crcs: Any, nbytes: int) -> Any:
    """The CRC-32 of each row's concatenated pieces: ``crcs`` is a (runs, k) array of the CRC-32s of pieces of
    ``nbytes`` bytes each, in order; returns a (runs,) uint32 array."""
    crcs = np.asarray(crcs, dtype=np.uint32)
    runs, k = crcs.shape
    width = 1 << max(0, (k - 1).bit_length())
    tree = np.zeros((runs, width), dtype=np.uint32)
    tree[:, width - k :] = crcs  # zeros in front: shift(0) = 0 adds nothing
    levels = _levels(nbytes, max(1, width.bit_length() - 1))
    level = 0
    while tree.shape[1] > 1:
        tree = _apply(levels[level], tree[:, 0::2]) ^ tree[:, 1::2]
        level += 1
    return tree[:, 0]
