"""Reading rows of checkpoint tensors: only the files that hold them, each piece checked before any data is read.

[Note: reading only what a rank needs]
A load names, for each tensor, the rows this rank holds and the tensor to read them into (``RowReads.add``).
``run`` then works in two passes:

1. Check: resolve the pieces holding those rows (by the writer's rule, see [Note: rows by rule], or from a
   version-1 list), read the header of each file they lie in (once per load: ``CheckpointFiles`` keeps it) and check
   every piece against it (key, dtype, shape). Nothing is allocated or read before this pass has passed.
2. Read: file by file, each file opened once, each piece's bytes read straight into its destination when dtype and
   device allow (else into a buffer, then copied), a piece read whole checked against its CRC-32; small whole pieces
   of consecutive shard files in runs, one read a file for all of them, checked a run at a time where they landed
   (see [Note: runs of pieces]).

So a rank opens only the files that hold its rows and its work grows with its own pieces, whatever world size
wrote the checkpoint. Rows are read with plain file reads, not through a memory map: the process holds only the
rows it asked for (mapped pages would count in its RSS, and fault-around maps neighbouring rows too), and a file
shorter than its header says fails the read instead of the process.
"""

from __future__ import annotations

import binascii
import bisect
import itertools
import math
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple, NoReturn, cast

import numpy as np
import torch
from torch import Tensor

from lightning_shard.checkpoint import scattered_reads
from lightning_shard.checkpoint.crc32_combine import combined
from lightning_shard.checkpoint.format import (
    RUNNING_CRC32_METADATA,
    SMALL_PIECE_BYTES,
    CheckpointError,
    CheckpointFiles,
    Checksums,
    SafetensorsHeader,
    TensorTable,
    is_remote,
)
from lightning_shard.checkpoint.layout import Piece, RowSplit, StoredTensor, check_piece, rows_per_shard
from lightning_shard.checkpoint.scattered_reads import ScatteredRead


class FileHandles:
    """Files kept open across many ``RowReads.run`` calls (consolidate, export): at most ``limit`` at a time, the
    least recently used closed first. A local file is held as a raw descriptor, read with ``pread``/``preadv`` (no
    file object, no seek); an object at a URL as its file object."""

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._open: OrderedDict[tuple[int, str], int | BinaryIO] = OrderedDict()

    def __enter__(self) -> FileHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, files: CheckpointFiles, name: str) -> int | BinaryIO:
        """``name``'s descriptor (a local file, where the system has ``preadv``) or file object, opened if need be."""
        slot = (id(files), name)
        handle = self._open.get(slot)
        if handle is not None:
            self._open.move_to_end(slot)
            return handle
        while len(self._open) >= self._limit:
            _close(self._open.popitem(last=False)[1])
        handle = self._open[slot] = files.open_local(name)[0] if _scatters(files) else files.open(name)
        return handle

    def read_into(self, files: CheckpointFiles, name: str, offset: int, buffer: Any) -> int:
        """Read ``name``'s bytes from ``offset`` into ``buffer``; how many were read (fewer: the file ends)."""
        handle = self.get(files, name)
        if isinstance(handle, int):
            return os.preadv(handle, [buffer], offset)
        handle.seek(offset)
        return handle.readinto(buffer)  # type: ignore[attr-defined]

    def close(self) -> None:
        while self._open:
            _close(self._open.popitem()[1])


def _close(handle: int | BinaryIO) -> None:
    if isinstance(handle, int):
        os.close(handle)
    else:
        handle.close()


@dataclass(frozen=True)
class _Target:
    entry: StoredTensor
    start: int
    stop: int
    into: Tensor | None  # None: a new tensor, allocated once every piece has been checked


class _Read(NamedTuple):
    """One piece (or part of one) to read on its own."""

    offset: int  # of the first byte, in the file
    nbytes: int
    target: int  # which _Target
    at: int  # byte offset in the target
    crc32: int | None  # the piece's checksum, when this read covers the piece whole
    piece: Piece


class _Group(NamedTuple):
    """Consecutive shard files of one checkpoint whose headers have one table: the same tensors at the same places."""

    files: CheckpointFiles
    shard_files: tuple[str, ...]
    first: int  # the first shard
    last: int  # the last shard (included)
    table: TensorTable
    headers: list[SafetensorsHeader]  # of shards first..last


class _Run(NamedTuple):
    """Whole pieces of equal size of one tensor from shards ``first..last`` of one group: the same bytes of each file's
    data section, into consecutive bytes of the target (see [Note: runs of pieces])."""

    group: int  # which _Group
    first: int
    last: int
    begin: int  # where each piece starts in its file's data section
    nbytes: int  # of each piece
    key: str
    target: int
    at: int  # where the first piece goes in the target


