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

import contextlib
import json
import math
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard

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


def read_index(directory: Path) -> dict[str, Any]:
    """Read and check ``index.json``: its structure, format name and version, and that every file exists at its
    recorded size."""
    index_path = directory / INDEX_FILE
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory} is not a lightning_shard checkpoint directory. To load model weights from a single"
            f" .safetensors file use lightning_shard.load_safetensors_into(); pickled .ckpt files are never loaded."
        )
    index = read_json_member(directory, INDEX_FILE)
    _check_index_structure(index_path, index)
    for name, info in index["files"].items():
        path = member_path(directory, name)
        if not path.is_file():
            raise CheckpointError(f"Checkpoint file {path} is missing.")
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"Checkpoint file {path} has {size} bytes but the index records {info['size']}: it is truncated"
                f" or was modified."
            )
    validate_tensors(directory, index["tensors"], {name: info["size"] for name, info in index["files"].items()})
    return index


MAX_JSON_BYTES = 256 * 2**20  # an index or trainer state of any real checkpoint is far smaller


def read_json_member(directory: Path, name: str) -> Any:
    """The JSON file ``name`` of a checkpoint directory, refusing what is not a regular file inside it (a link out,
    a device, a pipe: nothing that could hang or never end) and anything above ``MAX_JSON_BYTES``."""
    path = member_path(directory, name)
    if not path.exists():
        raise CheckpointError(f"{path} is missing: {directory} is not a complete checkpoint.")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file (a directory, a device or a pipe); refusing to read it.")
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_JSON_BYTES} bytes, which no checkpoint writes; not read.")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, absurd nesting
        raise CheckpointError(f"{path} is not valid JSON ({type(err).__name__}: {err}).") from None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_index_structure(path: Path, index: Any) -> None:
    """The index's tables have the types its format gives them (docs/checkpoint_format.md); tensor entries are
    checked by ``validate_tensors``."""

    def damaged(what: str) -> CheckpointError:
        return CheckpointError(f"{path} is damaged: {what}. Use another checkpoint, or save this one again.")

    if not isinstance(index, dict):
        raise damaged(f"it holds a JSON {type(index).__name__}, not an object")
    if index.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a {FORMAT_NAME} index (format={index.get('format')!r}).")
    version = index.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version}; this lightning_shard reads version {FORMAT_VERSION}. Upgrade"
            " lightning_shard to read it."
        )
    if version != FORMAT_VERSION:
        raise damaged(f"its format version is {version!r}, which no lightning_shard writes")
    if not isinstance(index.get("files"), dict) or not isinstance(index.get("tensors"), dict):
        raise CheckpointError(f"{path} lacks its 'files' or 'tensors' table.")
    for name, info in index["files"].items():
        if not (isinstance(info, dict) and _is_count(info.get("size")) and isinstance(info.get("sha256"), str)):
            raise damaged(f"the entry of {name!r} in 'files' needs a byte count 'size' and a string 'sha256'")
    mesh = index.get("mesh")
    if not _is_count(index.get("world_size")) or not (
        isinstance(mesh, dict) and _is_count(mesh.get("replicas")) and _is_count(mesh.get("shard_size"))
    ):
        raise damaged("'world_size' and 'mesh' ('replicas', 'shard_size') must be counts")
    ties = index.get("ties", {})
    if not isinstance(ties, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ties.items()):
        raise damaged("'ties' must map tensor names to tensor names")
    optimizers = index.get("optimizers", [])
    if not isinstance(optimizers, list):
        raise damaged("'optimizers' must be a list")
    for i, optimizer in enumerate(optimizers):
        groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
        groups_ok = isinstance(groups, list) and all(
            isinstance(g, dict) and isinstance(g.get("options"), dict) and isinstance(g.get("params"), list)
            and all(isinstance(n, str) for n in g["params"]) for g in groups
        )
        values = optimizer.get("values", {}) if isinstance(optimizer, dict) else None
        values_ok = isinstance(values, dict) and all(isinstance(v, dict) for v in values.values())
        if not (groups_ok and values_ok):
            raise damaged(
                f"optimizer {i} needs 'param_groups' (each with a 'params' list of names and an 'options' object)"
                " and 'values' objects"
            )
        row_states = optimizer.get("scalar_param_states", {})
        if not (isinstance(row_states, dict) and all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in row_states.values()
        )):
            raise damaged(f"optimizer {i}'s 'scalar_param_states' must map parameter names to lists of state names")


