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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError, read_json_object, submodule_prefix
from lightning_shard.checkpoint.format.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ADAPTERS,
    DEFAULT_ADAPTER,
    AdapterExport,
    adapter_directory,
    adapters_to_export,
    merge_adapters,
)
from lightning_shard.checkpoint.io.averaged import Weights, weights_prefix
from lightning_shard.checkpoint.io.file_modes import give_default_modes
from lightning_shard.checkpoint.io.index import LEFT_OUT, iter_index_tensors, read_index
from lightning_shard.checkpoint.io.layout import StoredTensor, require_complete
from lightning_shard.checkpoint.io.reader import FileHandles, read_rows
from lightning_shard.checkpoint.io.storage import local_only
from lightning_shard.checkpoint.io.writer import SafetensorsStreamWriter

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
    base: str | Path | None = None,
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

    A checkpoint whose module held a peft model is exported merged: its adapters are applied to the base model at
    ``base`` (a Hugging Face model directory, by default the adapter config's ``base_model_name_or_path`` when that
    is a local directory) with peft's ``merge_and_unload`` and the result saved with ``save_pretrained`` (see
    [Note: adapters recorded at save time]). A checkpoint that left weights out without recording adapters is
    refused: it is not a whole model.
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
    if ADAPTERS in index:
        if prefix or config is not None:
            raise CheckpointError(
                f"{directory} holds peft adapters, so it is exported merged into the base model (--base), whose own"
                " keys and config.json are written: prefix (--prefix) and config (--config) do not apply. Leave them"
                " out, or export the adapters alone with --format peft."
            )
        return _export_merged(directory, index, out, base, target_dtype, weights, max_shard_size)
    if base is not None:
        raise CheckpointError(f"{directory} records no peft adapters: base= (--base) only applies to merging them.")
    if index.get(LEFT_OUT):
        raise CheckpointError(
            f"{directory} holds only part of the model (saved with save_trainable_only=True or a filter; the"
            f" {len(index[LEFT_OUT])} weights it left out are not in it), so it is not a whole model to export."
            " Export its adapters with --format peft (--adapter-config when it records none), or export a"
            " checkpoint saved with every weight."
        )
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

    tmp = temporary_directory_beside(out)
    try:
        with FileHandles() as handles:
            for filename, keys in plan.filename_to_tensors.items():
                write_tensors_file(tmp / filename, {k: entries[k] for k in keys}, out_dtype, handles)
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


def write_tensors_file(
    path: Path, entries: dict[str, StoredTensor], out_dtype: Callable[[StoredTensor], torch.dtype], handles: FileHandles
) -> None:
    """Write the checkpoint tensors ``entries`` (under the keys given) as the safetensors file ``path``, each full
    tensor streamed in row blocks and checked against its checksums, cast to ``out_dtype(entry)``."""
    specs = [(k, out_dtype(e), e.shape) for k, e in entries.items()]
    writer = _PieceWriter(path, specs, metadata={"format": "pt"})
    try:
        for k, d, _ in specs:
            writer.write_pieces(k, (rows.to(d) for rows in _iter_pieces(entries[k], handles)))
        writer.close()
    except BaseException:
        writer.close_quietly()
        raise


