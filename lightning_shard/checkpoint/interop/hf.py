"""Hugging Face's safetensors layout, in and out: plain and Hugging Face model files loaded into a sharded model
(``load_safetensors_into``), a checkpoint's model written as one ``.safetensors`` file (``consolidate``) or in the
layout of ``save_pretrained`` (``export_hf``).

``export_hf``'s output directory holds ``model.safetensors`` (when everything fits in one file of
``max_shard_size``) or ``model-00001-of-0000N.safetensors`` files plus ``model.safetensors.index.json``, and
``config.json`` when one is given, so ``AutoModel*.from_pretrained(output_dir)`` loads it. The file plan comes from
``huggingface_hub.split_torch_state_dict_into_shards`` run on meta tensors; the data is streamed a block of rows at a
time (assembled from the checkpoint's pieces, cast, written), so memory stays bounded by the largest tensor.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shard.checkpoint.format import (
    FORMAT_NAME,
    MODEL_PREFIX,
    CheckpointError,
    dtype_name,
    member_path,
    read_json_object,
    submodule_prefix,
)
from lightning_shard.checkpoint.format.adapters import ADAPTERS
from lightning_shard.checkpoint.interop.export import (
    ExportResult,
    cast_dtypes,
    export_source,
    model_entries,
    require_whole_model,
    skipped_note,
    staged,
    torch_dtype,
    total_size,
    write_json,
    write_tensors_file,
)
from lightning_shard.checkpoint.interop.peft import export_merged
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.io.averaged import Weights
from lightning_shard.checkpoint.io.files import CheckpointFiles
from lightning_shard.checkpoint.io.index import iter_index_tensors, model_only_index, model_ties
from lightning_shard.checkpoint.io.layout import StoredTensor, Whole, require_complete
from lightning_shard.checkpoint.io.reader import FileHandles, read_tensor
from lightning_shard.checkpoint.io.storage import local_only
from lightning_shard.checkpoint.io.writer import SafetensorsStreamWriter
from lightning_shard.checkpoint.load.directory import LoadResult, load_model, sharded_engine

HF_INDEX_SUFFIX = ".safetensors.index.json"


def load_safetensors_into(
    module: nn.Module,
    path: str | Path,
    prefix: str = "",
    strict: bool = True,
    rename: Callable[[str], str] | None = None,
) -> LoadResult:
    """Load full model weights in safetensors form into a model that ``ShardStrategy`` (or ``shard_model``) has
    sharded; each rank reads only its rows of each tensor, opening each file once. Collective: every rank must call
    it, e.g. in ``on_fit_start``.

    ``path`` is one ``.safetensors`` file (a consolidated checkpoint, a Hugging Face model file), a Hugging Face
    ``*.safetensors.index.json`` (its ``weight_map`` names the file of each tensor), or a directory holding either
    as ``save_pretrained`` writes it (``model.safetensors.index.json`` is preferred to ``model.safetensors``).
    ``prefix`` is prepended to the file's keys to match the module's ``state_dict`` keys (``"model."`` or
    ``"model"`` when the LightningModule holds the network as ``self.model``: a prefix names a submodule), after
    ``rename`` (if given) maps each file key.
    A tied weight the files store once (GPT-2's ``lm_head.weight``) is loaded through the name they store.
    The files are validated before any tensor data is read (see docs/checkpoint_format.md). Returns the missing
    and unexpected keys."""
    engine = sharded_engine(module, "load_safetensors_into()")
    directory, tensors = agree(lambda: _safetensors_tensors(local_only(path, "load_safetensors_into()")))
    prefix = submodule_prefix(prefix)
    index = model_only_index({prefix + (rename(key) if rename else key): e for key, e in tensors.items()})
    return load_model(engine, module, directory, index, strict=strict)


def _safetensors_tensors(path: Path) -> tuple[Path, dict[str, StoredTensor]]:
    """The directory and the checked tensors (keyed by the files' keys) of a ``.safetensors`` file, a Hugging Face
    index, or a directory holding either. Every file's header is read and checked here: a ``weight_map`` says
    nothing of shapes."""
    if path.is_dir():
        found = [path / name for name in ("model" + HF_INDEX_SUFFIX, "model.safetensors") if (path / name).is_file()]
        if not found:
            raise CheckpointError(
                f"{path} holds neither model{HF_INDEX_SUFFIX} nor model.safetensors; pass the file itself."
            )
        path = found[0]
    directory = path.parent
    if path.name.endswith(HF_INDEX_SUFFIX):
        weight_map = read_json_object(path, "The safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{path}: 'weight_map' must map each tensor name to a file name.")
    elif path.is_file():
        weight_map = None
    else:
        raise CheckpointError(f"Cannot read the safetensors file {path}: it does not exist.")
    names = sorted(set(weight_map.values())) if weight_map is not None else [path.name]
    missing = [name for name in names if not member_path(directory, name).is_file()]
    if missing:
        raise CheckpointError(f"{path} refers to files missing from {directory}: {missing}.")
    files = CheckpointFiles(directory, {name: (directory / name).stat().st_size for name in names})
    headers = {name: files.header(name) for name in names}
    if weight_map is None:
        weight_map = dict.fromkeys(headers[path.name].entries, path.name)
    tensors = {}
    for key, name in weight_map.items():
        info = headers[name].entries.get(key)
        if info is None:
            raise CheckpointError(f"{path}: {key!r} is mapped to {directory / name}, which does not hold it.")
        rows = info.shape[0] if info.shape else 1
        tensors[key] = StoredTensor(key, info.shape, info.dtype, Whole(name, key, rows), files)
    return directory, tensors


def consolidate(checkpoint_dir: str | Path, output: str | Path) -> Path:
    """Write the model of ``checkpoint_dir`` (a local directory, or a URL: ``s3://...``, credentials from the
    environment) as one ``.safetensors`` file under the LightningModule's state_dict keys.

    Tied weights are stored once; the tie is recorded in the file's metadata (``"ties"``: JSON mapping each
    alias to the stored key). The result loads with ``safetensors.torch.load_file``. An existing file at ``output``
    is replaced; a path inside the checkpoint or a directory is refused.
    """
    directory, out, index = export_source(checkpoint_dir, output, True, "consolidate()", file=True, urls=True)
    require_complete(directory, index["tensors"])
    model = list(iter_index_tensors(index, MODEL_PREFIX))
    metadata = {"format": FORMAT_NAME, "ties": json.dumps(model_ties(index))}
    with staged(out, file=True) as tmp, FileHandles() as handles, SafetensorsStreamWriter(
            tmp, [(key, e.dtype, e.shape) for key, e in model], metadata=metadata) as writer:
        for key, entry in model:
            writer.write(key, read_tensor(entry, handles))
    return out


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

    directory, out, index = export_source(checkpoint, output_dir, overwrite, "export_hf()")
    prefix, target = submodule_prefix(prefix), torch_dtype(dtype)
    if config is not None and not Path(config).is_file():
        raise CheckpointError(f"Export config file {config} does not exist.")
    if ADAPTERS in index:
        if prefix or config is not None:
            raise CheckpointError(
                f"{directory} holds peft adapters, so it is exported merged into the base model (--base), whose own"
                " keys and config.json are written: prefix (--prefix) and config (--config) do not apply. Leave them"
                " out, or export the adapters alone with --format peft."
            )
        return export_merged(directory, index, out, base, target, weights, max_shard_size)
    if base is not None:
        raise CheckpointError(f"{directory} records no peft adapters: base= (--base) only applies to merging them.")
    require_whole_model(directory, index)
    entries, skipped = model_entries(directory, index, prefix, weights)
    dropped = {
        alias.removeprefix(MODEL_PREFIX)[len(prefix) :]: stored.removeprefix(MODEL_PREFIX)[len(prefix) :]
        for alias, stored in index.get("ties", {}).items()
        if alias.removeprefix(MODEL_PREFIX).startswith(prefix) and stored.removeprefix(MODEL_PREFIX).startswith(prefix)
    }
    dtypes = cast_dtypes(entries, target)
    meta = {k: torch.empty(e.shape, dtype=dtypes[k], device="meta") for k, e in entries.items()}
    plan = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)  # type: ignore[arg-type]
    del meta
    total = total_size(entries, dtypes)
    with staged(out) as tmp, FileHandles() as handles:
        for filename, keys in plan.filename_to_tensors.items():
            write_tensors_file(tmp / filename, {k: entries[k] for k in keys}, dtypes, handles)
        if plan.is_sharded:
            write_json(tmp / "model.safetensors.index.json",
                       {"metadata": {"total_size": total}, "weight_map": plan.tensor_to_filename})
        if config is not None:
            _write_config(Path(config), tmp / "config.json", target)
    files = list(plan.filename_to_tensors)
    return ExportResult(out, files, {k: dtype_name(d) for k, d in dtypes.items()}, total,
                        f"{len(files)} weight files ({total / 2**20:.2f} MiB)", skipped, dropped,
                        skipped_note(skipped, prefix))


def _write_config(source: Path, dest: Path, dtype: torch.dtype | None) -> None:
    """Copy ``config.json``; with an export ``dtype``, record it where transformers reads the weights' dtype."""
    if dtype is None:
        shutil.copyfile(source, dest)
        return
    config: dict[str, Any] = read_json_object(source, "Export config file")
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name  # what transformers writes and reads
    if "torch_dtype" in config:  # what older versions wrote and read
        config["torch_dtype"] = name
    write_json(dest, config)
