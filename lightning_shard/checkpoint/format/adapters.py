"""peft adapters in checkpoints: the record a save makes of them in the index (exported by ``interop/peft.py``).

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
from typing import Any

from torch import nn

from lightning_shard.checkpoint.format import CheckpointError

ADAPTERS = "adapters"  # the index's record (see [Note: adapters recorded at save time])


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