# [Note: runs of pieces]
# A checkpoint written by W ranks holds about W pieces of each tensor, and a rank of a much smaller world reads most of
# them whole: 1,024 writers, 2 readers, ~400 tensors: ~100,000 pieces a rank. They come in runs: consecutive shard
# files hold equal pieces at the same place (their headers have the same table, see ``TensorTable``), and the pieces
# land one after the other in the target. Pass 1 reads the header of each shard file the rank needs once, groups the
# files by table, and checks one piece of each run in full; pass 2 reads each local file's pieces in one C
# ``preadv`` straight into their targets (``ScatteredRead``: no Python object a piece) and checks each run where it
# landed with one CRC-32 call (see [Note: checking pieces where they land]). Where the C library has no ``preadv``,
# or the files are objects at a URL, each file's span goes through one row of a 2-D buffer, a window of files at a
# time, checked with a CRC-32 call a file where its header records running CRC-32s (see [Note: one checksum a file
# read]), else a call a piece, and each run's pieces are copied out at once.

# [Note: one checksum a file read]
# Checking ~100,000 small pieces one CRC-32 at a time costs a Python call and a view each (and one more view each for
# the ``preadv`` list). A file written with checksums records, beside each tensor's CRC-32 (``"crc32"``), the running
# CRC-32 of its data section at each tensor's end (``"crc32_running"``: the CRC-32 of the bytes from the section's
# start through that tensor; the last one is the whole section's). The bytes from where one tensor ends to where a
# later one ends are checked with one ``zlib.crc32`` call: continued from the running CRC-32 where they start, it must
# give the running CRC-32 where they end. So where every file of a group records them and the pieces are small
# (``_SCATTER_PIECE_BYTES``), the group's shards are split into parts whose files the same runs read from; in each
# part's files the runs' pieces lie in a few spans (pieces at most ``_CRC_GAP_BYTES`` apart share one, the bytes
# between them checked too); each file's spans are read in one call (``preadv``, the bytes between spans into a small
# buffer, not kept) into one row of the scratch buffer, a window of files at a time, each span is checked with one
# call, and each run's pieces are copied out of the window at once. A mismatch is named by the file, and by the
# tensor whose own CRC-32 fails, when one does. Large pieces are still scattered straight into their targets and
# checked one by one (a call a piece costs less than copying them), and files written before the running CRC-32s
# were recorded are read as before, each piece checked against its own CRC-32.


