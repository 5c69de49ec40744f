"""The checkpoint format's primitives: names, dtypes, the one size limit for JSON members, safe paths inside a
checkpoint directory, and safetensors headers, read once each and checked against the files' real sizes. This is
the ``format`` room of the checkpoint layer, which imports no other room: this module, safetensors headers and their
checksums (``safetensors_header``), Lightning's checkpoint dict as JSON plus tensors (``trainer_state``) and the
peft adapters a save records (``adapters``).

See docs/checkpoint_format.md for the specification. In short::

    CKPT_DIR/
      index.json                  format, version, world size and mesh, files (size, sha256), tensors
      trainer_state.json          Lightning's checkpoint without model/optimizer tensors, as JSON
      trainer_state.safetensors   tensors found in that state (e.g. a metric or scaler value)
      shard-00000-of-00002.safetensors   rank 0's rows of the parameters and optimizer-state tensors split by rows,
                                         and tensors stored whole
      ...                         ("full" checkpoints: model.safetensors and optimizer.safetensors)

The index gives each tensor's global shape and dtype and where it is stored: split by rows over the shard
files by the writer's rule, or whole in one file (``io/layout.py``; a save of the current version splits only
tensors whose pieces take at least ``SPLIT_PIECE_MIN_BYTES``). Each safetensors file records the CRC-32 of
every tensor it holds in its own header. ``io/index.py`` reads and writes ``index.json``; ``io/reader.py`` reads
rows.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeGuard

import torch

# ``crc32_of_bytes(data, crc=0)`` is zlib's CRC-32 (the same values) computed by ISA-L with carry-less multiplication:
# about 5x zlib's speed here, and every byte a save writes or a load reads goes through it.
from isal.isal_zlib import crc32 as crc32_of_bytes  # noqa: F401 - the checkpoint layer's one CRC-32

FORMAT_NAME = "lightning-shard-checkpoint"
FORMAT_VERSION = 4  # what a save writes: a sealed index that vouches for every file (see [Note: what a load verifies])
READABLE_VERSIONS = (1, 2, 3, 4)  # 1 listed every piece; 1-2 checksum each tensor; 1-3 are not sealed (docs)
SEALED_VERSION = 4  # the first version whose index is sealed and records each data file's header digest
INDEX_FILE = "index.json"
TRAINER_STATE_JSON = "trainer_state.json"
TRAINER_STATE_TENSORS = "trainer_state.safetensors"
MODEL_FILE = "model.safetensors"  # a full save's model tensors, under their state_dict keys
OPTIMIZER_FILE = "optimizer.safetensors"  # a full save's optimizer tensors, under their index keys
MODEL_PREFIX = "model/"  # index keys of model tensors: "model/" + LightningModule state_dict key
OPTIMIZER_PREFIX = "optimizer/"  # "optimizer/{i}/{parameter name}/{state name}"
SPLIT_PIECE_MIN_BYTES = 64 * 2**10  # a sharded save stores whole a tensor whose pieces would be smaller (io/layout.py)
WHOLE_FILE_MIN_BYTES = 8 * 2**20  # ... in the files of as many shards as it takes for each to hold this much of them

# The one limit on a checkpoint's JSON members (index.json, trainer_state.json): a load refuses a larger one, and a
# save refuses to write one, before anything is committed. An index of the current version grows with tensors + files
# (a 70B model saved by 4,096 ranks: about 1 MiB); the limit stays this high because version-1 indexes, which listed
# every piece of every tensor, still load.
MAX_JSON_BYTES = 256 * 2**20

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
_TORCH_BY_SAFETENSORS = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file or the keys at fault. Both a
    ``RuntimeError`` and a ``ValueError``: code written for Lightning's ``FSDPStrategy`` catches a path that is no
    checkpoint as ``ValueError`` and a checkpoint that does not fit as ``RuntimeError``."""


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def member_named(names: Iterable[str], base: str) -> str:
    """The file of a checkpoint that plays the part of ``base`` (``trainer_state.json``...): ``base`` itself, or
    ``<save-id>.<base>`` in a checkpoint on object storage (see [Note: committing to object storage]); ``base`` when
    the index names neither (a load then reports it missing)."""
    names = list(names)
    if base in names:
        return base
    found = [n for n in names if n.endswith("." + base) and SAVE_ID.fullmatch(n[: -len(base) - 1])]
    return found[0] if len(found) == 1 else base


