"""Reading rows of checkpoint tensors: only the files that hold them, every byte that lands checked.

[Note: every byte that lands is checked]
A load names, for each tensor, the rows this rank needs (``RowReads.add``); ``read`` then works in two passes:

1. Plan: resolve the pieces holding those rows (by the writer's rule, see [Note: rows by rule], or from a version-1
   list), read the header of each file they lie in (once per load: ``CheckpointFiles`` keeps it) and check each piece
   against it (key, dtype, shape). Nothing is allocated or read before this pass has passed. The bytes a rank needs
   of a piece are widened to what its file's checksums cover: the blocks of ``crc32_block_bytes`` holding them
   (version 3: at most a block more at each end), or the whole piece (versions 1-2 record a CRC-32 per tensor).
2. Read: those extents, a window of files at a time, every block (or piece) checked against its CRC-32 before its
   bytes are copied out. Results are new tensors; the tensors a caller named (``into``) are written only by
   ``commit``, once everything has been read and checked, so a read that fails leaves them as they were.

So every byte that lands has passed a CRC-32, whatever part of a piece a rank reads, at any world size, from a local
directory or a URL alike: one path, plain file reads (no memory map: the process holds only what it asked for, and a
file shorter than its header says fails the read instead of the process). Files no checkpoint wrote (a Hugging Face
model file) record no checksums; their bytes are read as they are.

[Note: runs of pieces]
A checkpoint written by W ranks holds W pieces of each split tensor, and a rank of a much smaller world reads most of
them whole (1,024 writers, 2 readers: ~100,000 pieces a rank). Consecutive shard files mostly have equal headers (the
same tensors at the same places: one shared ``TensorTable``), and the pieces they hold of a tensor land one after the
other in its target. So the files are taken in groups of consecutive files of one table, and a tensor's pieces in a
group in runs: each run checked once against the table, and copied from a window of files (files x bytes) to its
target in one numpy copy. A rank's Python work grows with its groups and tensors, its reads with its files.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple, NoReturn, cast

import numpy as np
import torch
from torch import Tensor

from lightning_shard.checkpoint.format import CheckpointError, crc32_of_bytes
from lightning_shard.checkpoint.format.safetensors_header import SafetensorsHeader, TensorTable
from lightning_shard.checkpoint.io.files import CheckpointFiles
from lightning_shard.checkpoint.io.layout import Piece, RowSplit, StoredTensor, check_piece, rows_per_shard

_WINDOW_BYTES = 8 * 2**20  # read at once (files x bytes); more only where one piece of a version 1-2 file is larger
_IN_PLACE_BYTES = 64 * 2**10  # pieces at least this large are read straight into their targets...
_IN_PLACE_PARTS = 20_000  # ... and all pieces of a read of files x pieces up to this: a window is faster beyond


class FileHandles:
    """Files kept open across many reads (consolidate, export): at most ``limit`` at a time, the least recently used
    closed first."""

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._open: OrderedDict[tuple[int, str], BinaryIO] = OrderedDict()

    def __enter__(self) -> FileHandles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_exactly(self, files: CheckpointFiles, name: str, offset: int, *buffers: Any) -> None:
        """Fill ``buffers`` in turn with ``name``'s bytes from ``offset``; a file that ends first is refused as
        truncated."""
        handle = self._get(files, name)
        handle.seek(offset)
        for buffer in buffers:
            view, done = memoryview(buffer).cast("B"), 0
            while done < len(view):
                n = handle.readinto(view[done:])  # type: ignore[attr-defined]
                if not n:
                    raise CheckpointError(
                        f"Checkpoint file {files.directory / name} is shorter than its header says: it is truncated."
                    )
                done += n

    def _get(self, files: CheckpointFiles, name: str) -> BinaryIO:
        slot = (id(files), name)
        handle = self._open.get(slot)
        if handle is not None:
            self._open.move_to_end(slot)
            return handle
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
    into: Tensor | None  # written by ``commit``; None: the result is the new tensor itself
    columns: tuple[int, int] | None  # the part of dim 1 kept of the rows read (``None``: all of it)


class _Group(NamedTuple):
    """Consecutive files of one checkpoint whose headers share a table: the same tensors at the same places."""

    files: CheckpointFiles
    names: tuple[str, ...]
    headers: tuple[SafetensorsHeader, ...]

    @property
    def table(self) -> TensorTable:
        return self.headers[0].table


class _Run(NamedTuple):
    """Bytes ``[lo, hi)`` of the data section of files ``first..last`` of a group (the same bytes of each), into
    consecutive bytes of a target from ``at``; ``[begin, end)`` is what the checksums covering them span (blocks, or
    the piece ``key``); ``crc32`` a version-1 piece's own CRC-32 (from its index)."""

    first: int
    last: int
    lo: int
    hi: int
    begin: int
    end: int
    target: int
    at: int
    key: str
    crc32: int | None