# --------------------------------------------------------------------------------------------------
# Validation: a checkpoint is untrusted input
# --------------------------------------------------------------------------------------------------
#
# [Note: checkpoints are untrusted]
# Before any tensor data is read, the index is checked against the directory and the safetensors headers:
# every file is a plain name inside the directory (no "..", no separators, no symlink out of it), every
# header fits in its file and every tensor's bytes lie inside it, and each tensor's pieces agree with the
# headers and cover its rows exactly once. So a shape in the index can never claim more bytes than the
# files hold, and nothing is allocated from a number that was not checked against a real file size.

MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header is JSON describing the tensors; 100 MiB is far beyond any model
_TORCH_BY_SAFETENSORS = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}


def member_path(directory: Path, name: Any) -> Path:
    """``directory / name``, refusing any ``name`` that is not a plain file name inside ``directory`` (``..``, an
    absolute path, a path separator) or that is a symlink leading out of it. Nothing is opened."""
    plain = (
        isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
        and "\0" not in name and not Path(name).is_absolute()
    )
    if not plain:
        raise CheckpointError(
            f"The checkpoint in {directory} refers to the file {name!r}, which is not a plain file name inside the"
            f" directory; refusing to open it."
        )
    path = directory / name
    if path.is_symlink() and not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(
            f"Checkpoint file {path} is a symlink that leads out of {directory} (to {path.resolve()});"
            f" refusing to open it."
        )
    return path


def read_safetensors_header(path: Path, size: int) -> dict[str, Any]:
    """The tensor table of the safetensors file ``path`` of ``size`` bytes (name -> dtype, shape, data_offsets),
    checked against ``size``: the header fits in the file, and every tensor's bytes lie inside its data section."""
    with open(path, "rb") as f:
        return _read_header(f, path, size)[1]


