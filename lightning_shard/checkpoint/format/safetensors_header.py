"""Safetensors headers: read once each, checked against their file's real size, and the checksums they record.

A checkpoint's safetensors files record in their header's ``__metadata__`` the CRC-32 of each block of
``"crc32_block_bytes"`` bytes of their data section (``"crc32_blocks"``, version 3; see [Note: every byte that lands
is checked] in ``io/reader.py``). Files of versions 1 and 2 record the CRC-32 of each tensor instead (``"crc32"``,
and in version 2 a running CRC-32 no reader needs any longer); a reader checks a tensor of theirs whole.
"""

from __future__ import annotations

import binascii
import json
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch

from lightning_shard.checkpoint.format import _TORCH_BY_SAFETENSORS, CheckpointError

BLOCK_CRC32_METADATA = "crc32_blocks"  # the CRC-32 of each block of the data section, 8 hex digits each
BLOCK_BYTES_METADATA = "crc32_block_bytes"  # the blocks' size, in decimal
CRC32_METADATA = "crc32"  # versions 1-2: each tensor's CRC-32, 8 hex digits, in the order of their data
RUNNING_CRC32_METADATA = "crc32_running"  # version 2: not read (its "crc32" checks every tensor)
SAVE_ID_METADATA = "save_id"  # version 4: the save the file belongs to, as its index records it
_DIGITS_KEYS = (BLOCK_CRC32_METADATA, CRC32_METADATA, RUNNING_CRC32_METADATA)  # in the order writers put them first
BLOCK_BYTES = 64 * 2**10  # what a save writes: a reader of a part of a piece reads at most this much more each side
MAX_BLOCK_BYTES = 64 * 2**20  # a file claiming larger blocks is refused: a reader holds a block in memory
MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header is JSON describing the tensors; 100 MiB is far beyond any model


class HeaderEntry(NamedTuple):
    """One tensor of a safetensors header, checked against its file: its bytes are ``[begin, end)`` of the data
    section, exactly ``prod(shape) * itemsize`` of them."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, eq=False)
class TensorTable:
    """The checked tensor table of a safetensors header (name -> ``HeaderEntry``), and its names in the order of
    their data. Files with equal tables share one: the shard files of a large world mostly hold the same shapes, and a
    header equal to one already checked, but for its checksums' digits, is neither parsed nor checked again."""

    entries: dict[str, HeaderEntry]
    in_order: tuple[str, ...]
    raw: dict[str, Any] = field(repr=False)  # the JSON it was checked from: a later file's table is compared with it
    data_bytes: int
    block_bytes: int | None  # of the file's checksummed blocks; None: its tensors are checksummed instead
    text: bytes = field(repr=False)  # the header's bytes, checksums included
    digits_at: tuple[tuple[str, int, int], ...] | None  # (metadata key, [start, end) in ``text``) of each run of
    # checksum digits; None: not where the writer puts them (then an equal header is parsed again)

    def same_but_checksums(self, text: bytes, data_bytes: int) -> bool:
        """Whether a header of ``text`` (for ``data_bytes`` of data) is this one but for the checksums' hex digits."""
        if data_bytes != self.data_bytes or len(text) != len(self.text) or self.digits_at is None:
            return False
        return all(text.startswith(fixed, at) for at, fixed in self._fixed_parts)  # compared in place, in C

    @cached_property
    def _fixed_parts(self) -> list[tuple[int, bytes]]:
        parts, at = [], 0
        for _, p, q in self.digits_at or ():
            parts.append((at, self.text[at:p]))
            at = q
        return [*parts, (at, self.text[at:])]

    @cached_property
    def positions(self) -> dict[str, int]:
        """Each tensor's position in ``in_order``."""
        return {key: i for i, key in enumerate(self.in_order)}


