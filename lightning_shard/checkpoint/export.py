"""Export a checkpoint's model in Hugging Face's ``save_pretrained`` layout.

The output directory holds ``model.safetensors`` (when everything fits in one file of ``max_shard_size``) or
``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json``, and ``config.json`` when one
is given, so ``AutoModel*.from_pretrained(output_dir)`` loads it. The file plan comes from
``huggingface_hub.split_torch_state_dict_into_shards`` run on meta tensors; the data is streamed one full
tensor at a time (assembled from the checkpoint's pieces, cast, written), so memory stays bounded by the
largest tensor. The result is written to a temporary directory next to ``output_dir`` and renamed into place.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_shard.checkpoint.averaged import Weights, weights_prefix
from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError, submodule_prefix
from lightning_shard.checkpoint.index import iter_index_tensors, read_index
from lightning_shard.checkpoint.layout import StoredTensor, check_piece, require_complete
from lightning_shard.checkpoint.reader import FileHandles, read_rows
from lightning_shard.checkpoint.storage import local_only
from lightning_shard.checkpoint.writer import SafetensorsStreamWriter

_BLOCK_BYTES = 16 * 2**20  # rows are read and written in blocks of at most this size
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ExportResult:
    """What ``export_hf`` wrote."""

    output_dir: Path
    files: list[str]  # the weight files, in order
    total_size: int  # bytes of tensor data, as in the index's ``metadata.total_size``
    skipped: list[str] = field(default_factory=list)  # model keys without the prefix: not exported
    dropped_ties: dict[str, str] = field(default_factory=dict)  # alias -> exported name


def export_hf(
    checkpoint: str | Path,
    output_dir: str | Path,
    prefix: str = "",
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    config: str | Path | None = None,
    overwrite: bool = False,
    weights: Weights = "current",
) -> ExportResult:
    """Write the model of ``checkpoint`` (not the optimizer) to ``output_dir`` in Hugging Face's layout.

    ``prefix`` is stripped from the LightningModule's state_dict keys (``"model."`` or ``"model"`` when the module
    holds the network as ``self.model``: a prefix names a submodule); keys without it are left out and listed in
    ``ExportResult.skipped``. Tied weights are written once, under the name the checkpoint stores them (the first
    one registered, e.g. ``transformer.wte.weight`` for GPT-2), which is the name transformers keeps. ``dtype``
    (``"bfloat16"``, ``"float16"``, ``"float32"``) casts floating-point tensors. ``config`` is a ``config.json``
    copied in (with ``dtype`` given, its ``dtype``/``torch_dtype`` entry says the new dtype, so ``from_pretrained``
    with ``dtype="auto"`` loads the weights as written).
    A non-empty existing ``output_dir`` is refused unless ``overwrite``. ``weights``: ``"current"`` (the model as
    trained) or ``"averaged"`` (the average a ``WeightAveraging`` callback kept during the fit).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    directory = local_only(checkpoint, "export_hf()")
    out = local_only(output_dir, "export_hf()")
    prefix = submodule_prefix(prefix)
    target_dtype = _export_dtype(dtype)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"Export destination {out} exists and is not empty; pass overwrite=True (--overwrite).")
    if config is not None and not Path(config).is_file():
        raise CheckpointError(f"Export config file {config} does not exist.")
    index = read_index(directory)
    require_complete(directory, index["tensors"])
    entries: dict[str, StoredTensor] = {}
    skipped: list[str] = []
    for key, entry in iter_index_tensors(index, weights_prefix(index, weights, directory)):
        if key.startswith(prefix):
            entries[key[len(prefix) :]] = entry
        else:
            skipped.append(key)
    if not entries:
        raise CheckpointError(f"No model key of {directory} starts with the export prefix {prefix!r}.")
    dropped = {
        alias.removeprefix(MODEL_PREFIX)[len(prefix) :]: stored.removeprefix(MODEL_PREFIX)[len(prefix) :]
        for alias, stored in index.get("ties", {}).items()
        if alias.removeprefix(MODEL_PREFIX).startswith(prefix) and stored.removeprefix(MODEL_PREFIX).startswith(prefix)
    }

    def out_dtype(entry: StoredTensor) -> torch.dtype:
        stored = entry.dtype
        return target_dtype if target_dtype is not None and stored.is_floating_point else stored

    meta = {k: torch.empty(e.shape, dtype=out_dtype(e), device="meta") for k, e in entries.items()}
    plan = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)  # type: ignore[arg-type]
    del meta
    total_size = _total_size(entries, out_dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        with FileHandles() as handles:
            for filename, keys in plan.filename_to_tensors.items():
                specs = [(k, out_dtype(entries[k]), entries[k].shape) for k in keys]
                writer = _PieceWriter(tmp / filename, specs, metadata={"format": "pt"})
                try:
                    for k, d, _ in specs:
                        writer.write_pieces(k, (rows.to(d) for rows in _iter_pieces(entries[k], handles)))
                    writer.close()
                except BaseException:
                    writer.close_quietly()
                    raise
        if plan.is_sharded:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total_size}, "weight_map": plan.tensor_to_filename}, indent=2,
                sort_keys=True) + "\n")
        if config is not None:
            _write_config(Path(config), tmp / "config.json", target_dtype)
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(out, list(plan.filename_to_tensors), total_size, skipped, dropped)


