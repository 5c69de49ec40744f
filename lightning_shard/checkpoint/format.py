"""The on-disk checkpoint format: a directory of safetensors files and JSON, never pickle.

See docs/checkpoint_format.md for the specification. In short::

    CKPT_DIR/
      index.json                  format, version, world size and mesh, files (size, sha256), tensors
      trainer_state.json          Lightning's checkpoint without model/optimizer tensors, as JSON
      trainer_state.safetensors   tensors found in that state (e.g. a metric or scaler value)
      shard-00000-of-00002.safetensors   rank 0's rows of every parameter and optimizer-state tensor
      ...                         ("full" checkpoints: model.safetensors and optimizer.safetensors)

Each tensor entry of the index names its global shape and dtype and the *pieces* it is stored in:
a file, the safetensors key, the half-open range of dim-0 rows the piece holds, and the piece's
CRC-32. A reader takes exactly the rows it needs from each piece with safetensors slicing.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

FORMAT_NAME = "lightning-shard-checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
TRAINER_STATE_JSON = "trainer_state.json"
TRAINER_STATE_TENSORS = "trainer_state.safetensors"
MODEL_PREFIX = "model/"  # index keys of model tensors: "model/" + LightningModule state_dict key
OPTIMIZER_PREFIX = "optimizer/"  # "optimizer/{i}/{parameter name}/{state name}"

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in _SAFETENSORS_DTYPES}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file or the keys at fault."""


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"Tensors of dtype {dtype} cannot be stored in a checkpoint.")
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES_BY_NAME:
        raise CheckpointError(f"Unknown dtype {name!r} in the checkpoint index.")
    return _DTYPES_BY_NAME[name]


def crc32(tensor: Tensor) -> int:
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data.data) & 0xFFFFFFFF


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


def read_index(directory: Path) -> dict[str, Any]:
    """Read and check ``index.json``: format name and version, and that every file exists at its recorded size."""
    index_path = directory / INDEX_FILE
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is not a lightning_shard checkpoint directory. To load model weights from a single"
            f" .safetensors file use lightning_shard.load_safetensors_into(); pickled .ckpt files are never loaded."
        )
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{index_path} is missing: {directory} is not a complete checkpoint.") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{index_path} is not valid JSON ({err}).") from None
    if index.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{index_path} is not a {FORMAT_NAME} index (format={index.get('format')!r}).")
    if index.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{index_path} has format version {index.get('version')!r}; this lightning_shard reads version"
            f" {FORMAT_VERSION}. Upgrade lightning_shard to read it."
        )
    for name, info in index["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {path} is missing.")
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"Checkpoint file {path} has {size} bytes but the index records {info['size']}: it is truncated"
                f" or was modified."
            )
    return index


def read_rows(directory: Path, entry: dict[str, Any], start: int, stop: int) -> Tensor:
    """Rows ``[start, stop)`` (dim 0) of the tensor ``entry`` describes, reading only the pieces that hold them.

    A 0-dim tensor is read whole. A piece read entirely is checked against its CRC-32.
    """
    from safetensors import safe_open

    shape = entry["shape"]
    dtype = dtype_from_name(entry["dtype"])
    if not shape:
        piece = entry["pieces"][0]
        return _checked(directory, piece, _open_slice(directory, piece, safe_open)[...], whole=True).reshape(())
    out = torch.empty(stop - start, *shape[1:], dtype=dtype)
    for piece in entry["pieces"]:
        lo, hi = piece["rows"]
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        rows = _open_slice(directory, piece, safe_open)[a - lo : b - lo]
        out[a - start : b - start] = _checked(directory, piece, rows, whole=(a == lo and b == hi))
    return out


def _open_slice(directory: Path, piece: dict[str, Any], safe_open: Any) -> Any:
    path = directory / piece["file"]
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_slice(piece["key"])
    except Exception as err:  # noqa: BLE001 - any failure to parse is a damaged file
        raise CheckpointError(f"Cannot read {piece['key']!r} from checkpoint file {path}: {err}") from None


def _checked(directory: Path, piece: dict[str, Any], tensor: Tensor, whole: bool) -> Tensor:
    if whole and "crc32" in piece and crc32(tensor) != piece["crc32"]:
        raise CheckpointError(
            f"Checkpoint file {directory / piece['file']} is corrupted: {piece['key']!r} does not match its checksum."
        )
    return tensor


# --------------------------------------------------------------------------------------------------
# Lightning's checkpoint dict <-> JSON plus tensors
# --------------------------------------------------------------------------------------------------


def to_json_tree(obj: Any, tensors: dict[str, Tensor], path: str = "") -> Any:
    """Encode ``obj`` as JSON-compatible data; tensors move to ``tensors`` (keyed by their path) and are referenced.

    Raises ``CheckpointError`` naming the path of any value that JSON and tensors cannot represent.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor):
        key = path or "value"
        tensors[key] = obj.detach().cpu().clone()  # own storage: safetensors refuses shared memory
        return {"__tensor__": key}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": dtype_name(obj)}
    if isinstance(obj, Path):
        return {"__path__": str(obj)}
    if isinstance(obj, (list, tuple)):
        items = [to_json_tree(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: to_json_tree(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {"__items__": [[to_json_tree(k, tensors, f"{path}/key{i}"), to_json_tree(v, tensors, f"{path}/{i}")]
                              for i, (k, v) in enumerate(obj.items())]}
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalars
        return obj.item()
    raise CheckpointError(
        f"The checkpoint value at {path or '/'} is a {type(obj).__name__}, which cannot be stored without pickle."
        f" Store plain values (numbers, strings, lists, dicts, tensors) in hyperparameters and callback states."
    )


def from_json_tree(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """Invert ``to_json_tree``."""
    if isinstance(obj, list):
        return [from_json_tree(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__dtype__" in obj:
        return dtype_from_name(obj["__dtype__"])
    if "__path__" in obj:
        return Path(obj["__path__"])
    if "__tuple__" in obj:
        return tuple(from_json_tree(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_hashable(from_json_tree(k, tensors)): from_json_tree(v, tensors) for k, v in obj["__items__"]}
    return {k: from_json_tree(v, tensors) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def iter_index_tensors(index: dict[str, Any], prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The index's tensor entries whose keys start with ``prefix``, keyed without it."""
    for key, entry in index["tensors"].items():
        if key.startswith(prefix):
            yield key[len(prefix) :], entry


def model_ties(index: dict[str, Any]) -> dict[str, str]:
    """Tied model weights: each alias mapped to the name it is stored under (both without the model prefix)."""
    return {k.removeprefix(MODEL_PREFIX): v.removeprefix(MODEL_PREFIX) for k, v in index.get("ties", {}).items()}