class RowReads:
    """Rows of many tensors, read in two passes (see [Note: reading only what a rank needs])."""

    def __init__(self) -> None:
        self._targets: list[_Target] = []

    def add(self, entry: StoredTensor, start: int, stop: int, into: Tensor | None = None) -> int:
        """Read rows ``[start, stop)`` of ``entry`` into ``into`` (any tensor of that many elements; cast when its
        dtype differs), or into a new tensor when ``into`` is ``None``. Returns the position of the result in
        ``run()``'s list."""
        if into is not None and into.numel() != (stop - start) * math.prod(entry.row_shape):
            raise ValueError(f"Rows [{start}, {stop}) of {entry.key} do not fit a tensor of shape {tuple(into.shape)}.")
        self._targets.append(_Target(entry, start, stop, into))
        return len(self._targets) - 1

    def run(self, handles: FileHandles | None = None) -> list[Tensor]:
        """Check, then read, everything added; the tensors read, in the order they were added. A new tensor has shape
        ``(stop - start, *row_shape)`` (a 0-dim tensor read whole: shape ``()``)."""
        with ExitStack() as stack:
            for files in {id(t.entry.files): t.entry.files for t in self._targets}.values():
                stack.enter_context(files.held_open())
            return self._run(handles)

    def _run(self, handles: FileHandles | None) -> list[Tensor]:
        by_file: dict[tuple[CheckpointFiles, str], list[_Read]] = {}
        whole: list[tuple[int, int, int]] = []  # (target, first, last): shards holding whole, full pieces of it
        for i, t in enumerate(self._targets):
            self._check(i, t, by_file, whole)
        groups, runs = self._check_runs(whole)
        buffers = [self._buffer(t) for t in self._targets]  # allocated only now: every piece has been checked
        arrays = [buffer.view(torch.uint8).numpy() for buffer in buffers]  # the targets' bytes, writable
        views = [memoryview(cast(Any, array)) for array in arrays]
        pool = handles if handles is not None else FileHandles()
        try:
            for (files, name), reads in sorted(by_file.items(), key=lambda item: item[0][1]):
                for span in _spans(sorted(reads), _gap_bytes(files)):
                    _read_span(files, name, pool, span, views)
            by_group: dict[int, list[_Run]] = {}
            for run in runs:
                by_group.setdefault(run.group, []).append(run)
            scratch = np.empty(_SPAN_BYTES if runs else 0, dtype=np.uint8)  # one buffer for every window
            for g, group_runs in by_group.items():
                _read_group(groups[g], group_runs, arrays, views, pool, scratch, kept=handles)
        finally:
            if handles is None:
                pool.close()
        with torch.no_grad():
            return [self._result(t, buffer) for t, buffer in zip(self._targets, buffers)]

    # Pass 1 #

    def _check(
        self, i: int, t: _Target, by_file: dict[tuple[CheckpointFiles, str], list[_Read]],
        whole: list[tuple[int, int, int]],
    ) -> None:
        """Check every piece of target ``i`` against its file's header and plan its reads, except the whole, full
        pieces of a split tensor: those are noted in ``whole``, for runs."""
        entry, placement = t.entry, t.entry.placement
        if not (isinstance(placement, RowSplit) and t.start < t.stop):
            self._check_pieces(i, t, entry.pieces(t.start, t.stop), by_file)
            return
        per, rows = rows_per_shard(placement.rows, placement.shard_size), placement.rows
        first, last = t.start // per, (t.stop - 1) // per
        whole_from = first if t.start == first * per else first + 1  # the shards whose pieces are read whole...
        whole_to = min(last if min(rows, (last + 1) * per) <= t.stop else last - 1, rows // per - 1)  # ... and full
        if per * math.prod(entry.row_shape) * entry.dtype.itemsize > _RUN_PIECE_BYTES:
            whole_to = whole_from - 1  # large pieces: each read straight into its target, in one call of its own
        if whole_from <= whole_to:  # the pieces at either end, cut or short
            edges = [placement.piece(s) for s in (*range(first, whole_from), *range(whole_to + 1, last + 1))]
        else:
            edges = [placement.piece(s) for s in range(first, last + 1)]
        self._check_pieces(i, t, edges, by_file)
        if whole_from <= whole_to:
            whole.append((i, whole_from, whole_to))

    def _check_pieces(
        self, i: int, t: _Target, pieces: list[Piece], by_file: dict[tuple[CheckpointFiles, str], list[_Read]]
    ) -> None:
        entry, files, start, stop = t.entry, t.entry.files, t.start, t.stop
        row_bytes = math.prod(entry.row_shape) * entry.dtype.itemsize
        files.pieces_checked += len(pieces)
        for piece in pieces:
            header = files.header(piece.file)
            crc = check_piece(entry, piece, header)
            a, b = max(start, piece.lo), min(stop, piece.hi)
            offset = header.data_start + header.entries[piece.key].begin + (a - piece.lo) * row_bytes
            read = _Read(offset, (b - a) * row_bytes, i, (a - start) * row_bytes,
                         crc if a == piece.lo and b == piece.hi else None, piece)
            by_file.setdefault((files, piece.file), []).append(read)

    def _check_runs(self, whole: list[tuple[int, int, int]]) -> tuple[list[_Group], list[_Run]]:
        """Group the shard files ``whole`` needs by table (each header read once), then one run per target and group,
        its first piece checked in full against the group's table (see [Note: runs of pieces])."""
        if not whole:
            return [], []
        placements = {i: cast(RowSplit, self._targets[i].entry.placement) for i, _, _ in whole}
        groups = _groups(self._targets[whole[0][0]].entry.files, placements[whole[0][0]].shard_files,
                         [(first, last) for _, first, last in whole])
        starts = [g.first for g in groups]
        runs = []
        for i, first, last in whole:
            t, placement = self._targets[i], placements[i]
            if placement.shard_files is not groups[0].shard_files or t.entry.files is not groups[0].files:
                raise ValueError("Internal error: one RowReads reads the split tensors of one checkpoint.")
            per = rows_per_shard(placement.rows, placement.shard_size)
            row_bytes = math.prod(t.entry.row_shape) * t.entry.dtype.itemsize
            t.entry.files.pieces_checked += last - first + 1
            g = bisect.bisect_right(starts, first) - 1
            s = first
            while s <= last:  # the groups cover first..last without a gap: every shard of it is needed
                group = groups[g]
                end = min(group.last, last)
                # the shape alone: every file of the group records a CRC-32 for each of its tensors (``_groups``)
                check_piece(t.entry, placement.piece(s), group.headers[s - group.first], checksum=False)
                begin = group.table.entries[placement.key].begin
                runs.append(_Run(g, s, end, begin, per * row_bytes, placement.key, i, (s * per - t.start) * row_bytes))
                s, g = end + 1, g + 1
        return groups, runs

    # Pass 2 #

    @staticmethod
    def _buffer(t: _Target) -> Tensor:
        """Where the bytes go: ``into`` itself when they can land there unchanged, else a buffer of the stored dtype."""
        into = t.into
        if into is not None and into.dtype == t.entry.dtype and into.device.type == "cpu" and into.is_contiguous():
            return into.detach().reshape(-1)
        return torch.empty((t.stop - t.start) * math.prod(t.entry.row_shape), dtype=t.entry.dtype)

    @staticmethod
    def _result(t: _Target, buffer: Tensor) -> Tensor:
        if t.into is None:
            if not t.entry.shape:
                return buffer.reshape(()) if t.stop > t.start else buffer
            return buffer.view(t.stop - t.start, *t.entry.row_shape)
        if buffer.numel() and (buffer.data_ptr() != t.into.data_ptr() or buffer.dtype != t.into.dtype):
            t.into.copy_(buffer.view(t.into.shape))
        return t.into


_SCATTERED_READS = scattered_reads.available()  # runs of local files read in place (see [Note: checking pieces ...])
_GAP_BYTES = 64 * 2**10  # reads of one file closer than this are one read (fewer calls; little read twice)
_SPAN_BYTES = 8 * 2**20  # ... up to this much at a time; and the buffer runs are read through (two fit in L3)
_RUN_PIECE_BYTES = 2**20  # pieces up to this size are read in runs; a larger one alone, straight into its target
_CRC_GAP_BYTES = 4 * 2**10  # pieces read this close are checked in one CRC-32 call, the bytes between them too
_SCATTER_PIECE_BYTES = 32 * 2**10  # runs of pieces this large on average are scattered by preadv, each piece checked
# on its own (a CRC-32 call a piece costs less than copying it out of a buffer); smaller ones go through the buffer,
# one CRC-32 a file (see [Note: one checksum a file read])


def _gap_bytes(files: CheckpointFiles) -> int:
    """How far apart two reads of one file may be and still be one read: none for an object at a URL, where every
    byte read is a byte downloaded (and paid for), so each rank fetches only its own."""
    return _GAP_BYTES if not is_remote(files.directory) else 0


def _spans(reads: list[_Read], gap: int = _GAP_BYTES) -> list[list[_Read]]:
    """``reads`` (sorted by offset) in runs to read at once: many small pieces in few calls; a large piece alone,
    straight into its target. Reads at most ``gap`` bytes apart are joined."""
    spans: list[list[_Read]] = []
    end = 0  # of the last span
    for read in reads:
        if spans and read.offset - end <= gap and read.offset + read.nbytes - spans[-1][0].offset <= _SPAN_BYTES:
            spans[-1].append(read)
            end = max(end, read.offset + read.nbytes)
        else:
            spans.append([read])
            end = read.offset + read.nbytes
    return spans


def _read_span(
    files: CheckpointFiles, name: str, pool: FileHandles, span: list[_Read], views: list[memoryview]
) -> None:
    """The pieces of ``span`` (of the file ``name``) into the bytes of their targets, each checked against its
    CRC-32."""
    first = span[0]
    if len(span) == 1:
        data = views[first.target][first.at : first.at + first.nbytes]
        if pool.read_into(files, name, first.offset, data) != first.nbytes:
            _truncated(files, first.piece)
        _check_crc(files, first.piece, data, first.crc32)
        return
    block = memoryview(bytearray(max(r.offset + r.nbytes for r in span) - first.offset))
    if pool.read_into(files, name, first.offset, block) != len(block):
        _truncated(files, span[-1].piece)
    for read in span:
        data = block[read.offset - first.offset : read.offset - first.offset + read.nbytes]
        _check_crc(files, read.piece, data, read.crc32)
        views[read.target][read.at : read.at + read.nbytes] = data


def _groups(files: CheckpointFiles, names: tuple[str, ...], ranges: list[tuple[int, int]]) -> list[_Group]:
    """The shards of ``ranges`` (inclusive), in order, in groups of consecutive shards whose headers share a table;
    each header read once (and its checksums checked present)."""
    marks = [0] * (len(names) + 1)
    for first, last in ranges:
        marks[first] += 1
        marks[last + 1] -= 1
    starts: list[int] = []  # each group's first shard; its headers
    headers: list[list[SafetensorsHeader]] = []
    depth, table, last = 0, None, -2
    for s in range(len(names)):
        depth += marks[s]
        if not depth:
            continue
        header = files.header(names[s])
        if files.checksums_in_headers and not header.crc32:
            raise CheckpointError(f"Checkpoint file {files.directory / names[s]} records no CRC-32s: it is damaged.")
        if last == s - 1 and header.table is table:
            headers[-1].append(header)
        else:
            starts.append(s)
            headers.append([header])
        table, last = header.table, s
    return [_Group(files, names, s, s + len(h) - 1, h[0].table, h) for s, h in zip(starts, headers)]


def _read_group(
    group: _Group, runs: list[_Run], arrays: list[Any], views: list[memoryview], pool: FileHandles, scratch: Any,
    kept: FileHandles | None = None,
) -> None:
    """The pieces of ``runs`` from the files of ``group``. Their bytes lie at the same places in every file of the
    group: the places are joined into segments (pieces at most ``_gap_bytes`` apart, at most ``scratch``'s size).
    Each file's segment is read in one call. Small pieces, from files that record running CRC-32s, go through a 2-D
    buffer, a window of files at a time, each file checked with a CRC-32 call or a few (see [Note: one checksum a
    file read]). Else they are scattered straight into the targets where the system can (``preadv``, the bytes
    between pieces into ``scratch``), or go through the 2-D buffer, and every piece is checked against its CRC-32.
    From the buffer, each run's pieces are copied to its target at once."""
    if _SCATTERED_READS and _scatters(group.files) and not _overlapping(runs):
        _read_group_scattered(group, runs, arrays, views, kept)
        return
    segments: list[list[_Run]] = []
    gap, end = _gap_bytes(group.files), 0  # of the last segment
    for run in sorted(runs, key=lambda run: run.begin):
        near = segments and run.begin - end <= gap
        if near and run.begin + run.nbytes - segments[-1][0].begin <= len(scratch):
            segments[-1].append(run)
        else:
            segments.append([run])
        end = max(end, run.begin + run.nbytes)
    running = all(header.running_crc32 is not None for header in group.headers)
    checksums = None
    for segment in segments:
        lo, hi = segment[0].begin, _end(segment)
        scatter = _scatters(group.files) and (not running or hi - lo >= _SCATTER_PIECE_BYTES * len(segment))
        parts = None if scatter or not running else _checked_parts(group, segment)
        if parts is not None:
            for part in parts:
                read = _part_reader(group, part, pool)
                for w0, block in _windows(group, part.first, part.last, part.lo, part.hi, scratch, read):
                    _copy_runs(part.runs, w0, block, part.lo, arrays)
            continue
        if checksums is None:
            checksums = _checksums_of(group)
        if scatter:
            for shard in range(group.first, group.last + 1):
                _scatter(group, shard, segment, lo, views, pool, scratch, checksums)
            continue
        needed = _needed(group, segment)

        def read(shard: int, row: Any, lo: int = lo, needed: list[int] = needed) -> None:
            if needed[shard - group.first]:
                _read_into(group, pool, shard, lo, row)

        for w0, block in _windows(group, group.first, group.last, lo, hi, scratch, read):
            if checksums is not None:
                _check_pieces_of(group, segment, w0, block, lo, checksums)
            _copy_runs(segment, w0, block, lo, arrays)


def _same_runs(runs: list[_Run]) -> Iterator[tuple[int, int, list[_Run]]]:
    """``runs``' shards in parts from each of whose files the same runs read: (first shard, last shard + 1, those
    runs, in the order of ``runs``)."""
    cuts = sorted({run.first for run in runs} | {run.last + 1 for run in runs})
    for first, stop in zip(cuts, cuts[1:]):
        same = [run for run in runs if run.first <= first and stop - 1 <= run.last]
        if same:
            yield first, stop, same


def _overlapping(runs: list[_Run]) -> bool:
    """Whether two of ``runs`` read the same bytes of one file (two targets asked for the same rows)."""
    reading: list[_Run] = []  # runs begun before, not yet ended
    for run in sorted(runs, key=lambda run: run.begin):
        reading = [other for other in reading if other.begin + other.nbytes > run.begin]
        if any(other.first <= run.last and run.first <= other.last for other in reading):
            return True
        reading.append(run)
    return False


def _read_group_scattered(
    group: _Group, runs: list[_Run], arrays: list[Any], views: list[memoryview], kept: FileHandles | None
) -> None:
    """The pieces of ``runs`` from the local files of ``group``, each file's read in one call straight into the
    targets (``ScatteredRead``), then each run's pieces checked with one CRC-32 call where they landed (see [Note:
    checking pieces where they land]). Each file is opened once (``kept`` holds files open across reads, else each
    is closed when read: its header, read in this load, checked it)."""
    gap = np.empty(_GAP_BYTES, dtype=np.uint8)  # the bytes between two pieces of one read, not kept
    for first, stop, active in _same_runs(sorted(runs, key=lambda run: run.begin)):
        staged, stride = _staged(active, stop - first)
        staging = np.empty((stop - first, stride), dtype=np.uint8)
        reads: list[tuple[ScatteredRead, int]] = []  # and where in the data section each starts
        places: list[tuple[Any, int, int, int]] = []
        lo = at = 0
        for run in active:
            if places and run.begin - at > _GAP_BYTES:  # far apart: two reads
                reads.append((ScatteredRead(places, stop - first), lo))
                places = []
            if not places:
                lo = at = run.begin
            elif run.begin > at:
                places.append((gap, 0, run.begin - at, 0))
            if run in staged:
                places.append((staging, staged[run], run.nbytes, stride))
            else:
                places.append((arrays[run.target], run.at + (first - run.first) * run.nbytes, run.nbytes,
                               run.nbytes))
            at = run.begin + run.nbytes
        if places:
            reads.append((ScatteredRead(places, stop - first), lo))
        for shard in range(first, stop):
            name = group.shard_files[shard]
            fd = cast(int, kept.get(group.files, name)) if kept is not None else group.files.reopen(name)
            try:
                start = group.headers[shard - group.first].data_start
                for read, offset in reads:
                    if read.read(fd, shard - first, start + offset) != read.nbytes:
                        _short(group, shard)
            finally:
                if kept is None:
                    os.close(fd)
        for run, column in staged.items():  # each small run out of the buffer at once
            into = arrays[run.target][run.at + (first - run.first) * run.nbytes :]
            into[: (stop - first) * run.nbytes].reshape(stop - first, run.nbytes)[...] = staging[
                :, column : column + run.nbytes]
    checksums = _checksums_of(group)
    if checksums is not None:
        _check_landed(group, runs, views, checksums)


_STAGING_BYTES = 8 * 2**20  # small pieces read into a buffer (see [Note: small pieces together]): at most this much


def _staged(runs: list[_Run], files: int) -> tuple[dict[_Run, int], int]:
    """Which of ``runs`` (sorted by place) go through a buffer, one row a file: small pieces, where at least two lie
    next to each other (one place in the read for all of them); each one's column, and the row's length."""
    small = [run for run in runs if run.nbytes <= SMALL_PIECE_BYTES]
    adjacent = {b for a, b in zip(small, small[1:]) if a.begin + a.nbytes == b.begin}
    adjacent |= {a for a, b in zip(small, small[1:]) if a.begin + a.nbytes == b.begin}
    columns: dict[_Run, int] = {}
    stride = 0
    for run in small:
        if run in adjacent and (stride + run.nbytes) * files <= _STAGING_BYTES:
            columns[run] = stride
            stride += run.nbytes
    return columns, stride


def _check_landed(
    group: _Group, runs: list[_Run], views: list[memoryview], checksums: tuple[Any, dict[str, int]]
) -> None:
    """Check each run's pieces where they landed in its target: one CRC-32 call a run, against the CRC-32 its
    pieces' recorded ones combine to (see [Note: checking pieces where they land])."""
    crcs, column = checksums
    by_size: dict[int, list[_Run]] = {}
    for run in runs:
        by_size.setdefault(run.nbytes, []).append(run)
    for nbytes, same in by_size.items():
        width = max(run.last - run.first + 1 for run in same)
        table = np.zeros((len(same), width), dtype=np.uint32)
        for i, run in enumerate(same):
            table[i, width - (run.last - run.first + 1) :] = crcs[run.first - group.first : run.last - group.first + 1,
                                                                  column[run.key]]
        for run, expected in zip(same, combined(table, nbytes).tolist()):
            landed = views[run.target][run.at : run.at + (run.last - run.first + 1) * nbytes]
            if zlib.crc32(landed) != expected:
                pieces = [landed[j * nbytes : (j + 1) * nbytes] for j in range(run.last - run.first + 1)]
                _corrupted(group, run, run.first, pieces)


def _windows(
    group: _Group, first: int, last: int, lo: int, hi: int, scratch: Any, read: Callable[[int, Any], None]
) -> Iterator[tuple[int, Any]]:
    """Bytes ``[lo, hi)`` of the data sections of the files of shards ``first..last`` of ``group``, a window of files
    at a time: (the window's first shard, a files x bytes array whose rows ``read`` (shard, row) fills)."""
    rows = max(1, len(scratch) // max(1, hi - lo))
    for w0 in range(first, last + 1, rows):
        w1 = min(last, w0 + rows - 1)
        need = (w1 - w0 + 1) * (hi - lo)  # beyond the scratch buffer only if one piece is
        block = (scratch[:need] if need <= len(scratch) else np.empty(need, np.uint8)).reshape(w1 - w0 + 1, -1)
        for j in range(w1 - w0 + 1):
            read(w0 + j, block[j])
        yield w0, block


def _needed(group: _Group, segment: list[_Run]) -> list[int]:
    """For each shard of ``group``, how many runs of ``segment`` read from it."""
    needed = [0] * (group.last - group.first + 2)
    for run in segment:
        needed[run.first - group.first] += 1
        needed[run.last - group.first + 1] -= 1
    return list(itertools.accumulate(needed))


class _Part(NamedTuple):
    """Shards ``first..last`` of a group, from each of whose files the same runs read, and the spans of their data
    sections that hold those runs' pieces, each checked with one CRC-32 (see [Note: one checksum a file read])."""

    first: int
    last: int
    runs: list[_Run]
    spans: list[tuple[int, int, int, int]]  # [a, b) of the data section; the positions of the tensors ending at a
    # (-1: a is 0) and at b, whose running CRC-32s check it

    @property
    def lo(self) -> int:
        return self.spans[0][0]

    @property
    def hi(self) -> int:
        return self.spans[-1][1]


def _checked_parts(group: _Group, segment: list[_Run]) -> list[_Part] | None:
    """``segment``'s shards in parts that read the same runs, each run's pieces in spans that start where a tensor
    ends and end where one ends (runs at most ``_CRC_GAP_BYTES`` apart share one); ``None`` unless the files'
    running CRC-32s check every span."""
    ending_at = group.table.position_ending_at
    parts = []
    for first, stop, runs in _same_runs(segment):
        spans: list[tuple[int, int, int, int]] = []
        for run in runs:
            a, b = run.begin, run.begin + run.nbytes
            if spans and a - spans[-1][1] <= _CRC_GAP_BYTES:
                a = spans.pop()[0]
            before, through = ending_at.get(a, -1 if a == 0 else None), ending_at.get(b)
            if before is None or through is None:
                return None
            spans.append((a, b, before, through))
        parts.append(_Part(first, stop - 1, runs, spans))
    return parts


def _part_reader(group: _Group, part: _Part, pool: FileHandles) -> Callable[[int, Any], None]:
    """What reads ``part``'s bytes of a shard's file into a row and checks them: where the system can, the spans in
    one ``preadv`` (the bytes between them into a small buffer, not kept), else the whole of ``[part.lo, part.hi)``;
    then each span with one CRC-32 call."""
    lo, hi = part.lo, part.hi
    spans = [(a - lo, b - lo, 4 * before, 4 * through) for a, b, before, through in part.spans]  # in the row; words
    gaps = [next_a - b for (_, b, _, _), (next_a, _, _, _) in zip(spans, spans[1:])]
    scatter = _scatters(group.files) and len(spans) > 1 and 2 * len(spans) <= _IOV_MAX
    junk = memoryview(cast(Any, np.empty(max(gaps, default=0) if scatter else 0, np.uint8)))
    buffers: list[Any] = [None] * (2 * len(spans) - 1)  # the spans, and between them the bytes not kept
    buffers[1::2] = [junk[:n] for n in gaps]

    def read(shard: int, row: Any) -> None:
        header = group.headers[shard - group.first]
        data = memoryview(row)
        if scatter:
            buffers[::2] = [data[a:b] for a, b, _, _ in spans]
            fd = cast(int, pool.get(group.files, group.shard_files[shard]))
            if os.preadv(fd, buffers, header.data_start + lo) != hi - lo:
                _short(group, shard)
        else:
            _read_into(group, pool, shard, lo, row)
        words = cast(Checksums, header.running_crc32).words
        for a, b, before, through in spans:
            start = _WORD.unpack_from(words, before)[0] if before >= 0 else 0  # the CRC-32 of the bytes before a
            if zlib.crc32(data[a:b], start) != _WORD.unpack_from(words, through)[0]:
                _corrupted_segment(group, shard, lo + a, data[a:b])

    return read


_WORD = struct.Struct(">I")  # a running CRC-32, in a header's ``Checksums.words``


def _corrupted_segment(group: _Group, shard: int, lo: int, data: Any) -> NoReturn:
    """Raise for bytes ``[lo, lo + len(data))`` of the data section of ``shard``'s file, which fail their running
    CRC-32s: naming the first tensor among them whose own CRC-32 fails, if one does."""
    header, path = group.headers[shard - group.first], group.files.directory / group.shard_files[shard]
    for key in group.table.in_order:
        entry, crc = group.table.entries[key], header.crc32.get(key)
        inside = lo <= entry.begin and entry.end <= lo + len(data)
        if inside and crc is not None and zlib.crc32(data[entry.begin - lo : entry.end - lo]) != crc:
            raise CheckpointError(f"Checkpoint file {path} is corrupted: {key!r} does not match its checksum.")
    raise CheckpointError(
        f"Checkpoint file {path} is corrupted: its tensor data do not match the running CRC-32s its header records"
        f" ({RUNNING_CRC32_METADATA!r})."
    )


def _check_pieces_of(
    group: _Group, segment: list[_Run], w0: int, block: Any, lo: int, checksums: tuple[Any, dict[str, int]]
) -> None:
    """Check each piece of ``segment`` in the window ``block`` (shards ``w0``..) against its CRC-32, from the buffer's
    bytes: no view per piece."""
    w1, stride = w0 + block.shape[0] - 1, block.shape[1]
    flat = memoryview(cast(Any, block.reshape(-1)))
    crcs, column = checksums
    for run in segment:
        a, b = max(run.first, w0), min(run.last, w1)
        if a > b:
            continue
        first, n = (a - w0) * stride + run.begin - lo, run.nbytes
        actual = [zlib.crc32(flat[o : o + n]) for o in range(first, first + (b - a + 1) * stride, stride)]
        if actual != crcs[a - group.first : b - group.first + 1, column[run.key]].tolist():
            _corrupted(group, run, a, block[a - w0 : b - w0 + 1, run.begin - lo : run.begin - lo + n])


def _copy_runs(segment: list[_Run], w0: int, block: Any, lo: int, arrays: list[Any]) -> None:
    """Copy each run's pieces in the window ``block`` (shards ``w0``.., bytes from ``lo`` of each file's data section)
    to its target, in one copy a run."""
    w1 = w0 + block.shape[0] - 1
    for run in segment:
        a, b = max(run.first, w0), min(run.last, w1)
        if a > b:
            continue
        pieces = block[a - w0 : b - w0 + 1, run.begin - lo : run.begin - lo + run.nbytes]
        at = run.at + (a - run.first) * run.nbytes
        arrays[run.target][at : at + (b - a + 1) * run.nbytes].reshape(b - a + 1, run.nbytes)[...] = pieces


def _scatters(files: CheckpointFiles) -> bool:
    """Whether ``files`` are read with ``os.preadv`` through raw descriptors (local files, where the system has
    it)."""
    return hasattr(os, "preadv") and not is_remote(files.directory)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16


def _scatter(
    group: _Group,
    shard: int,
    segment: list[_Run],
    lo: int,
    views: list[memoryview],
    pool: FileHandles,
    scratch: Any,
    checksums: tuple[Any, dict[str, int]] | None,
) -> None:
    """The pieces ``segment``'s runs read from ``shard``'s file, read in one ``preadv`` straight into their targets,
    then checked against their CRC-32s."""
    buffers: list[memoryview] = []
    pieces: list[tuple[_Run, memoryview]] = []
    gap, at = memoryview(scratch), lo
    for run in segment:  # sorted by place in the file
        if not run.first <= shard <= run.last:
            continue
        if run.begin > at:
            buffers.append(gap[: run.begin - at])  # bytes between pieces: read, not kept
        start = run.at + (shard - run.first) * run.nbytes
        buffers.append(views[run.target][start : start + run.nbytes])
        pieces.append((run, buffers[-1]))
        at = run.begin + run.nbytes
    if not pieces:
        return
    fd = cast(int, pool.get(group.files, group.shard_files[shard]))
    offset = group.headers[shard - group.first].data_start + lo
    for k in range(0, len(buffers), _IOV_MAX):
        chunk = buffers[k : k + _IOV_MAX]
        expected = at - lo if len(buffers) <= _IOV_MAX else sum(len(b) for b in chunk)
        if os.preadv(fd, chunk, offset) != expected:
            raise CheckpointError(
                f"Checkpoint file {group.files.directory / group.shard_files[shard]} is shorter than its header says:"
                " it is truncated."
            )
        offset += expected
    if checksums is not None:
        crcs, column = checksums
        row = crcs[shard - group.first].tolist()
        for run, data in pieces:
            if zlib.crc32(data) != row[column[run.key]]:
                raise CheckpointError(
                    f"Checkpoint file {group.files.directory / group.shard_files[shard]} is corrupted: {run.key!r} does"
                    " not match its checksum."
                )


def _checksums_of(group: _Group) -> tuple[Any, dict[str, int]] | None:
    """The CRC-32 of every tensor of every file of ``group`` (a files x tensors array: one table, so one order), and
    each tensor's column; ``None`` when the checkpoint records none."""
    if not group.files.checksums_in_headers:
        return None
    try:  # every file's digits at once
        joined = binascii.unhexlify(b"".join(header.crc32.digits for header in group.headers))
    except ValueError:
        for header in group.headers:
            header.crc32.words  # noqa: B018 - raises, naming the file whose digits are not hex
        raise
    words = np.frombuffer(joined, dtype=">u4")
    crcs = words.astype(np.int64).reshape(len(group.headers), -1)  # in table order
    return crcs, {key: i for i, key in enumerate(group.table.in_order)}


def _end(runs: list[_Run]) -> int:
    return max(run.begin + run.nbytes for run in runs)


def _read_into(group: _Group, pool: FileHandles, shard: int, lo: int, row: Any) -> None:
    header = group.headers[shard - group.first]
    if pool.read_into(group.files, group.shard_files[shard], header.data_start + lo, row) != len(row):
        _short(group, shard)


def _short(group: _Group, shard: int) -> NoReturn:
    raise CheckpointError(
        f"Checkpoint file {group.files.directory / group.shard_files[shard]} is shorter than its header says: it is"
        " truncated."
    )


def _corrupted(group: _Group, run: _Run, a: int, pieces: Any) -> NoReturn:
    """Raise for the first of ``pieces`` (shards ``a``.. of ``run``) whose CRC-32 is not the one its header records."""
    headers = group.headers[a - group.first :]
    bad = next((j for j, piece in enumerate(pieces) if zlib.crc32(piece) != headers[j].crc32[run.key]), None)
    if bad is None:
        raise CheckpointError(f"Internal error: the pieces of {run.key!r} match their checksums but not together.")
    raise CheckpointError(
        f"Checkpoint file {group.files.directory / group.shard_files[a + bad]} is corrupted: {run.key!r} does not match"
        " its checksum."
    )


def _check_crc(files: CheckpointFiles, piece: Piece, data: memoryview, crc: int | None) -> None:
    if crc is not None and zlib.crc32(data) & 0xFFFFFFFF != crc:
        raise CheckpointError(
            f"Checkpoint file {files.directory / piece.file} is corrupted: {piece.key!r} does not match its checksum."
        )


def _truncated(files: CheckpointFiles, piece: Piece) -> NoReturn:
    raise CheckpointError(f"Checkpoint file {files.directory / piece.file} ends inside {piece.key!r}: it is truncated.")


def read_rows(entry: StoredTensor, start: int, stop: int, handles: FileHandles | None = None) -> Tensor:
    """Rows ``[start, stop)`` (dim 0) of ``entry``, reading only the pieces that hold them (checked first). A 0-dim
    tensor is one row: read whole (shape ``()``) unless ``[start, stop)`` is empty (then an empty 1-D tensor)."""
    reads = RowReads()
    reads.add(entry, start, stop)
    return reads.run(handles)[0]


def read_tensor(entry: StoredTensor, handles: FileHandles | None = None) -> Tensor:
    """The whole of ``entry``, in its shape."""
    return read_rows(entry, 0, entry.rows, handles).reshape(entry.shape)
