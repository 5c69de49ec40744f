"""Where the rows of each checkpoint tensor are stored: the writer's shard rule, pieces, and their checks.

[Note: rows by rule]
A sharded save stores each parameter, and each optimizer tensor shaped like it, as its shards hold it (but those
whose pieces would be small: see [Note: small tensors stored whole]): the
``shard_size`` ranks of the mesh's first row (replica 0) each write their rows, and rank ``s`` of that row holds
rows ``[s * c, min(n, (s + 1) * c))`` of a tensor of ``n`` rows (a 0-dim tensor is one row), ``c = ceil(n /
shard_size)`` (the engine's rule, ``ShardedParam.rows_held_by``). The index records that rule once: the mesh and
the file each shard wrote (``shard_files``), and per tensor only ``"split": "rows"``. A reader computes which
files hold the rows it needs; the index grows with tensors + files, never with tensors x files. Version 1 of the
format listed every (tensor, rank) piece instead; it is still read (``Listed``).

[Note: small tensors stored whole]
Split by rows, a tensor costs every reader of it a piece in each of the files its rows lie in: a header entry to
parse and a piece to check, whatever the piece's size. Pieces of a few bytes or KiB (a bias, a norm's weight, or any
tensor at a large world size) cost far more to find than to read: a GPT of 25M parameters saved by 1,024 ranks had
pieces of 4 bytes to 8 KiB in every file, and a rank loading it on 2 read 512 headers and checked 95,000 pieces. So a
sharded save splits a tensor by rows only when each of its pieces (``ceil(rows / shard_size)`` rows) takes at least
``SPLIT_PIECE_MIN_BYTES`` (``splits_by_rows``). A smaller one is stored whole, in the file of one shard, and so are
the optimizer tensors and averaged weights shaped like it (each by its own size). Those files are few but not one:
the tensors stored whole are dealt round-robin, in the order of the index, to shards ``0 .. n-1``, ``n`` as many as
it takes for each to hold ``WHOLE_FILE_MIN_BYTES`` of them (at least 1, at most ``shard_size``: ``whole_owners``),
so that a reader opens a few large files, not one a tensor, and no shard writes all of them when there is much to
write. A shard receives the other shards' rows of its tensors at save time (one all-to-all over the shard group,
``save/whole.py``): it holds about ``max(WHOLE_FILE_MIN_BYTES, their bytes / shard_size)`` more than its shards,
and one such tensor takes at most ``shard_size * SPLIT_PIECE_MIN_BYTES``. The index records such a tensor as any
tensor stored whole (``"file"``, ``"key"``): version 3 reads it as it reads buffers. Where the rows are depends on
the tensors' shapes and dtypes and ``shard_size`` alone; a reader takes it from the index and needs no rule.
Each file holds the tensors it stores whole first, then its pieces (``write_shard_file``): every reader needs all
of the former, so it takes them in one contiguous read a file, not a checksummed block around each tensor between
pieces it does not need (a 4-byte optimizer step there costs up to two 64 KiB blocks).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch

from lightning_shard.checkpoint import format as checkpoint_format
from lightning_shard.checkpoint.format import INDEX_FILE, CheckpointError, dtype_name, safetensors_dtype_code
from lightning_shard.checkpoint.format.safetensors_header import SafetensorsHeader
from lightning_shard.checkpoint.io.files import CheckpointFiles


def rows_per_shard(rows: int, shard_size: int) -> int:
    """``c = ceil(rows / shard_size)``: the rows each shard holds but the last ones (see [Note: rows by rule])."""
    return math.ceil(rows / shard_size)


def shard_rows(rows: int, shard_size: int, shard: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` that shard ``shard`` of ``shard_size`` holds of a tensor of ``rows`` rows (empty, with
    ``lo == hi``, when there are fewer rows than shards)."""
    per = rows_per_shard(rows, shard_size)
    lo = min(rows, shard * per)
    return lo, min(rows, lo + per)


def shards_holding_rows(rows: int, shard_size: int) -> int:
    """How many shards hold at least one row: shards ``0 .. k-1``."""
    return math.ceil(rows / rows_per_shard(rows, shard_size)) if rows else 0


def splits_by_rows(shape: Sequence[int], dtype: torch.dtype, shard_size: int) -> bool:
    """Whether a sharded save splits a tensor of ``shape`` and ``dtype`` that its ``shard_size`` shards hold by rows
    over their files, or stores it whole (see [Note: small tensors stored whole]): whether one shard's rows take at
    least ``SPLIT_PIECE_MIN_BYTES``."""
    rows = shape[0] if len(shape) else 1
    piece = rows_per_shard(rows, shard_size) * math.prod(shape[1:]) * dtype.itemsize if rows else 0
    return piece >= checkpoint_format.SPLIT_PIECE_MIN_BYTES


