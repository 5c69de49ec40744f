"""Reading rows of checkpoint tensors: only the files that hold them, each piece checked before any data is read.

[Note: reading only what a rank needs]
A load names, for each tensor, the rows this rank holds and the tensor to read them into (``RowReads.add``).
``run`` then works in two passes:

1. Check: resolve the pieces holding those rows (by the writer's rule, see [Note: rows by rule], or from a
   version-1 list), read the header of each file they lie in (once per load: ``CheckpointFiles`` keeps it) and check
   every piece against it (key, dtype, shape). Nothing is allocated or read before this pass has passed.
2. Read: file by file, each file opened once, each piece's bytes read straight into its destination when dtype and
   device allow (else into a buffer, then copied), a piece read whole checked against its CRC-32; small whole pieces
   of consecutive shard files in runs, a few large reads for many pieces (see [Note: runs of pieces]).

So a rank opens only the files that hold its rows and its work grows with its own pieces, whatever world size
wrote the checkpoint. Rows are read with plain file reads, not through a memory map: the process holds only the
rows it asked for (mapped pages would count in its RSS, and fault-around maps neighbouring rows too), and a file
shorter than its header says fails the read instead of the process.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, cast

import numpy as np
import torch
from torch import Tensor

from lightning_shard.checkpoint.format import (
    CheckpointError,
    CheckpointFiles,
    SafetensorsHeader,
    TensorTable,
    is_remote,
)
from lightning_shard.checkpoint.layout import Piece, RowSplit, StoredTensor, check_piece, rows_per_shard


class FileHandles:
    """Files kept open across many ``RowReads.run`` calls (consolidate, export): at most ``limit`` at a time, the
    least recently used closed first."""

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._open: OrderedDict[tuple[int, str], io.BufferedReader] = OrderedDict()

    def __enter__(self) -> FileHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, files: CheckpointFiles, name: str) -> io.BufferedReader:
        slot = (id(files), name)
        if slot in self._open:
            self._open.move_to_end(slot)
            return self._open[slot]
        while len(self._open) >= self._limit:
            self._open.popitem(last=False)[1].close()
        handle = self._open[slot] = files.open(name)
        return handle

    def close(self) -> None:
        while self._open:
            self._open.popitem()[1].close()


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
# files by table, and checks one piece of each run in full; pass 2 reads each file's span in one call, scattered
# straight into the targets (``preadv``; where there is none, into one row of a 2-D buffer, a window of files at a
# time, each run's pieces then copied at once). What is left per piece is its CRC-32 and a few Python operations.


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
                handle = pool.get(files, name)
                for span in _spans(sorted(reads), _gap_bytes(files)):
                    _read_span(files, handle, span, views)
            by_group: dict[int, list[_Run]] = {}
            for run in runs:
                by_group.setdefault(run.group, []).append(run)
            scratch = np.empty(_SPAN_BYTES if runs else 0, dtype=np.uint8)  # one buffer for every window
            for g, group_runs in by_group.items():
                _read_group(groups[g], group_runs, arrays, views, pool, scratch)
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
        edges = [placement.piece(s) for s in range(first, last + 1) if not whole_from <= s <= whole_to]
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
                check_piece(t.entry, placement.piece(s), group.headers[s - group.first])
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


_GAP_BYTES = 64 * 2**10  # reads of one file closer than this are one read (fewer calls; little read twice)
_SPAN_BYTES = 16 * 2**20  # ... up to this much at a time; and the buffer runs are read through
_RUN_PIECE_BYTES = 2**20  # pieces up to this size are read in runs; a larger one alone, straight into its target


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


def _read_span(files: CheckpointFiles, handle: io.BufferedReader, span: list[_Read], views: list[memoryview]) -> None:
    """The pieces of ``span`` into the bytes of their targets, each checked against its CRC-32."""
    first = span[0]
    handle.seek(first.offset)
    if len(span) == 1:
        data = views[first.target][first.at : first.at + first.nbytes]
        if handle.readinto(data) != first.nbytes:
            _truncated(files, first.piece)
        _check_crc(files, first.piece, data, first.crc32)
        return
    block = memoryview(bytearray(max(r.offset + r.nbytes for r in span) - first.offset))
    if handle.readinto(block) != len(block):
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
    groups: list[_Group] = []
    depth = 0
    for s in range(len(names)):
        depth += marks[s]
        if not depth:
            continue
        header = files.header(names[s])
        if files.checksums_in_headers and not header.crc32:
            raise CheckpointError(f"Checkpoint file {files.directory / names[s]} records no CRC-32s: it is damaged.")
        group = groups[-1] if groups else None
        if group is not None and group.last == s - 1 and group.table is header.table:
            group.headers.append(header)
            groups[-1] = group._replace(last=s)
        else:
            groups.append(_Group(files, names, s, s, header.table, [header]))
    return groups


def _read_group(
    group: _Group, runs: list[_Run], arrays: list[Any], views: list[memoryview], pool: FileHandles, scratch: Any
) -> None:
    """The pieces of ``runs`` from the files of ``group``. Their bytes lie at the same places in every file of the
    group: the places are joined into segments (pieces at most ``_gap_bytes`` apart, at most ``scratch``'s size).
    Each file's segment is read in one call: scattered straight into the targets where the system can (``preadv``,
    the bytes between pieces into ``scratch``), else into one row of a 2-D buffer, a window of files at a time,
    from which each run's pieces are copied to its target at once. Every piece is checked against its CRC-32."""
    checksums = _checksums_of(group)
    segments: list[list[_Run]] = []
    gap = _gap_bytes(group.files)
    for run in sorted(runs, key=lambda run: run.begin):
        near = segments and run.begin - _end(segments[-1]) <= gap
        if near and run.begin + run.nbytes - segments[-1][0].begin <= len(scratch):
            segments[-1].append(run)
        else:
            segments.append([run])
    for segment in segments:
        lo, hi = segment[0].begin, _end(segment)
        if _scatters(group):
            for shard in range(group.first, group.last + 1):
                _scatter(group, shard, segment, lo, views, pool, scratch, checksums)
            continue
        rows = max(1, len(scratch) // (hi - lo))
        for w0 in range(group.first, group.last + 1, rows):
            w1 = min(group.last, w0 + rows - 1)
            need = (w1 - w0 + 1) * (hi - lo)  # beyond the scratch buffer only if one piece is
            block = (scratch[:need] if need <= len(scratch) else np.empty(need, np.uint8)).reshape(w1 - w0 + 1, -1)
            for j in range(w1 - w0 + 1):
                if any(run.first <= w0 + j <= run.last for run in segment):
                    _read_into(group, pool, w0 + j, lo, block[j])
            flat = memoryview(cast(Any, block.reshape(-1)))
            for run in segment:
                a, b = max(run.first, w0), min(run.last, w1)
                if a > b:
                    continue
                if checksums is not None:  # each piece's CRC-32, from the buffer's bytes: no view per piece
                    first, stride, n = (a - w0) * (hi - lo) + run.begin - lo, hi - lo, run.nbytes
                    actual = [zlib.crc32(flat[o : o + n]) for o in range(first, first + (b - a + 1) * stride, stride)]
                    crcs, column = checksums
                    if actual != crcs[a - group.first : b - group.first + 1, column[run.key]].tolist():
                        _corrupted(group, run, a, block[a - w0 : b - w0 + 1, run.begin - lo : run.begin - lo + n])
                pieces = block[a - w0 : b - w0 + 1, run.begin - lo : run.begin - lo + run.nbytes]
                at = run.at + (a - run.first) * run.nbytes
                arrays[run.target][at : at + (b - a + 1) * run.nbytes].reshape(b - a + 1, run.nbytes)[...] = pieces


def _scatters(group: _Group) -> bool:
    """Whether the files of ``group`` are read with ``os.preadv`` (local files, where the system has it)."""
    return hasattr(os, "preadv") and not is_remote(group.files.directory)


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
    fd = pool.get(group.files, group.shard_files[shard]).fileno()
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
    crcs = np.array([list(header.crc32.values()) for header in group.headers], dtype=np.int64)  # in table order
    return crcs, {key: i for i, key in enumerate(group.table.in_order)}


def _end(runs: list[_Run]) -> int:
    return max(run.begin + run.nbytes for run in runs)


def _read_into(group: _Group, pool: FileHandles, shard: int, lo: int, row: Any) -> None:
    header = group.headers[shard - group.first]
    handle = pool.get(group.files, group.shard_files[shard])
    handle.seek(header.data_start + lo)
    if handle.readinto(row) != len(row):
        raise CheckpointError(
            f"Checkpoint file {group.files.directory / group.shard_files[shard]} is shorter than its header says: it"
            " is truncated."
        )


def _corrupted(group: _Group, run: _Run, a: int, pieces: Any) -> NoReturn:
    """Raise for the first of ``pieces`` (shards ``a``.. of ``run``) whose CRC-32 is not the one its header records."""
    headers = group.headers[a - group.first :]
    bad = next(j for j, piece in enumerate(pieces) if zlib.crc32(piece) != headers[j].crc32[run.key])
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