class HexWords:
    """CRC-32s recorded as 8 hex digits each: counted when the header is read, turned into numbers only when one is
    asked for (a load reads the headers of hundreds of files and looks at few of their checksums)."""

    __slots__ = ("_digits", "_words", "_path", "_key")

    def __init__(self, digits: Any, count: int, path: Path | str, key: str) -> None:
        if not isinstance(digits, (str, bytes)) or len(digits) != 8 * count:
            _damaged_digits(path, key, count)
        self._digits, self._words, self._path, self._key = digits, b"", path, key

    def __len__(self) -> int:
        return len(self._digits) // 8

    def at(self, position: int) -> int:
        if not self._words:
            try:
                digits = self._digits.encode("ascii") if isinstance(self._digits, str) else self._digits
                self._words = binascii.unhexlify(digits)
            except (ValueError, UnicodeEncodeError):  # not hex digits only
                _damaged_digits(self._path, self._key, len(self))
        return int.from_bytes(self._words[4 * position : 4 * position + 4], "big")


def _damaged_digits(path: Path | str, key: str, count: int) -> NoReturn:
    raise CheckpointError(
        f"Checkpoint file {path}: the header's {key!r} metadata is not 8 hex digits for each of its {count} checksums:"
        " it is damaged."
    )


class SafetensorsHeader(NamedTuple):
    """A safetensors file's tensor table, where its data section starts, and the checksums its metadata records: the
    CRC-32 of each block of its data section (``blocks``; ``None`` in files of versions 1-2 and in files this package
    did not write), or of each tensor (``crc32``, by position in ``table.in_order``; ``None`` when not recorded)."""

    data_start: int
    table: TensorTable
    blocks: HexWords | None
    crc32: HexWords | None

    @property
    def entries(self) -> dict[str, HeaderEntry]:
        return self.table.entries

    def tensor_crc32(self, key: str) -> int | None:
        """The CRC-32 a version 1-2 header records for the tensor ``key``, if any."""
        return self.crc32.at(self.table.positions[key]) if self.crc32 is not None else None


def read_safetensors_header(path: Path, size: int) -> SafetensorsHeader:
    """The header of the safetensors file ``path`` of ``size`` bytes, checked against ``size``: the header fits in
    the file, and every tensor's bytes lie inside its data section."""
    with open(path, "rb") as f:
        return parse_header(f.read(header_length(f.read(8), path, size)), path, size)


def header_length(head: bytes, path: Path | str, size: int) -> int:
    """The header length the first 8 bytes of a file of ``size`` bytes give, checked to fit in it."""
    if len(head) < 8:
        raise CheckpointError(f"Checkpoint file {path} has {size} bytes, too few for a safetensors header.")
    (length,) = struct.unpack("<Q", head[:8])
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(
            f"Checkpoint file {path} claims a {length}-byte header but holds {size} bytes in all: it is damaged."
        )
    return int(length)


def parse_header(text: bytes, path: Path | str, size: int, like: TensorTable | None = None) -> SafetensorsHeader:
    """The checked header whose JSON is ``text``, of a file of ``size`` bytes. A table equal to ``like`` (the same
    JSON and data size: checked) is not checked again but shared."""
    data_bytes = size - 8 - len(text)
    if like is not None and like.same_but_checksums(text, data_bytes):  # no JSON to parse: the digits alone
        digits = {key: text[p:q] for key, p, q in like.digits_at or ()}
        return _header(8 + len(text), like, digits, path)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"Checkpoint file {path} has a header that is not valid JSON ({err}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"Checkpoint file {path} has a header that is not a table of tensors.")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"Checkpoint file {path} has a header whose '__metadata__' is not a table of strings.")
    digits = {key: metadata[key] for key in _DIGITS_KEYS if key in metadata}
    if like is not None and like.data_bytes == data_bytes and like.raw == header and _block_bytes(
            path, metadata) == like.block_bytes:
        table = like  # compared in C
    else:
        table = _checked_table(path, header, data_bytes, _block_bytes(path, metadata), text, digits)
    return _header(8 + len(text), table, digits, path)


