"""peft adapters in checkpoints: recorded at save time, exported in peft's layout or merged into a full model.

[Note: adapters recorded at save time]
When the saved module holds a ``peft.PeftModel`` (``self.model = get_peft_model(...)``), a save records
in the index, under ``"adapters"``, where it sits in the module (``prefix``) and, for each adapter, its
config (as ``PeftConfig.save_pretrained`` writes it) and which of the checkpoint's model keys are its
tensors, under the names peft stores them (``base_model.model.<layer>.lora_A.weight``: no adapter
name). peft itself chooses those keys (``get_peft_model_state_dict`` on the module's state dict, which
holds views of the shards: nothing is gathered), so every peft method and ``modules_to_save`` are
named as ``PeftModel.save_pretrained`` would name them. ``export --format peft`` then needs nothing
but the checkpoint: it writes ``adapter_model.safetensors`` and ``adapter_config.json`` for
``PeftModel.from_pretrained(base, output_dir)`` (other adapters than ``default`` in subdirectories
named after them, as peft does). A checkpoint saved without a record (a ``.ckpt`` converted, an older
save) is exported with ``--adapter-config``: LoRA's naming rule is then applied to the keys under
``--prefix``. ``--format hf`` of a checkpoint with adapters merges them into the base model with peft
(``merge_and_unload``) and writes the merged model in Hugging Face's layout.
"""

from __future__ import annotations

import enum
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError, read_json_object, submodule_prefix

ADAPTERS = "adapters"  # the index's record (see [Note: adapters recorded at save time])
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_ADAPTER = "default"
_LORA_TENSORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def peft_adapters(module: nn.Module) -> dict[str, Any] | None:
    """The record of the ``PeftModel`` inside ``module`` (see [Note: adapters recorded at save time]), or ``None``
    when it holds none (or peft was never imported: then it cannot)."""
    if "peft" not in sys.modules:
        return None
    import peft
    from peft.utils import get_peft_model_state_dict

    found = [(name, m) for name, m in module.named_modules() if isinstance(m, peft.PeftModel)]
    if not found:
        return None
    if len(found) > 1:
        raise CheckpointError(
            f"The module holds {len(found)} peft models ({', '.join(n or '<root>' for n, _ in found)}); a checkpoint"
            " records the adapters of one. Keep one PeftModel per LightningModule."
        )
    name, peft_model = found[0]
    prefix = name + "." if name else ""
    state = peft_model.state_dict()  # views of the shards and buffers: nothing is copied
    key_of = {id(value): prefix + key for key, value in state.items()}
    adapters: dict[str, Any] = {}
    for adapter, config in peft_model.peft_config.items():
        picked = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter,
                                           save_embedding_layers=False)
        tensors = {}
        for peft_key, value in picked.items():
            ours = key_of.get(id(value))
            if ours is None:
                raise CheckpointError(
                    f"peft names {peft_key!r} among adapter {adapter!r}'s tensors, but it is not a tensor of the"
                    " model's state dict, so the checkpoint cannot record it. Save the adapter with"
                    " PeftModel.save_pretrained() from the consolidated model instead."
                )
            tensors[ours] = peft_key
        adapters[adapter] = {"config": adapter_config_json(config), "tensors": tensors}
    return {"library": "peft", "version": peft.__version__, "prefix": prefix, "adapters": adapters}


def adapter_config_json(config: Any) -> dict[str, Any]:
    """A ``PeftConfig`` as ``save_pretrained`` writes it (sets as lists), marked for inference as a saved adapter is."""
    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value, key=str)
        if isinstance(value, enum.Enum):
            return value.value
        raise TypeError(f"{type(value).__name__} is not JSON")

    try:
        data = json.loads(json.dumps(config.to_dict(), default=plain))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"The adapter config {type(config).__name__} cannot be stored as JSON: {err}.") from None
    data["inference_mode"] = True
    return data


def check_adapters_record(where: Any, record: Any) -> None:
    """Refuse an ``"adapters"`` entry of an index that is not shaped as a save writes it (untrusted input)."""
    adapters = record.get("adapters") if isinstance(record, dict) else None
    ok = isinstance(adapters, dict) and isinstance(record.get("prefix"), str) and all(
        isinstance(a, dict) and isinstance(a.get("config"), dict) and isinstance(a.get("tensors"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in a["tensors"].items())
        for a in adapters.values()
    )
    if not ok:
        raise CheckpointError(
            f"{where} is damaged: its 'adapters' entry must hold a 'prefix' and, per adapter, a 'config' object and"
            " a 'tensors' map. Use another checkpoint, or save this one again."
        )


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
    config = _read_adapter_config(Path(adapter_config))
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


def _read_adapter_config(path: Path) -> dict[str, Any]:
    return read_json_object(path, "Adapter config")


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
    architectures = _read_adapter_config(config).get("architectures")
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel)):
        raise CheckpointError(
            f"{config} names no transformers model class in 'architectures' ({architectures!r}), so the base model"
            " cannot be built to merge the adapters into. Load it yourself and merge with peft's merge_and_unload()."
        )
    return model_class