class RowReads:
    """Rows of many tensors, read in two passes (see [Note: every byte that lands is checked])."""

    def __init__(self) -> None:
        self._targets: list[_Target] = []

    def add(
        self, entry: StoredTensor, start: int, stop: int, into: Tensor | None = None,
        columns: tuple[int, int] | None = None,
    ) -> int:
        """Read rows ``[start, stop)`` of ``entry`` (of them only columns ``[columns[0], columns[1])`` of dim 1, when
        given: a tensor-parallel block; the whole rows are read and checked); ``commit`` copies them into ``into`` (any
        tensor of that many elements; cast when its dtype differs) when given. Returns the position of the result in
        ``read()``'s list."""
        row_numel = math.prod(entry.row_shape)
        if columns is not None:
            row_numel = row_numel // entry.shape[1] * (columns[1] - columns[0])
        if into is not None and into.numel() != (stop - start) * row_numel:
            raise ValueError(f"Rows [{start}, {stop}) of {entry.key} do not fit a tensor of shape {tuple(into.shape)}.")
        self._targets.append(_Target(entry, start, stop, into, columns))
        return len(self._targets) - 1

    def read(self, handles: FileHandles | None = None) -> list[Tensor]:
        """Check, then read, everything added, into new tensors (in the order added), every byte checked against its
        file's checksums. A result has shape ``(stop - start, *row_shape)`` (a 0-dim tensor read whole: ``()``)."""
        groups: list[_Group] = []
        runs: dict[int, list[_Run]] = {}  # by group
        _plan(self._targets, groups, runs)
        results = [torch.empty((t.stop - t.start) * math.prod(t.entry.row_shape), dtype=t.entry.dtype)
                   for t in self._targets]  # allocated only now: every piece has been checked
        arrays = [r.view(torch.uint8).numpy() for r in results]
        pool = handles if handles is not None else FileHandles()
        scratch = np.empty(_WINDOW_BYTES if runs else 0, dtype=np.uint8)  # one buffer for every window
        try:
            for g, group_runs in runs.items():
                _read_group(groups[g], group_runs, arrays, pool, scratch)
        finally:
            if handles is None:
                pool.close()
        return [_shaped(t, r) for t, r in zip(self._targets, results)]

    def commit(self, results: list[Tensor]) -> None:
        """Copy each result of ``read`` into the tensor named for it (if any)."""
        with torch.no_grad():
            for t, result in zip(self._targets, results):
                if t.into is not None and result.numel():
                    t.into.copy_(result.reshape(t.into.shape))

    def run(self, handles: FileHandles | None = None) -> list[Tensor]:
        """``read``, then ``commit``: the results, or the tensors named for them."""
        results = self.read(handles)
        self.commit(results)
        return [t.into if t.into is not None else r for t, r in zip(self._targets, results)]


def _shaped(t: _Target, flat: Tensor) -> Tensor:
    if not t.entry.shape:
        return flat.reshape(()) if t.stop > t.start else flat
    rows = flat.view(t.stop - t.start, *t.entry.row_shape)
    return rows if t.columns is None else rows[:, t.columns[0] : t.columns[1]].contiguous()


# Pass 1 #