def _read_header(f: Any, path: Path, size: int) -> tuple[int, dict[str, Any]]:
    """``read_safetensors_header`` on an open file (at its start); also returns where the tensor data starts."""
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"Checkpoint file {path} has {size} bytes, too few for a safetensors header.")
    (length,) = struct.unpack("<Q", head)
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(
            f"Checkpoint file {path} claims a {length}-byte header but holds {size} bytes in all: it is damaged."
        )
    try:
        header = json.loads(f.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"Checkpoint file {path} has a header that is not valid JSON ({err}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"Checkpoint file {path} has a header that is not a table of tensors.")
    data_bytes = size - 8 - length
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, info in tensors.items():
        _check_header_entry(path, key, info, data_bytes)
    return 8 + length, tensors


def _check_header_entry(path: Path, key: str, info: Any, data_bytes: int) -> None:
    info = info if isinstance(info, dict) else {}
    shape, offsets = info.get("shape"), info.get("data_offsets")
    dtype = _TORCH_BY_SAFETENSORS.get(str(info.get("dtype")))
    if dtype is None or not _is_shape(shape) or not _is_shape(offsets) or len(offsets) != 2:
        raise CheckpointError(f"Checkpoint file {path}: tensor {key!r} has a malformed header entry {info!r}.")
    begin, end = offsets
    if not begin <= end <= data_bytes or end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(
            f"Checkpoint file {path}: tensor {key!r} of shape {shape} ({info['dtype']}) claims bytes"
            f" [{begin}, {end}) but the file holds {data_bytes} bytes of tensor data."
        )


def _is_shape(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)


def validate_tensors(
    directory: Path,
    tensors: dict[str, Any],
    file_sizes: dict[str, int],
    headers: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Check every tensor entry of an index against the files (see [Note: checkpoints are untrusted]): a known
    dtype, a well-formed shape, pieces in listed files whose headers hold exactly the claimed rows, and pieces
    that never overlap or leave a gap (``require_complete`` checks that they reach the last row). Reads only
    headers (those in ``headers``, already read by ``read_safetensors_header``, are not read again); raises
    ``CheckpointError`` naming the file and key."""
    headers = dict(headers or {})
    for key, entry in tensors.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        pieces = entry.get("pieces") if isinstance(entry, dict) else None
        if not (_is_shape(shape) and isinstance(pieces, list) and pieces and isinstance(entry.get("dtype"), str)):
            raise CheckpointError(f"{directory / INDEX_FILE}: tensor {key!r} has a malformed entry.")
        dtype = dtype_from_name(entry.get("dtype", ""))
        rows = shape[0] if shape else 1
        covered = 0
        for piece in sorted(pieces, key=_first_row):
            lo, hi = _piece_rows(directory, key, piece)
            if lo != covered or hi > rows:
                problem = "leaves a gap before it" if lo > covered else "overlaps the previous piece"
                if hi > rows:
                    problem = f"lies beyond the tensor's {rows} rows"
                raise CheckpointError(
                    f"{directory / INDEX_FILE}: tensor {key!r} (shape {shape}): the piece in {piece.get('file')!r}"
                    f" holding rows [{lo}, {hi}) {problem}."
                )
            name = piece.get("file")
            if name not in file_sizes:
                raise CheckpointError(
                    f"{directory / INDEX_FILE}: tensor {key!r} refers to the file {name!r}, which the index does not"
                    f" list."
                )
            if name not in headers:
                headers[name] = read_safetensors_header(member_path(directory, name), file_sizes[name])
            _check_piece(directory / name, key, piece, headers[name], [hi - lo, *shape[1:]] if shape else [], dtype)
            covered = hi
    # That the pieces reach the last row is checked by require_complete(), after a loader has compared the shapes
    # with the model's: a shape that differs from the model's is reported as that.


def require_complete(directory: Path, tensors: dict[str, Any], keys: Any = None) -> None:
    """Raise ``CheckpointError`` unless the pieces of each tensor in ``keys`` (all when ``None``) reach its last
    row; with ``validate_tensors``, every row is then covered exactly once."""
    for key in tensors if keys is None else keys:
        entry = tensors[key]
        rows = entry["shape"][0] if entry["shape"] else 1
        covered = max(piece["rows"][1] for piece in entry["pieces"])
        if covered != rows:
            raise CheckpointError(
                f"{directory / INDEX_FILE}: tensor {key!r} (shape {entry['shape']}): its pieces cover rows"
                f" [0, {covered}) of {rows}."
            )


def _first_row(piece: Any) -> int:
    rows = piece.get("rows") if isinstance(piece, dict) else None
    return rows[0] if _is_shape(rows) and rows else 0


def _piece_rows(directory: Path, key: str, piece: Any) -> tuple[int, int]:
    if not _is_well_formed_piece(piece):
        raise CheckpointError(f"{directory / INDEX_FILE}: tensor {key!r} has a malformed piece {piece!r}.")
    lo, hi = piece["rows"]
    return lo, hi


def _is_well_formed_piece(piece: Any) -> bool:
    if not isinstance(piece, dict):
        return False
    rows = piece.get("rows")
    return (
        _is_shape(rows) and len(rows) == 2 and rows[0] <= rows[1]
        and isinstance(piece.get("key"), str) and isinstance(piece.get("file"), str)
        and ("crc32" not in piece or _is_count(piece["crc32"]))
    )


def _check_piece(
    path: Path, key: str, piece: dict[str, Any], header: dict[str, Any], shape: list[int], dtype: torch.dtype
) -> None:
    info = header.get(piece["key"])
    if info is None:
        raise CheckpointError(f"Checkpoint file {path} does not hold {piece['key']!r}, a piece of tensor {key!r}.")
    shape_ok = info["shape"] == shape or (not shape and info["shape"] == [1])  # a 0-dim tensor: () or (1,)
    if not shape_ok or _TORCH_BY_SAFETENSORS[info["dtype"]] != dtype:
        raise CheckpointError(
            f"Checkpoint file {path}: {piece['key']!r}, rows {piece['rows']} of tensor {key!r}, holds shape"
            f" {info['shape']} ({info['dtype']}) but the index claims shape {shape} ({dtype_name(dtype)})."
        )


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


class OpenFiles:
    """Safetensors files opened once each and kept open while a load reads its rows from them.

    Rows are read with plain file reads into tensors of their own, not through a memory map: the process then
    holds only the rows it asked for (pages of the file it maps would count in its RSS, and fault-around maps
    neighbouring rows too), and a file that is shorter than its header says fails the read instead of the process.
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._stack = contextlib.ExitStack()
        self._files: dict[str, tuple[Any, int, dict[str, Any]]] = {}  # name -> (file, data start, tensor table)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._files.clear()

    def read(self, piece: dict[str, Any], start: int, stop: int, into: Tensor | None = None) -> Tensor:
        """Rows ``[start, stop)`` of the tensor ``piece`` names in its file (a 0-dim tensor: the whole of it), read
        straight into ``into`` when it is a contiguous tensor of that shape and the file's dtype."""
        path = member_path(self._directory, piece["file"])
        if piece["file"] not in self._files:
            handle = self._stack.enter_context(open(path, "rb"))  # noqa: SIM115 - closed with the stack
            self._files[piece["file"]] = (handle, *_read_header(handle, path, os.fstat(handle.fileno()).st_size))
        handle, data_start, table = self._files[piece["file"]]
        info = table.get(piece["key"])
        if info is None:
            raise CheckpointError(f"Checkpoint file {path} does not hold {piece['key']!r}.")
        shape, dtype = info["shape"], _TORCH_BY_SAFETENSORS[info["dtype"]]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        out_shape = (stop - start, *shape[1:]) if shape else ()
        fits = into is not None and into.dtype == dtype and into.shape == out_shape and into.is_contiguous()
        out = into if fits and into is not None else torch.empty(out_shape, dtype=dtype)
        handle.seek(data_start + info["data_offsets"][0] + start * row_bytes)
        buffer = out.reshape(-1).view(torch.uint8).numpy()
        if handle.readinto(buffer) != buffer.nbytes:
            raise CheckpointError(f"Checkpoint file {path} ends inside {piece['key']!r}: it is truncated.")
        return out


def read_rows(
    directory: Path, entry: dict[str, Any], start: int, stop: int, files: OpenFiles | None = None
) -> Tensor:
    """Rows ``[start, stop)`` (dim 0) of the tensor ``entry`` describes, reading only the pieces that hold them.

    ``entry`` must have passed ``validate_tensors`` (``read_index`` does that). ``files`` keeps each file open
    across calls; without it the files are opened for this call only. A 0-dim tensor is one row: read whole (shape
    ``()``) unless ``[start, stop)`` is empty (then an empty 1-D tensor). A piece
    read entirely is checked against its CRC-32.
    """
    if files is None:
        with OpenFiles(directory) as own:
            return read_rows(directory, entry, start, stop, own)
    shape = entry["shape"]
    dtype = dtype_from_name(entry["dtype"])
    if not shape:  # one row: read whole when [start, stop) covers it, else no rows (a rank holding none)
        if stop <= start:
            return torch.empty(0, dtype=dtype)
        piece = entry["pieces"][0]
        return _checked(directory, piece, files.read(piece, 0, 1), whole=True).to(dtype)
    out = torch.empty(stop - start, *shape[1:], dtype=dtype)
    for piece in entry["pieces"]:
        lo, hi = piece["rows"]
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        target = out[a - start : b - start]
        rows = files.read(piece, a - lo, b - lo, into=target)  # no copy when the file holds the model's dtype
        _checked(directory, piece, rows, whole=(a == lo and b == hi))
        if rows is not target:
            target.copy_(rows)
    return out


def _checked(directory: Path, piece: dict[str, Any], tensor: Tensor, whole: bool) -> Tensor:
    if whole and "crc32" in piece and crc32(tensor) != piece["crc32"]:
        raise CheckpointError(
            f"Checkpoint file {directory / piece['file']} is corrupted: {piece['key']!r} does not match its checksum."
        )
    return tensor


def submodule_prefix(prefix: str) -> str:
    """A state_dict key prefix naming a submodule, ending with ``"."``: ``"model"`` and ``"model."`` both mean the
    keys of ``self.model`` (never ``model_ema.*``, which a bare string prefix would also match)."""
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def iter_index_tensors(index: dict[str, Any], prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The index's tensor entries whose keys start with ``prefix``, keyed without it."""
    for key, entry in index["tensors"].items():
        if key.startswith(prefix):
            yield key[len(prefix) :], entry


def model_ties(index: dict[str, Any]) -> dict[str, str]:
    """Tied model weights: each alias mapped to the name it is stored under (both without the model prefix)."""
    return {k.removeprefix(MODEL_PREFIX): v.removeprefix(MODEL_PREFIX) for k, v in index.get("ties", {}).items()}
