"""Writing a safetensors file tensor by tensor, and the checksums the index records (CRC-32 per piece, SHA-256 per
file)."""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from lightning_shard.checkpoint.format import _SAFETENSORS_DTYPES, CheckpointError


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Writing a safetensors file tensor by tensor
# --------------------------------------------------------------------------------------------------


class SafetensorsStreamWriter:
    """Write a safetensors file whose tensors arrive one at a time, so that only one is ever in memory.

    The header (names, dtypes, shapes, offsets) is written first from ``specs``; ``write`` must then be
    called once per tensor, in the order of ``specs``.
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._next = 0

    def write(self, name: str, tensor: Tensor) -> int:
        """Append ``tensor``'s bytes; return their CRC-32."""
        expected_name, nbytes = self._expected[self._next]
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # no copy of the bytes
        if name != expected_name or data.nbytes != nbytes:
            raise CheckpointError(f"Internal error: expected {expected_name} ({nbytes} bytes), got {name}.")
        self._file.write(data.data)
        self._next += 1
        return zlib.crc32(data.data) & 0xFFFFFFFF

    def close_quietly(self) -> None:
        """Close after a failure, without the completeness check."""
        self._file.close()

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._expected):
            raise CheckpointError(f"Internal error: {len(self._expected) - self._next} tensors were not written.")


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------