class _PieceWriter(SafetensorsStreamWriter):
    """A stream writer that takes a tensor as consecutive row blocks, so only one block is in memory at a time."""

    def write_pieces(self, name: str, blocks: Iterator[torch.Tensor]) -> None:
        expected_name, nbytes = self._expected[self._next]
        if name != expected_name:
            raise CheckpointError(f"Internal error: expected {expected_name}, got {name}.")
        written = 0
        for block in blocks:
            data = block.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # no copy of the bytes
            self._file.write(data.data)
            written += data.nbytes
            del data, block
        if written != nbytes:
            raise CheckpointError(f"Internal error: {name} took {written} bytes, expected {nbytes}.")
        self._next += 1


def _iter_pieces(entry: StoredTensor, handles: FileHandles) -> Iterator[torch.Tensor]:
    """The rows of a tensor in row order, in blocks of at most ``_BLOCK_BYTES`` (one row at least).

    Each stored piece is checked against its CRC-32 as its blocks go by; a mismatch raises before the tensor's
    last bytes are written, so the export fails and leaves nothing behind.
    """
    if not entry.shape:
        yield read_rows(entry, 0, 1, handles)
        return
    row_bytes = math.prod(entry.row_shape) * entry.dtype.itemsize
    step = max(1, _BLOCK_BYTES // max(1, row_bytes))
    for piece in entry.pieces():  # in row order, covering every row once (docs/checkpoint_format.md)
        path = entry.files.directory / piece.file
        expected = check_piece(entry, piece, entry.files.header(piece.file))
        crc = 0
        for start in range(piece.lo, piece.hi, step):
            block = read_rows(entry, start, min(piece.hi, start + step), handles)
            crc = zlib.crc32(block.contiguous().reshape(-1).view(torch.uint8).numpy().data, crc)
            if start + step >= piece.hi and expected is not None and crc & 0xFFFFFFFF != expected:
                raise CheckpointError(
                    f"Checkpoint file {path} is corrupted: {piece.key!r} does not match its checksum."
                )
            yield block
            del block


def _total_size(entries: dict[str, StoredTensor], out_dtype: Any) -> int:
    total = 0
    for entry in entries.values():
        total += math.prod(entry.shape) * out_dtype(entry).itemsize
    return total


def _export_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"Unknown export dtype {dtype!r}; choose one of {', '.join(_EXPORT_DTYPES)}.")
    return _EXPORT_DTYPES[dtype]


def _write_config(source: Path, dest: Path, dtype: torch.dtype | None) -> None:
    """Copy ``config.json``; with an export ``dtype``, record it where transformers reads the weights' dtype."""
    if dtype is None:
        shutil.copyfile(source, dest)
        return
    try:
        config = json.loads(source.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"Export config file {source} is not readable JSON ({err}).") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"Export config file {source} is not a JSON object; a config.json is one.")
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name  # what transformers writes and reads
    if "torch_dtype" in config:  # what older versions wrote and read
        config["torch_dtype"] = name
    dest.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (allowed by the caller) is moved aside first, then removed."""
    if not out.exists():
        tmp.replace(out)
        return
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    out.replace(old)
    try:
        tmp.replace(out)
    except BaseException:
        old.replace(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