SAVE_ID = re.compile(r"[0-9a-f]{12}")  # each save's id: in its index and data files; on object storage in their names


def new_save_id() -> str:
    """A new save's id: 12 random hex digits (``SAVE_ID``)."""
    return uuid.uuid4().hex[:12]


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"Tensors of dtype {dtype} cannot be stored in a checkpoint.")
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES_BY_NAME:
        raise CheckpointError(f"Unknown dtype {name!r} in the checkpoint index.")
    return _DTYPES_BY_NAME[name]


def safetensors_dtype_code(dtype: torch.dtype) -> str:
    """The safetensors header's name for ``dtype`` (``"F32"``)."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"Tensors of dtype {dtype} cannot be stored in a checkpoint.")
    return _SAFETENSORS_DTYPES[dtype]


def is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_shape(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)


def check_loadable(
    key: str, stored_shape: Any, stored_dtype: torch.dtype, shape: Any, dtype: torch.dtype
) -> str | None:
    """Why the checkpoint tensor ``key`` cannot be loaded into a tensor of ``shape`` and ``dtype``, or ``None``.

    Shapes must be equal; dtypes must be equal or both floating point (a deliberate cast, e.g. bf16 weights into
    a float32 model)."""
    if tuple(stored_shape) != tuple(shape):
        return f"{key}: checkpoint {tuple(stored_shape)}, model {tuple(shape)}"
    if stored_dtype != dtype and not (stored_dtype.is_floating_point and dtype.is_floating_point):
        return f"{key}: checkpoint dtype {dtype_name(stored_dtype)}, model dtype {dtype}"
    return None


def submodule_prefix(prefix: str) -> str:
    """A state_dict key prefix naming a submodule, ending with ``"."``: ``"model"`` and ``"model."`` both mean the
    keys of ``self.model`` (never ``model_ema.*``, which a bare string prefix would also match)."""
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


# --------------------------------------------------------------------------------------------------
# Files of a checkpoint directory: untrusted input
# --------------------------------------------------------------------------------------------------
#
# [Note: checkpoints are untrusted]
# Before any tensor data is read, what a reader is about to read is checked against the directory and the
# safetensors headers: every file is a plain name inside the directory (no "..", no separators, no symlink out of
# it) and a regular file of the size the index records, every header fits in its file and every tensor's bytes lie
# inside it, and each piece of a tensor the reader needs agrees with its file's header (key, dtype, rows). The
# index's own tables are checked whole when it is read, in time proportional to its size (tensors + files for the
# current version). So a shape in the index can never claim more bytes than the files hold, and nothing is
# allocated from a number that was not checked against a real file size. A reader checks, and opens, only the
# files that hold what it reads.



def is_plain_name(name: Any) -> TypeGuard[str]:
    """A file name with no directory part: not empty, no ``..``, no separator (so not absolute either)."""
    return (
        isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
        and "\0" not in name
    )


def refuse_unplain_name(directory: object, name: Any) -> None:
    if not is_plain_name(name):
        raise CheckpointError(
            f"The checkpoint in {directory} refers to the file {name!r}, which is not a plain file name inside the"
            f" directory; refusing to open it."
        )


def member_path(directory: Path, name: Any) -> Path:
    """``directory / name``, refusing any ``name`` that is not a plain file name inside ``directory`` (``..``, an
    absolute path, a path separator) or that is a symlink leading out of it. Nothing is opened."""
    refuse_unplain_name(directory, name)
    path = directory / name
    if path.is_symlink() and not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(
            f"Checkpoint file {path} is a symlink that leads out of {directory} (to {path.resolve()});"
            f" refusing to open it."
        )
    return path


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A small local JSON file that must hold an object (a ``config.json``, an ``adapter_config.json``), of at most
    ``MAX_JSON_BYTES``; ``what`` names it in the ``CheckpointError`` a missing, unreadable, oversized or non-object
    file raises."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_JSON_BYTES + 1)
        if len(text) > MAX_JSON_BYTES:
            raise ValueError(f"larger than {MAX_JSON_BYTES} bytes")
        data = json.loads(text)
    except (OSError, ValueError, RecursionError) as err:
        raise CheckpointError(f"{what} {path} is not readable JSON ({err}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object; a {path.name} is one.")
    return data
