"""Writing a safetensors file tensor by tensor, with the checksums a checkpoint records: the CRC-32 of each block of
its data in the file's own header, the SHA-256 of each file in the index."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from lightning_shard.checkpoint.format import _SAFETENSORS_DTYPES, CheckpointError, crc32_of_bytes
from lightning_shard.checkpoint.format.safetensors_header import BLOCK_BYTES, BLOCK_BYTES_METADATA, BLOCK_CRC32_METADATA


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Writing a safetensors file tensor by tensor
# --------------------------------------------------------------------------------------------------


# [Note: large writes]
# A shard file of a large world could hold hundreds of small pieces (a few KiB each at W=1024, before small tensors
# were stored whole). Written one ``write`` each
# through an 8 KiB buffer, they reach the kernel as small writes, and the page cache keeps such a file in small pages:
# reading it back while it is cached (a load soon after the save, the usual resume) copies it a page at a time, about
# 1.7x slower than a file written in large writes (25M written by 1024 ranks, read on 2: 23 ms against 14 ms). So the
# writer buffers up to ``_WRITE_BUFFER_BYTES``; larger tensors go to the file directly, as before.
_WRITE_BUFFER_BYTES = 2**20


class SafetensorsStreamWriter:
    """Write a safetensors file whose tensors arrive one at a time, so that only one is ever in memory.

    The header (names, dtypes, shapes, offsets) is written first from ``specs``; ``write`` must then be called once
    per tensor, in the order of ``specs``, within ``with``: the file is closed on leaving it, and completed (``close``)
    unless something failed. With ``checksums``, the header's metadata records the CRC-32 of each block
    of ``BLOCK_BYTES`` of the data section (``"crc32_blocks"``, 8 hex digits a block, after ``"crc32_block_bytes"``;
    see [Note: every byte that lands is checked] in ``reader.py``): written as zeros first, filled in by ``close``
    (the same number of bytes, so the data does not move).
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, checksums: bool = False) -> None:
        offset = 0
        self._expected: list[tuple[str, int]] = []
        tensors: dict[str, Any] = {}
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            tensors[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                             "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        self._blocks: list[int] | None = [0] * -(-offset // BLOCK_BYTES) if checksums else None
        self._block_crc, self._written = 0, 0  # the CRC-32 of the current block so far; bytes written in all
        self._metadata = dict(metadata or {})
        if self._blocks is not None:  # first in the header, where a reader of many files finds them without parsing
            self._metadata = {BLOCK_CRC32_METADATA: "0" * 8 * len(self._blocks),
                              BLOCK_BYTES_METADATA: str(BLOCK_BYTES), **self._metadata}
        self._header: dict[str, Any] = ({"__metadata__": self._metadata} if self._metadata else {}) | tensors
        encoded = self._encoded_header()
        self._file: BinaryIO = open(path, "wb", buffering=_WRITE_BUFFER_BYTES)  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._header_bytes = len(encoded)
        self.header_sha256 = _header_digest(encoded)  # final once ``close`` has filled in the checksums
        self._next = 0

    def _encoded_header(self) -> bytes:
        encoded = json.dumps(self._header, separators=(",", ":")).encode()
        return encoded + b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, failed: type[BaseException] | None, *_: object) -> None:
        """``close`` the file once every tensor is written; after a failure, only close it."""
        if failed is None:
            self.close()
        else:
            self._file.close()

    def write(self, name: str, tensor: Tensor | Iterable[Tensor]) -> None:
        """Append the bytes of ``tensor``, given whole or as its consecutive row blocks (one in memory at a time)."""
        expected_name, nbytes = self._expected[self._next]
        if name != expected_name:
            raise CheckpointError(f"Internal error: expected {expected_name}, got {name}.")
        written = 0
        for block in [tensor] if isinstance(tensor, Tensor) else tensor:
            data = block.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # no copy of the bytes
            self._file.write(data.data)
            written += data.nbytes
            if self._blocks is not None:
                self._checksum(memoryview(data.data))
            del data, block  # before the next block is made
        if written != nbytes:
            raise CheckpointError(f"Internal error: {name} took {written} bytes, expected {nbytes}.")
        self._next += 1

    def _checksum(self, view: memoryview) -> None:
        """Add ``view``'s bytes to the CRC-32 of each block they reach."""
        assert self._blocks is not None
        at = 0
        while at < len(view):
            room = BLOCK_BYTES - self._written % BLOCK_BYTES
            part = view[at : at + room]
            self._block_crc = crc32_of_bytes(part, self._block_crc)
            self._written += len(part)
            at += len(part)
            if self._written % BLOCK_BYTES == 0:
                self._blocks[(self._written - 1) // BLOCK_BYTES] = self._block_crc
                self._block_crc = 0

    def close(self) -> None:
        try:
            if self._next != len(self._expected):
                raise CheckpointError(f"Internal error: {len(self._expected) - self._next} tensors were not written.")
            if self._blocks is not None:
                if self._written % BLOCK_BYTES:  # the last block is shorter
                    self._blocks[-1] = self._block_crc
                self._metadata[BLOCK_CRC32_METADATA] = "".join(f"{crc:08x}" for crc in self._blocks)
                self._header["__metadata__"] = self._metadata
                encoded = self._encoded_header()
                assert len(encoded) == self._header_bytes, "8 hex digits replace 8 zeros: the header keeps its size"
                self._file.seek(8)
                self._file.write(encoded)
                self.header_sha256 = _header_digest(encoded)
        finally:
            self._file.close()


def _header_digest(encoded: bytes) -> str:
    """The digest a sealed index records of a data file: the SHA-256 of its first 8 bytes and its header (see [Note:
    what a load verifies] in ``index.py``)."""
    return hashlib.sha256(struct.pack("<Q", len(encoded)) + encoded).hexdigest()