def whole_owners(tensors: Sequence[tuple[str, int]], shard_size: int) -> dict[str, int]:
    """The shard whose file holds each of ``tensors`` (key, bytes), the tensors a sharded save stores whole instead of
    splitting them (see [Note: small tensors stored whole]), in the order of the index: round-robin over as many
    shards as it takes for each to hold ``WHOLE_FILE_MIN_BYTES`` of them (one, up to all ``shard_size``)."""
    total = sum(nbytes for _, nbytes in tensors)
    owners = max(1, min(shard_size, total // checkpoint_format.WHOLE_FILE_MIN_BYTES))
    return {key: k % owners for k, (key, _) in enumerate(tensors)}


class Piece(NamedTuple):
    """Rows ``[lo, hi)`` of a tensor, stored in ``file`` under the safetensors key ``key``. ``crc32`` is the CRC-32
    of its bytes when the index records it (version 1); the current version records it in the file's header."""

    file: str
    key: str
    lo: int
    hi: int
    crc32: int | None = None


@dataclass(frozen=True)
class Whole:
    """A tensor stored whole in one file (buffers, scalar optimizer state, every tensor of a full save)."""

    file: str
    key: str
    rows: int

    def pieces(self, start: int, stop: int) -> list[Piece]:
        return [Piece(self.file, self.key, 0, self.rows)] if start < stop and self.rows else []


@dataclass(frozen=True)
class RowSplit:
    """A tensor split by rows over ``shard_files`` by the writer's rule (see [Note: rows by rule]), under ``key`` in
    each file."""

    key: str
    rows: int
    shard_size: int
    shard_files: tuple[str, ...] = field(repr=False)  # shard s's file: shared by every tensor of the index

    def pieces(self, start: int, stop: int) -> list[Piece]:
        if start >= stop:
            return []
        per = rows_per_shard(self.rows, self.shard_size)
        return [self.piece(s) for s in range(start // per, (stop - 1) // per + 1)]

    def piece(self, shard: int) -> Piece:
        """What shard ``shard`` holds."""
        lo, hi = shard_rows(self.rows, self.shard_size, shard)
        return Piece(self.shard_files[shard], self.key, lo, hi)


@dataclass(frozen=True)
class Listed:
    """A version-1 tensor: its pieces as the index lists them, sorted by first row, without gaps or overlaps."""

    listed: tuple[Piece, ...]
    _ends: list[int] = field(init=False, repr=False)  # each piece's last row + 1, ascending

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ends", [p.hi for p in self.listed])

    def pieces(self, start: int, stop: int) -> list[Piece]:
        if start >= stop:
            return []
        first = bisect.bisect_right(self._ends, start)
        out = []
        for piece in self.listed[first:]:
            if piece.lo >= stop:
                break
            out.append(piece)
        return out



Placement = Whole | RowSplit | Listed


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """One tensor of a checkpoint: its index key, global shape and dtype, where its rows are stored, and the
    checkpoint's files (whose headers a load reads once each)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placement: Placement
    files: CheckpointFiles = field(repr=False)

    @property
    def rows(self) -> int:
        """Rows along dim 0; a 0-dim tensor is one row."""
        return self.shape[0] if self.shape else 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    def pieces(self, start: int = 0, stop: int | None = None) -> list[Piece]:
        """The pieces holding rows ``[start, stop)`` (all rows by default), in row order."""
        return self.placement.pieces(start, self.rows if stop is None else stop)

    @property
    def covered_rows(self) -> int:
        """The rows its pieces cover from row 0 (all of them, except in a damaged version-1 index)."""
        if isinstance(self.placement, Listed):
            return self.placement.listed[-1].hi if self.placement.listed else 0
        return self.rows


def require_complete(directory: Path | Any, tensors: dict[str, StoredTensor], keys: Any = None) -> None:
    """Raise ``CheckpointError`` unless the pieces of each tensor in ``keys`` (all when ``None``) reach its last row.
    Only a version-1 index can fail this; loaders call it after comparing shapes with the model's, so that a shape
    that differs from the model's is reported as that."""
    for key in tensors if keys is None else keys:
        entry = tensors[key]
        if entry.covered_rows != entry.rows:
            raise CheckpointError(
                f"{directory / INDEX_FILE}: tensor {key!r} (shape {list(entry.shape)}): its pieces cover rows"
                f" [0, {entry.covered_rows}) of {entry.rows}."
            )


def check_piece(entry: StoredTensor, piece: Piece, header: SafetensorsHeader) -> int | None:
    """Check that ``piece``'s file (whose checked header is ``header``) holds ``piece`` of ``entry`` as the index says:
    its key, dtype and shape ``(hi - lo, *row_shape)``; return the piece's own CRC-32 where its checkpoint records one
    (versions 1-2), ``None`` where its file checksums blocks of its data (version 3) or records no checksums at all (a
    file no checkpoint wrote)."""
    info = header.entries.get(piece.key)
    shape = entry.shape
    if shape:
        shape = (piece.hi - piece.lo, *shape[1:])
    if info is not None and info.dtype is entry.dtype and (info.shape == shape or (not shape and info.shape == (1,))):
        if header.blocks is not None:
            return None
        crc = piece.crc32 if piece.crc32 is not None else header.tensor_crc32(piece.key)  # a 0-dim tensor: () or (1,)
        if crc is not None or not entry.files.checksums_in_headers:
            return crc
    _refuse_piece(entry, piece, header, shape)


def _refuse_piece(entry: StoredTensor, piece: Piece, header: SafetensorsHeader, shape: tuple[int, ...]) -> NoReturn:
    path, key = entry.files.directory / piece.file, entry.key
    info = header.entries.get(piece.key)
    if info is None:
        raise CheckpointError(f"Checkpoint file {path} does not hold {piece.key!r}, a piece of tensor {key!r}.")
    if info.dtype != entry.dtype or not (info.shape == shape or (not shape and info.shape == (1,))):
        raise CheckpointError(
            f"Checkpoint file {path}: {piece.key!r}, rows {[piece.lo, piece.hi]} of tensor {key!r}, holds shape"
            f" {list(info.shape)} ({safetensors_dtype_code(info.dtype)}) but the index claims shape {list(shape)}"
            f" ({dtype_name(entry.dtype)})."
        )
    raise CheckpointError(f"Checkpoint file {path} records no checksum of {piece.key!r}: it is damaged.")
