"""peft's layout: a checkpoint's adapters written as ``PeftModel.save_pretrained`` writes them (``export_peft``), or
merged into their base model by peft (``export_merged``, for ``export_hf``); see [Note: adapters recorded at save
time] in ``format/adapters.py``."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_shard.checkpoint.format import (
    MODEL_PREFIX,
    CheckpointError,
    dtype_name,
    read_json_object,
    submodule_prefix,
)
from lightning_shard.checkpoint.format.adapters import ADAPTERS, check_adapters_record
from lightning_shard.checkpoint.format.safetensors_header import read_safetensors_header
from lightning_shard.checkpoint.interop.export import (
    ExportResult,
    cast_dtypes,
    export_source,
    staged,
    torch_dtype,
    total_size,
    write_json,
    write_tensors_file,
)
from lightning_shard.checkpoint.io.averaged import Weights, weights_prefix
from lightning_shard.checkpoint.io.layout import require_complete
from lightning_shard.checkpoint.io.reader import FileHandles
from lightning_shard.checkpoint.io.storage import Location

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_ADAPTER = "default"
_LORA_TENSORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


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
    directory, out, index = export_source(checkpoint, output_dir, overwrite, "export_peft()")
    target = torch_dtype(dtype)
    source = weights_prefix(index, weights, directory)
    ties = index.get("ties", {})
    planned = []
    for adapter in adapters_to_export(index, directory, adapter_config, prefix, adapter_name):
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
        planned.append((adapter, entries, cast_dtypes(entries, target)))
    files, tensors = [], {}
    with staged(out) as tmp, FileHandles() as handles:
        for adapter, entries, dtypes in planned:
            where = adapter_directory(tmp, adapter.name)
            where.mkdir(parents=True, exist_ok=True)
            write_tensors_file(where / ADAPTER_WEIGHTS, entries, dtypes, handles)
            write_json(where / ADAPTER_CONFIG, adapter.config)
            files.append(str(adapter_directory(Path(), adapter.name) / ADAPTER_WEIGHTS))
            tensors.update({str(adapter_directory(Path(), adapter.name) / k): dtype_name(d) for k, d in dtypes.items()})
    total = sum(total_size(entries, dtypes) for _, entries, dtypes in planned)
    return ExportResult(out, files, tensors, total, f"{', '.join(files)} ({total / 2**20:.2f} MiB)")


def export_merged(
    directory: Location,
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
    with tempfile.TemporaryDirectory() as scratch, staged(out) as tmp:
        adapter_dir = Path(scratch) / "adapter"
        export_peft(str(directory), adapter_dir, weights=weights, adapter_name=default.name)
        merge_adapters(adapter_directory(adapter_dir, default.name), base, tmp, dtype, max_shard_size)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    headers = [read_safetensors_header(out / f, (out / f).stat().st_size) for f in files]
    tensors = {key: dtype_name(e.dtype) for header in headers for key, e in header.entries.items()}
    total = sum((out / f).stat().st_size for f in files)
    return ExportResult(out, files, tensors, total, f"{len(files)} weight files ({total / 2**20:.2f} MiB)")


@dataclass(frozen=True)
class AdapterExport:
    """One adapter to write: its name, its config and the checkpoint's model key of each tensor under peft's name."""

    name: str
    config: dict[str, Any]
    tensors: dict[str, str]  # peft key -> the checkpoint's model key (without "model/")


def adapters_to_export(
    index: dict[str, Any], where: Any, adapter_config: str | Path | None, prefix: str, adapter_name: str | None
) -> list[AdapterExport]:
    """The adapters of a checkpoint: those of its record (``adapter_name``: only that one), or (``adapter_config``
    given) LoRA's naming rule applied to the keys under ``prefix`` for ``adapter_name`` (``"default"`` when
    ``None``), with the config read from that file."""
    if adapter_config is None:
        record = index.get(ADAPTERS)
        if record is None:
            raise CheckpointError(
                f"{where} records no peft adapters (its module held no PeftModel when it was saved). Give the"
                " adapter's config with --adapter-config (adapter_config=...) and the submodule that holds the"
                " PeftModel with --prefix."
            )
        check_adapters_record(where, record)
        if prefix and submodule_prefix(prefix) != record["prefix"]:
            raise CheckpointError(
                f"{where} records its PeftModel at {record['prefix']!r}, not under the prefix {prefix!r} given:"
                " leave --prefix out (it applies to --adapter-config)."
            )
        adapters = record["adapters"]
        if adapter_name is not None and adapter_name not in adapters:
            raise CheckpointError(f"{where} records the adapters {sorted(adapters)}, not {adapter_name!r}.")
        return [AdapterExport(name, a["config"], {peft: ours for ours, peft in a["tensors"].items()})
                for name, a in adapters.items() if adapter_name in (None, name)]
    adapter_name = adapter_name or DEFAULT_ADAPTER
    config = read_json_object(Path(adapter_config), "Adapter config")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise CheckpointError(
            f"{adapter_config} configures a {config.get('peft_type')!r} adapter; without a record in the checkpoint"
            " only LoRA's tensor names are known. Save the checkpoint with the PeftModel in the module to record"
            " any other method."
        )
    prefix = submodule_prefix(prefix)
    keys = [k.removeprefix(MODEL_PREFIX) for k in index["tensors"] if k.startswith(MODEL_PREFIX + prefix)]
    tensors = {}
    for key in keys:
        local = key[len(prefix):]
        parts = local.split(".")
        is_lora = any(p in _LORA_TENSORS for p in parts) and adapter_name in parts
        is_saved_module = "modules_to_save" in parts and adapter_name in parts
        if is_lora:
            tensors[local.replace(f".{adapter_name}", "", 1)] = key
        elif is_saved_module:
            tensors[local.replace(f"modules_to_save.{adapter_name}.", "", 1)] = key
    if not tensors:
        raise CheckpointError(
            f"No model key of {where} under the prefix {prefix!r} is a tensor of the LoRA adapter {adapter_name!r}"
            " (like '...lora_A.<adapter>.weight'). Check --prefix and --adapter-name."
        )
    config["inference_mode"] = True
    return [AdapterExport(adapter_name, config, tensors)]


def adapter_directory(output_dir: Path, name: str) -> Path:
    """Where peft keeps adapter ``name`` of a saved model: the directory itself for ``default``, else a
    subdirectory named after it."""
    return output_dir if name == DEFAULT_ADAPTER else output_dir / name


def merge_adapters(
    adapter_dir: Path, base: str | Path, output_dir: Path, dtype: torch.dtype | None, max_shard_size: int | str
) -> None:
    """Load the base model from ``base`` (a Hugging Face model directory, as the class its ``config.json`` names
    in ``architectures``), apply the default adapter written at ``adapter_dir`` with peft, merge it
    (``merge_and_unload``) and ``save_pretrained`` the result at ``output_dir``. The whole model is in memory
    once, as peft's merge needs."""
    import peft

    model_class = _base_model_class(Path(base))
    model = model_class.from_pretrained(str(base), torch_dtype=dtype or "auto", local_files_only=True)
    merged = peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(output_dir), safe_serialization=True, max_shard_size=max_shard_size)


def _base_model_class(base: Path) -> Any:
    """The transformers model class a base model's ``config.json`` names (its first ``architectures`` entry)."""
    import transformers

    config = base / "config.json"
    if not config.is_file():
        raise CheckpointError(
            f"The base model {base} is not a Hugging Face model directory (no config.json): merging needs the base"
            " weights the adapters were trained on (--base DIR)."
        )
    architectures = read_json_object(config, "Adapter config").get("architectures")
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise CheckpointError(
            f"{config} names no transformers model class in 'architectures' ({architectures!r}), so the base model"
            " cannot be built to merge the adapters into. Load it yourself and merge with peft's merge_and_unload()."
        )
    return model_class
