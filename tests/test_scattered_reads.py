"""Reading many files' pieces in place: one C ``preadv`` a file into places a numpy array of iovecs names
(``scattered_reads``), and each run of pieces checked with one CRC-32 call against the CRC-32 their recorded ones
combine to (``crc32_combine``). See [Note: checking pieces where they land] in
lightning_shard/checkpoint/crc32_combine.py."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from lightning_shard.checkpoint import scattered_reads
from lightning_shard.checkpoint.crc32_combine import combined
from lightning_shard.checkpoint.scattered_reads import ScatteredRead

pytestmark = pytest.mark.skipif(not scattered_reads.available(), reason="the C library has no preadv")


@pytest.mark.parametrize(("nbytes", "k"), [(4, 1), (8, 3), (1, 7), (0, 5), (3, 2), (2048, 512), (4096, 257),
                                           (100_003, 6), (12, 1025)])
def test_combined_crc32_is_the_crc32_of_the_concatenation(nbytes: int, k: int) -> None:
    rng = np.random.default_rng(nbytes * 31 + k)
    pieces = rng.integers(0, 256, (3, k, nbytes), dtype=np.uint8)
    crcs = [[zlib.crc32(piece.tobytes()) for piece in run] for run in pieces]
    assert combined(np.array(crcs), nbytes).tolist() == [zlib.crc32(run.tobytes()) for run in pieces]


def test_runs_of_fewer_pieces_padded_with_zero_crc32s_in_front_combine_alike() -> None:
    rng = np.random.default_rng(0)
    runs = [rng.integers(0, 256, (k, 40), dtype=np.uint8) for k in (1, 2, 5, 9)]
    table = np.zeros((len(runs), 9), dtype=np.uint32)
    for i, run in enumerate(runs):
        table[i, 9 - len(run) :] = [zlib.crc32(piece.tobytes()) for piece in run]
    assert combined(table, 40).tolist() == [zlib.crc32(run.tobytes()) for run in runs]


def test_a_changed_byte_changes_the_combined_crc32() -> None:
    rng = np.random.default_rng(1)
    run = rng.integers(0, 256, (64, 24), dtype=np.uint8)
    expected = int(combined(np.array([[zlib.crc32(piece.tobytes()) for piece in run]]), 24)[0])
    for j in (0, 777, 24 * 64 - 1):
        changed = run.copy().reshape(-1)
        changed[j] ^= 1
        assert zlib.crc32(changed.tobytes()) != expected, j


def _files(tmp_path: Path, count: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(2)
    contents = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]
    for i, data in enumerate(contents):
        (tmp_path / f"{i}").write_bytes(data.tobytes())
    return contents


@pytest.mark.parametrize(("iov_max", "rows_at_once"), [(1024, 2**16), (2, 2**16), (1024, 4), (3, 1)])
def test_a_scattered_read_puts_each_files_bytes_in_its_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, iov_max: int, rows_at_once: int
) -> None:
    monkeypatch.setattr(scattered_reads, "_IOV_MAX", iov_max)
    monkeypatch.setattr(scattered_reads, "_IOV_ROWS_AT_ONCE", rows_at_once)
    contents = _files(tmp_path, 9, 100)
    first, second, gap = np.zeros(9 * 30, np.uint8), np.zeros(9 + 9 * 51, np.uint8), np.zeros(20, np.uint8)
    read = ScatteredRead([(first, 0, 30, 30), (gap, 0, 12, 0), (second, 9, 50, 51)], 9)  # file bytes [5, 97)
    assert read.nbytes == 92
    for i in (8, 0, *range(1, 8)):  # any order
        fd = os.open(tmp_path / f"{i}", os.O_RDONLY)
        try:
            assert read.read(fd, i, 5) == 92
        finally:
            os.close(fd)
    assert (first.reshape(9, 30) == np.stack([data[5:35] for data in contents])).all()
    rows = second[9:].reshape(9, 51)
    assert (rows[:, :50] == np.stack([data[47:97] for data in contents])).all()
    assert not second[:9].any() and not rows[:, 50].any()  # nothing outside the places


def test_a_scattered_read_says_how_many_bytes_a_short_file_had(tmp_path: Path) -> None:
    _files(tmp_path, 1, 60)
    target = np.zeros(80, np.uint8)
    read = ScatteredRead([(target, 0, 40, 40), (target, 40, 40, 40)], 1)
    fd = os.open(tmp_path / "0", os.O_RDONLY)
    try:
        assert read.read(fd, 0, 0) == 60
    finally:
        os.close(fd)


@pytest.mark.parametrize("place", [(0, 11, 10, 2), (-1, 4, 4, 1), (2, 4, 4, 5), (0, 4, -1, 2), (0, 21, 0, 1)])
def test_a_place_outside_its_buffer_is_refused_before_anything_is_read(place: tuple[int, int, int, int]) -> None:
    start, length, step, count = place  # a buffer of 20 bytes
    with pytest.raises(ValueError, match="would write outside its buffer"):
        ScatteredRead([(np.zeros(20, np.uint8), start, length, step)], count)
    read = ScatteredRead([(np.zeros(20, np.uint8), 0, 10, 10)], 2)
    with pytest.raises(ValueError, match="file 2 of a scattered read over 2"):
        read.read(0, 2, 0)