def _plan(targets: list[_Target], groups: list[_Group], runs: dict[int, list[_Run]]) -> None:
    """Check every piece the targets need against its file's header, and plan its reads as runs of groups."""
    member: dict[tuple[int, str], tuple[int, int]] = {}  # (files, name) -> (group, position in it)
    for files, names, wanted in _split_ranges(targets):
        _add_groups(files, names, wanted, groups, member)
    for i, t in enumerate(targets):
        entry, placement = t.entry, t.entry.placement
        row_bytes = math.prod(entry.row_shape) * entry.dtype.itemsize
        if isinstance(placement, RowSplit) and t.start < t.stop:
            _plan_split(i, t, placement, row_bytes, groups, member, runs)
            continue
        for piece in entry.pieces(t.start, t.stop):
            slot = (id(entry.files), piece.file)
            if slot not in member:
                _add_groups(entry.files, (piece.file,), [(0, 0)], groups, member)
            g, position = member[slot]
            _add_run(i, t, piece, position, position, row_bytes, groups[g], g, runs)


def _split_ranges(targets: list[_Target]) -> list[tuple[CheckpointFiles, tuple[str, ...], list[tuple[int, int]]]]:
    """For each checkpoint's shard files, the ranges of shards its split targets read (inclusive)."""
    ranges: dict[int, tuple[CheckpointFiles, tuple[str, ...], list[tuple[int, int]]]] = {}
    for t in targets:
        placement = t.entry.placement
        if isinstance(placement, RowSplit) and t.start < t.stop:
            per = rows_per_shard(placement.rows, placement.shard_size)
            ranges.setdefault(id(t.entry.files), (t.entry.files, placement.shard_files, []))[2].append(
                (t.start // per, (t.stop - 1) // per))
    return list(ranges.values())


def _add_groups(
    files: CheckpointFiles, names: tuple[str, ...], wanted: list[tuple[int, int]], groups: list[_Group],
    member: dict[tuple[int, str], tuple[int, int]],
) -> None:
    """The files ``wanted`` covers (ranges of positions in ``names``), in groups of consecutive files whose headers
    share a table; each header read once."""
    marks = [0] * (len(names) + 1)
    for first, last in wanted:
        marks[first] += 1
        marks[last + 1] -= 1
    depth, previous = 0, -2
    run_names: list[str] = []
    run_headers: list[SafetensorsHeader] = []
    for s in range(len(names)):
        depth += marks[s]
        if not depth:
            continue
        header = files.header(names[s])
        if run_names and (previous != s - 1 or header.table is not run_headers[0].table):
            groups.append(_Group(files, tuple(run_names), tuple(run_headers)))
            run_names, run_headers = [], []
        member[(id(files), names[s])] = (len(groups), len(run_names))
        run_names.append(names[s])
        run_headers.append(header)
        previous = s
    if run_names:
        groups.append(_Group(files, tuple(run_names), tuple(run_headers)))


def _plan_split(
    i: int, t: _Target, placement: RowSplit, row_bytes: int, groups: list[_Group],
    member: dict[tuple[int, str], tuple[int, int]], runs: dict[int, list[_Run]],
) -> None:
    """The runs of a split tensor's target: its whole pieces in each group in one run; a piece read in part alone."""
    per = rows_per_shard(placement.rows, placement.shard_size)
    first, last = t.start // per, (t.stop - 1) // per
    s = first
    while s <= last:
        g, position = member[(id(t.entry.files), placement.shard_files[s])]
        group = groups[g]
        piece = placement.piece(s)
        if piece.lo < t.start or piece.hi > t.stop or piece.hi - piece.lo != per:  # cut, or short: alone
            _add_run(i, t, piece, position, position, row_bytes, group, g, runs)
            s += 1
            continue
        end = s
        while end < last and end - s + position + 1 < len(group.names) and (end + 2) * per <= t.stop:
            end += 1  # the next piece is in the same group, whole and full
        t.entry.files.pieces_checked += end - s
        _add_run(i, t, piece, position, position + end - s, row_bytes, group, g, runs)
        s = end + 1


def _add_run(
    i: int, t: _Target, piece: Piece, first: int, last: int, row_bytes: int, group: _Group, g: int,
    runs: dict[int, list[_Run]],
) -> None:
    """Check ``piece`` against its file's header (for a run of files, the first: the others share its table), and
    plan the read of its rows the target needs, widened to what the checksums cover."""
    header = group.headers[first]
    crc = check_piece(t.entry, piece, header)
    t.entry.files.pieces_checked += 1
    a, b = max(t.start, piece.lo), min(t.stop, piece.hi)
    if a >= b:
        return
    stored = header.entries[piece.key]
    lo, hi = stored.begin + (a - piece.lo) * row_bytes, stored.begin + (b - piece.lo) * row_bytes
    block = group.table.block_bytes
    if block is not None:
        begin, end = lo // block * block, min(group.table.data_bytes, -(-hi // block) * block)
    elif crc is not None or t.entry.files.checksums_in_headers:
        begin, end = stored.begin, stored.end  # checked whole against its CRC-32
    else:
        begin, end = lo, hi  # a file no checkpoint wrote: nothing to check it against
    at = (a - t.start) * row_bytes
    runs.setdefault(g, []).append(_Run(first, last, lo, hi, begin, end, i, at, piece.key, piece.crc32))


# Pass 2 #


def _read_group(group: _Group, runs: list[_Run], arrays: list[Any], pool: FileHandles, scratch: Any) -> None:
    """The runs of ``group``. Runs over the same files whose extents touch are read in place, file by file
    (``_read_in_place``), where their pieces are large or few. The others are read through windows: their extents
    joined where they touch, each joined span read from every file some of its runs need, in chunks that end on
    block boundaries, a window of files at a time (in ``scratch``, unless one file's chunk is larger); each file's
    chunk is checked, then each run's bytes in the window are copied out, one numpy copy a run."""
    windowed: list[_Run] = []
    for segment, end in _joined(sorted(runs, key=lambda r: (r.first, r.last, r.begin)), same_files=True):
        parts = (segment[0].last - segment[0].first + 1) * len(segment)
        few = parts <= _IN_PLACE_PARTS or all(r.hi - r.lo >= _IN_PLACE_BYTES for r in segment)
        if few and _apart(segment):
            for position in range(segment[0].first, segment[0].last + 1):
                _read_in_place(group, position, segment, end, arrays, pool, scratch)
        else:  # many small pieces, or two targets of the same rows: through windows
            windowed += segment
    for segment, end in _joined(sorted(windowed, key=lambda r: r.begin), same_files=False):
        marks = [0] * (len(group.names) + 1)
        for run in segment:
            marks[run.first] += 1
            marks[run.last + 1] -= 1
        needed = [f for f, depth in enumerate(itertools.accumulate(marks[:-1])) if depth]  # the files runs read
        done, starts = 0, [run.begin for run in segment]
        for lo, hi in _chunks(segment[0].begin, end, _unit(group, segment)):
            while segment[done].end <= lo:  # runs sorted by start: those wholly before this chunk are done
                done += 1
            inside = [run for run in segment[done : bisect.bisect_left(starts, hi)] if run.hi > lo and run.lo < hi]
            rows = max(1, len(scratch) // (hi - lo))
            for j0 in range(0, len(needed), rows):
                files = needed[j0 : j0 + rows]
                need = len(files) * (hi - lo)
                window = (scratch[:need] if need <= len(scratch) else np.empty(need, np.uint8)).reshape(len(files), -1)
                everywhere = [r for r in inside if r.first <= files[0] and files[-1] <= r.last]
                elsewhere = [r for r in inside if not (r.first <= files[0] and files[-1] <= r.last)]
                spans = _spans(everywhere, lo, hi)  # what every file of the window needs checked
                for row, position in zip(window, files):
                    header = group.headers[position]
                    pool.read_exactly(group.files, group.names[position], header.data_start + lo, row)
                    mine = [r for r in elsewhere if r.first <= position <= r.last]
                    _check(group, position, everywhere + mine, lo, row, _spans(everywhere + mine, lo, hi) if mine
                           else spans)
                for run in inside:
                    _copy(run, files, lo, hi, window, arrays[run.target])


def _joined(runs: list[_Run], same_files: bool) -> list[tuple[list[_Run], int]]:
    """``runs`` (sorted by where their extents start) in segments whose extents touch (and, with ``same_files``, that
    read the same files), each with where its last extent ends."""
    segments: list[tuple[list[_Run], int]] = []
    for run in runs:
        last = segments[-1] if segments else None
        if last and run.begin <= last[1] and (not same_files or (last[0][0].first, last[0][0].last) == (
                run.first, run.last)):
            last[0].append(run)
            segments[-1] = (last[0], max(last[1], run.end))
        else:
            segments.append(([run], run.end))
    return segments


def _apart(segment: list[_Run]) -> bool:
    """Whether no two runs of ``segment`` (sorted by start) read the same bytes (two targets of the same rows)."""
    return all(a.hi <= b.lo for a, b in zip(segment, segment[1:]))


def _read_in_place(
    group: _Group, position: int, segment: list[_Run], end: int, arrays: list[Any], pool: FileHandles, scratch: Any,
) -> None:
    """The bytes of one file that ``segment``'s runs need, read straight into their targets, in order, with the bytes
    around and between them that the checksums also cover into ``scratch``; then every block (or piece) checked on
    those parts, before anything is used (see [Note: every byte that lands is checked])."""
    parts: list[tuple[int, Any]] = []  # (where in the data section, the memory its bytes go to)
    at, spare = segment[0].begin, memoryview(cast(Any, scratch))

    def gap(n: int) -> Any:  # bytes the checksums cover but no run needs: read into spare memory, not kept
        nonlocal spare
        if len(spare) < n:
            spare = memoryview(cast(Any, np.empty(max(len(scratch), n), np.uint8)))
        view, spare = spare[:n], spare[n:]
        return view

    for run in segment:
        if run.lo > at:
            parts.append((at, gap(run.lo - at)))
        n = run.hi - run.lo
        start = run.at + (position - run.first) * n
        parts.append((run.lo, memoryview(arrays[run.target])[start : start + n]))
        at = run.hi
    if end > at:
        parts.append((at, gap(end - at)))
    pool.read_exactly(group.files, group.names[position], group.headers[position].data_start + segment[0].begin,
                      *(view for _, view in parts))
    k = 0  # the first part not wholly before the span checked
    for lo, hi, expected in _checksums(group, position, segment, segment[0].begin, end):
        while parts[k][0] + len(parts[k][1]) <= lo:
            k += 1
        crc, j = 0, k
        while j < len(parts) and parts[j][0] < hi:
            where, view = parts[j]
            crc = crc32_of_bytes(view[max(lo, where) - where : min(hi, where + len(view)) - where], crc)
            j += 1
        if expected is not None and crc != expected:
            _corrupted(group, position, lo, hi)


def _checksums(
    group: _Group, position: int, segment: list[_Run], lo: int, hi: int
) -> list[tuple[int, int, int | None]]:
    """The checksummed spans of bytes ``[lo, hi)`` of a file of ``group`` (whose ends are span ends), each with its
    CRC-32: its blocks, or the pieces of ``segment`` (versions 1-2; ``None``: a file that records none)."""
    header = group.headers[position]
    size = group.table.block_bytes
    if header.blocks is not None and size is not None:
        data_bytes = group.table.data_bytes
        return [(at, min(at + size, data_bytes), header.blocks.at(at // size)) for at in range(lo, hi, size)]
    return [(run.begin, run.end, run.crc32 if run.crc32 is not None else header.tensor_crc32(run.key))
            for run in segment if run.first <= position <= run.last and lo <= run.begin and run.end <= hi]


def _unit(group: _Group, segment: list[_Run]) -> int | None:
    """What a segment of ``group`` may be cut at multiples of: its files' checksummed blocks, or any byte in a file
    that records no checksums; ``None`` where a piece is checked whole (versions 1-2)."""
    if group.table.block_bytes is not None:
        return group.table.block_bytes
    unchecked = not group.files.checksums_in_headers and all(h.crc32 is None for h in group.headers)
    return 1 if unchecked and all(run.crc32 is None for run in segment) else None


def _chunks(begin: int, end: int, unit: int | None) -> list[tuple[int, int]]:
    """``[begin, end)`` in chunks of at most ``_WINDOW_BYTES`` that end on multiples of ``unit``; one chunk where
    ``unit`` is ``None``."""
    if unit is None:
        return [(begin, end)]
    step = max(unit, _WINDOW_BYTES // unit * unit)
    return [(lo, min(end, lo + step)) for lo in range(begin, end, step)]


def _spans(runs: list[_Run], lo: int, hi: int) -> list[tuple[int, int]]:
    """The extents of ``runs`` within ``[lo, hi)``, joined where they touch, in order."""
    spans: list[tuple[int, int]] = []
    for run in sorted(runs, key=lambda r: r.begin):
        a, b = max(run.begin, lo), min(run.end, hi)
        if a >= b:
            continue
        if spans and a <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    return spans


def _check(group: _Group, position: int, runs: list[_Run], lo: int, data: Any, spans: list[tuple[int, int]]) -> None:
    """Check ``spans`` (what ``runs`` need) of bytes ``[lo, lo + len(data))`` of the data section of a file of
    ``group`` against its checksums: each block there (block boundaries), or each of their pieces. Bytes a window
    reads for other files' runs only are not used, so not checked."""
    for begin, end in spans:
        for a, b, expected in _checksums(group, position, runs, begin, end):
            if expected is not None and crc32_of_bytes(data[a - lo : b - lo]) != expected:
                _corrupted(group, position, a, b)


def _copy(run: _Run, files: list[int], lo: int, hi: int, window: Any, target: Any) -> None:
    """Copy what ``run`` needs of the window (a row for each of ``files``, ascending, each bytes ``[lo, hi)`` of
    its data section) into its target: the files it reads are consecutive rows."""
    r0, r1 = bisect.bisect_left(files, run.first), bisect.bisect_right(files, run.last)
    a, b = max(run.lo, lo), min(run.hi, hi)
    if r0 >= r1 or a >= b:
        return
    f0, n = files[r0], run.hi - run.lo
    into = target[run.at : run.at + (run.last - run.first + 1) * n].reshape(-1, n)
    into[f0 - run.first : f0 - run.first + r1 - r0, a - run.lo : b - run.lo] = window[r0:r1, a - lo : b - lo]


def _corrupted(group: _Group, position: int, lo: int, hi: int) -> NoReturn:
    """Raise for bytes ``[lo, hi)`` of a file's data section that fail their CRC-32, naming the file and the tensors
    whose bytes lie there."""
    table = group.table
    held = [key for key in table.in_order if table.entries[key].begin < hi and table.entries[key].end > lo]
    more = f" and {len(held) - 3} more" if len(held) > 3 else ""
    raise CheckpointError(
        f"Checkpoint file {group.files.directory / group.names[position]} is corrupted: bytes [{lo}, {hi}) of its"
        f" tensor data (of {', '.join(repr(k) for k in held[:3])}{more}) do not match their checksum."
    )


def read_rows(entry: StoredTensor, start: int, stop: int, handles: FileHandles | None = None) -> Tensor:
    """Rows ``[start, stop)`` (dim 0) of ``entry``, reading only the pieces that hold them (checked first). A 0-dim
    tensor is one row: read whole (shape ``()``) unless ``[start, stop)`` is empty (then an empty 1-D tensor)."""
    reads = RowReads()
    reads.add(entry, start, stop)
    return reads.read(handles)[0]


def read_tensor(entry: StoredTensor, handles: FileHandles | None = None) -> Tensor:
    """The whole of ``entry``, in its shape."""
    return read_rows(entry, 0, entry.rows, handles).reshape(entry.shape)