def export_peft(
    checkpoint: str | Path,
    output_dir: str | Path,
    weights: Weights = "current",
    adapter_config: str | Path | None = None,
    prefix: str = "",
    adapter_name: str | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the peft adapters of ``checkpoint`` as ``PeftModel.save_pretrained`` does: ``adapter_model.safetensors``
    and ``adapter_config.json`` in ``output_dir`` (adapters other than ``default`` in subdirectories named after
    them), so that ``PeftModel.from_pretrained(base_model, output_dir)`` loads them. The tensors and config come
    from the record the save made (see [Note: adapters recorded at save time]); for a checkpoint without one,
    ``adapter_config`` (a LoRA ``adapter_config.json``) with ``prefix`` (the submodule holding the ``PeftModel``,
    e.g. ``"model"``) and ``adapter_name`` (default ``"default"``) pick the LoRA tensors by their names; with a
    record, ``adapter_name`` exports that adapter only. ``weights`` and ``dtype`` are as for ``export_hf``."""
    directory = local_only(checkpoint, "export_peft()")
    out = local_only(output_dir, "export_peft()")
    target_dtype = _export_dtype(dtype)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"Export destination {out} exists and is not empty; pass overwrite=True (--overwrite).")
    index = read_index(directory)
    adapters = adapters_to_export(index, directory, adapter_config, prefix, adapter_name)
    source = weights_prefix(index, weights, directory)
    ties = index.get("ties", {})
    planned: list[tuple[AdapterExport, dict[str, StoredTensor]]] = []
    for adapter in adapters:
        entries = {}
        for peft_key, ours in adapter.tensors.items():
            stored = ties.get(MODEL_PREFIX + ours, MODEL_PREFIX + ours).removeprefix(MODEL_PREFIX)
            entry = index["tensors"].get(source + stored)
            if entry is None:
                raise CheckpointError(
                    f"{directory} does not hold {source + stored!r}, a tensor of adapter {adapter.name!r}"
                    " (a filter left it out?)."
                )
            entries[peft_key] = entry
        require_complete(directory, {e.key: e for e in entries.values()})
        planned.append((adapter, entries))

    def out_dtype(entry: StoredTensor) -> torch.dtype:
        return target_dtype if target_dtype is not None and entry.dtype.is_floating_point else entry.dtype

    tmp = temporary_directory_beside(out)
    files = []
    try:
        with FileHandles() as handles:
            for adapter, entries in planned:
                where = adapter_directory(tmp, adapter.name)
                where.mkdir(parents=True, exist_ok=True)
                write_tensors_file(where / ADAPTER_WEIGHTS, entries, out_dtype, handles)
                (where / ADAPTER_CONFIG).write_text(json.dumps(adapter.config, indent=2, sort_keys=True) + "\n")
                files.append(str(adapter_directory(Path(), adapter.name) / ADAPTER_WEIGHTS))
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(_total_size(entries, out_dtype) for _, entries in planned)
    return ExportResult(out, files, total)


def _export_merged(
    directory: Path,
    index: dict[str, Any],
    out: Path,
    base: str | Path | None,
    dtype: torch.dtype | None,
    weights: Weights,
    max_shard_size: int | str,
) -> ExportResult:
    """``export_hf`` of a checkpoint with peft adapters: merged into the base model by peft."""
    adapters = adapters_to_export(index, directory, None, "", None)
    default = next((a for a in adapters if a.name == DEFAULT_ADAPTER), adapters[0])  # the one peft activates
    if base is None:
        named = default.config.get("base_model_name_or_path")
        if not (isinstance(named, str) and Path(named).is_dir()):
            raise CheckpointError(
                f"{directory} holds peft adapters; merging them needs the base model they were trained on. Give its"
                f" Hugging Face directory with --base (base=...); the adapter config names {named!r}, which is not"
                " a local directory."
            )
        base = named
    tmp = temporary_directory_beside(out)
    try:
        export_peft(directory, tmp / "adapter", weights=weights, adapter_name=default.name)
        merge_adapters(adapter_directory(tmp / "adapter", default.name), base, tmp / "model", dtype, max_shard_size)
        move_into_place(tmp / "model", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    return ExportResult(out, files, sum((out / f).stat().st_size for f in files))


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
    """The rows of a tensor in row order, in blocks of about ``_BLOCK_BYTES`` (one row at least), every byte checked
    against its file's checksums as it is read (see [Note: every byte that lands is checked]); a mismatch raises
    before the tensor's last bytes are written, so the export fails and leaves nothing behind. A piece of a version
    1-2 file is checked whole, so it is read whole, in one block."""
    if not entry.shape:
        yield read_rows(entry, 0, 1, handles)
        return
    row_bytes = math.prod(entry.row_shape) * entry.dtype.itemsize
    step = max(1, _BLOCK_BYTES // max(1, row_bytes))
    for piece in entry.pieces():  # in row order, covering every row once (docs/checkpoint_format.md)
        rows = step if entry.files.header(piece.file).blocks is not None else piece.hi - piece.lo
        for start in range(piece.lo, piece.hi, rows):
            yield read_rows(entry, start, min(piece.hi, start + rows), handles)


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
    config = read_json_object(source, "Export config file")
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name  # what transformers writes and reads
    if "torch_dtype" in config:  # what older versions wrote and read
        config["torch_dtype"] = name
    dest.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def temporary_directory_beside(out: Path) -> Path:
    """A new hidden directory next to ``out`` (same file system), to write an export into before ``move_into_place``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, its files and folders given the umask's modes first; an existing ``out`` (allowed by
    the caller) is moved aside first, then removed."""
    give_default_modes(tmp)
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