def recorded_save_id(text: bytes) -> str | None:
    """The save id the header ``text`` records in its metadata, if it is valid JSON and records one (only read to
    explain a header its index does not vouch for)."""
    try:
        metadata = json.loads(text).get("__metadata__") or {}
        save_id = metadata.get(SAVE_ID_METADATA)
    except (ValueError, RecursionError, AttributeError):
        return None
    return save_id if isinstance(save_id, str) else None


def _header(data_start: int, table: TensorTable, digits: dict[str, Any], path: Path | str) -> SafetensorsHeader:
    blocks = None
    if table.block_bytes is not None:
        count = -(-table.data_bytes // table.block_bytes)
        blocks = HexWords(digits.get(BLOCK_CRC32_METADATA), count, path, BLOCK_CRC32_METADATA)
    crc32 = digits.get(CRC32_METADATA)
    tensors = HexWords(crc32, len(table.in_order), path, CRC32_METADATA) if crc32 is not None else None
    return SafetensorsHeader(data_start, table, blocks, tensors)


def _block_bytes(path: Path | str, metadata: dict[str, Any]) -> int | None:
    """The block size a header's metadata records, checked; ``None`` when it records no blocks."""
    value = metadata.get(BLOCK_BYTES_METADATA)
    if value is None and BLOCK_CRC32_METADATA not in metadata:
        return None
    if not (isinstance(value, str) and value.isdigit() and 0 < int(value) <= MAX_BLOCK_BYTES):
        raise CheckpointError(
            f"Checkpoint file {path}: the header's {BLOCK_BYTES_METADATA!r} metadata is {value!r}, not a block size"
            f" of at most {MAX_BLOCK_BYTES} bytes: it is damaged."
        )
    return int(value)


def _checked_table(
    path: Path | str, header: dict[str, Any], data_bytes: int, block_bytes: int | None, text: bytes,
    digits: dict[str, Any],
) -> TensorTable:
    entries = {}
    for key, info in header.items():  # one entry per tensor, thousands per load: a tight loop, no call per entry
        try:
            dtype, shape, (begin, end) = _TORCH_BY_SAFETENSORS[info["dtype"]], info["shape"], info["data_offsets"]
            numel = 1
            for d in shape:
                if type(d) is not int or d < 0:
                    raise TypeError(d)
                numel *= d
            if type(begin) is not int or type(end) is not int:
                raise TypeError(begin)
        except (KeyError, TypeError, ValueError):
            malformed = f"Checkpoint file {path}: tensor {key!r} has a malformed header entry {info!r}."
            raise CheckpointError(malformed) from None
        if not 0 <= begin <= end <= data_bytes or end - begin != numel * dtype.itemsize:
            raise CheckpointError(
                f"Checkpoint file {path}: tensor {key!r} of shape {shape} ({info['dtype']}) claims bytes"
                f" [{begin}, {end}) but the file holds {data_bytes} bytes of tensor data."
            )
        entries[key] = HeaderEntry(dtype, tuple(shape), begin, end)
    in_order = tuple(sorted(entries, key=lambda key: (entries[key].begin, entries[key].end)))
    return TensorTable(entries, in_order, header, data_bytes, block_bytes, text, _digits_at(text, digits))


def _digits_at(text: bytes, digits: dict[str, Any]) -> tuple[tuple[str, int, int], ...] | None:
    """Where each run of checksum digits lies in the header ``text``: this package's writers put them first in the
    metadata, compactly, in the order of ``_DIGITS_KEYS``. ``None`` when the header records them elsewhere."""
    marker = b'{"__metadata__":{'
    if not digits:
        return ()
    if not text.startswith(marker):
        return None
    at, found = len(marker), list[tuple[str, int, int]]()
    for key in _DIGITS_KEYS:
        if key not in digits:
            continue
        lead = f'{"," if found else ""}"{key}":"'.encode()
        value = digits[key]
        if not isinstance(value, str) or not text.startswith(lead, at):
            return None
        p = at + len(lead)
        q = p + len(value)
        if text[p:q] != value.encode() or text[q : q + 1] != b'"':
            return None
        found.append((key, p, q))
        at = q + 1
    return tuple(found)
