"""``fabric.save`` / ``fabric.load`` with ``ShardStrategy``: Fabric's state dict mapped onto checkpoint directories.

[Note: Fabric state in a checkpoint directory]
Fabric hands the strategy a dict of live objects, e.g. ``{"model": model, "optimizer": optimizer, "step": 7}``.
The sharded module's tensors are written as the directory's model tensors and the optimizers' state as its
optimizers, in the dict's order; everything else (plain values, tensors, the ``state_dict()`` of other stateful
objects) goes into the trainer state, as a Trainer checkpoint stores its loop counters. The dict keys that held
the module and the optimizers are recorded under ``FABRIC_OBJECTS``, so that loading knows them. The layout is
the one the Trainer writes: a Fabric checkpoint's model and optimizers load into the Trainer and the reverse,
whenever the module's parameter names match (the same module class, e.g. the LightningModule set up in Fabric).
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import INDEX_FILE, CheckpointError
from lightning_shard.checkpoint.interop.gguf import is_gguf, load_gguf_into
from lightning_shard.checkpoint.interop.hf import load_safetensors_into
from lightning_shard.checkpoint.interop.safe_pickle import is_pickle, load_restricted
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.io.index import read_index
from lightning_shard.checkpoint.io.selection import KeyFilter, ModelSelection
from lightning_shard.checkpoint.io.storage import Location
from lightning_shard.checkpoint.load.directory import full_model_state, load_model
from lightning_shard.checkpoint.open import detect
from lightning_shard.checkpoint.save.background import BackgroundSaver
from lightning_shard.checkpoint.state import TRAINER_PLACEHOLDERS, load_checkpoint, save_checkpoint
from lightning_shard.common.checkpoint import FABRIC_OBJECTS
from lightning_shard.engine.option_choices import SavedParameters, StateDictType
from lightning_shard.engine.sharded_module import sharded_module_of


def save_fabric_state(
    path: Location,
    state: Mapping[str, Any],
    layout: StateDictType,
    saver: BackgroundSaver | None = None,
    selection: ModelSelection | None = None,
    filter: Mapping[str, KeyFilter] | None = None,
) -> None:
    """Write Fabric's ``state`` (live module, optimizers, plain values) as a checkpoint directory, in the background
    with a ``saver``; the module's tensors as ``selection`` keeps them (``fabric_model_selection``), dict values
    through their ``filter`` entries as Fabric filters them. Collective."""
    module_key, module = _sharded_module(state, "fabric.save")
    optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
    values: dict[str, Any] = {}
    for key, value in state.items():
        if key == module_key or key in optimizer_keys:
            continue
        if key == FABRIC_OBJECTS or key in TRAINER_PLACEHOLDERS:
            raise ValueError(f"fabric.save: the state key {key!r} is reserved by the checkpoint format; rename it.")
        value = value.state_dict() if isinstance(value, (_Stateful, nn.Module)) else value
        if filter and key in filter and isinstance(value, dict):  # as Fabric's own filter treats a dict
            value = {k: v for k, v in value.items() if filter[key](k, v)}
        values[key] = value
    values[FABRIC_OBJECTS] = {"module": module_key, "optimizers": optimizer_keys}
    save_checkpoint(path, module, [state[k] for k in optimizer_keys], values, layout, saver, selection=selection)


def fabric_model_selection(
    state: Mapping[str, Any], filter: Mapping[str, KeyFilter] | None, parameters: SavedParameters
) -> ModelSelection:
    """What ``fabric.save(path, state, filter=...)`` keeps of the sharded module: its ``filter`` entry and the
    strategy's ``save_trainable_only``. A filter entry that names no key of ``state``, or an optimizer (whose state
    follows the module's parameters), or a value that is not a dict, is refused: it would filter nothing."""
    if filter is None:
        return ModelSelection(parameters)
    if not isinstance(filter, Mapping):
        raise TypeError(f"fabric.save: filter must map state keys to callables, got {type(filter).__name__}.")
    module_key, _ = _sharded_module(state, "fabric.save")
    for key, predicate in filter.items():
        if key not in state:
            raise KeyError(f"fabric.save: filter names {key!r}, which the state does not hold ({sorted(state)}).")
        if isinstance(state[key], Optimizer):
            raise ValueError(
                f"fabric.save: filter[{key!r}] names an optimizer. With ShardStrategy the optimizer state saved is"
                " that of the module's parameters the module's filter keeps; filter the module instead."
            )
        value = state[key]
        if key != module_key and not isinstance(value, (dict, _Stateful, nn.Module)):
            raise ValueError(
                f"fabric.save: filter[{key!r}] applies to a dict; state[{key!r}] is a {type(value).__name__}."
            )
        if not callable(predicate):
            raise TypeError(f"fabric.save: filter[{key!r}] must be a callable (key, value) -> bool.")
    return ModelSelection(parameters, filter.get(module_key))


def load_fabric_state(path: Location, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Fill ``state``'s module, optimizers and values in place from the checkpoint at ``path`` (a checkpoint
    directory, or what another strategy's ``fabric.save`` or Trainer wrote:
    ``lightning_shard.checkpoint.open``); return what the checkpoint holds that ``state`` did not ask for.
    Collective. A local ``path`` that holds no checkpoint is refused first, as Lightning's strategies refuse it."""
    if isinstance(path, Path):
        agree(lambda: detect(path))
    module_key, module = _sharded_module(state, "fabric.load")
    optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
    optimizers = [state[k] for k in optimizer_keys]
    wanted = [k for k, v in state.items() if not isinstance(v, Optimizer) and v is not module]
    saved, _ = load_checkpoint(path, module, optimizers, strict=strict, module_key=module_key,
                               optimizer_keys=optimizer_keys)
    saved.pop(FABRIC_OBJECTS, None)
    missing = [k for k in wanted if k not in saved]
    if strict and missing:
        raise KeyError(
            f"fabric.load: the checkpoint {path} has no entries {missing}; it holds {sorted(saved)}."
            " Pass strict=False to load what is there."
        )
    for key in wanted:
        if key not in saved:
            continue
        target = state[key]
        if isinstance(target, (_Stateful, nn.Module)):
            target.load_state_dict(saved.pop(key))
        else:
            state[key] = saved.pop(key)
    return saved


def load_raw_into(path: Location, module: nn.Module, strict: bool) -> None:
    """``fabric.load_raw``: a plain ``.safetensors`` model file, a ``torch.save`` state dict (``.pt``/``.pth``, read
    with the restricted reader: tensors and plain containers only), a GPT-2 or Llama GGUF file (``load_gguf_into``:
    the module is the Hugging Face model itself), or the model of a checkpoint directory. A module
    set up with ``fabric.setup_module()`` takes this rank's rows (collective); a module never set up loads the whole
    state with ``load_state_dict``, as under ``FSDPStrategy``."""
    engine = sharded_module_of(module)
    if isinstance(path, Path) and path.is_file() and is_pickle(path):
        module.load_state_dict(agree(lambda: _raw_state_dict(path)), strict=strict)
    elif not isinstance(path, Path) or path.is_dir():  # a URL is read as a checkpoint directory
        index = agree(lambda: _checkpoint_index(path))
        if engine is None:
            module.load_state_dict(agree(lambda: full_model_state(path, index)), strict=strict)
        else:
            load_model(engine, module, path, index, strict=strict)
    elif isinstance(path, Path) and path.is_file() and is_gguf(path):
        load_gguf_into(module, path, strict=strict)
    else:
        load_safetensors_into(module, path, strict=strict)


def _checkpoint_index(path: Location) -> dict[str, Any]:
    """The index of the checkpoint directory ``fabric.load_raw`` was given; a local directory that is no checkpoint
    is refused in the words of Lightning's strategies first, which read a single file only."""
    if isinstance(path, Path) and not (path / INDEX_FILE).is_file():
        raise CheckpointError(
            f"The given path must be a single file containing the full state dict: {path}. With ShardStrategy"
            f" fabric.load_raw also reads the model of a checkpoint directory, and this directory is not one (it has"
            f" no {INDEX_FILE})."
        )
    return read_index(path)


def _raw_state_dict(path: Path) -> dict[str, Any]:
    """The state dict a ``torch.save`` file holds, read without running its pickle (memory-mapped)."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is in torch.save's legacy format (_use_new_zipfile_serialization=False), whose pickle cannot be"
            " checked without running it. Re-save it in a process you trust with torch.save's default format, or as"
            " safetensors (safetensors.torch.save_file), and load that."
        )
    state = load_restricted(path, f"fabric.load_raw({str(path)!r})", mmap=True)
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(
            f"{path} holds a {type(state).__name__}, not a state dict (a mapping of names to tensors): fabric.load_raw"
            " loads a model's weights as torch.save(model.state_dict(), path) wrote them. A checkpoint with more"
            " in it loads with fabric.load(path, {'model': model})."
        )
    return dict(state)


class LoadNotSupportedError(ValueError, NotImplementedError):
    """A load ``ShardStrategy`` does not do. A ``NotImplementedError``, as Lightning's ``FSDPStrategy`` raises for
    it, and a ``ValueError``, as this strategy raised before, so that either ``except`` clause catches it."""


def optimizer_alone_error() -> LoadNotSupportedError:
    """``fabric.load_raw(path, optimizer)``: a raw file holds a model's weights, never optimizer state."""
    return LoadNotSupportedError(
        "Loading a single optimizer object from a checkpoint is not supported yet with the ShardStrategy."
        " fabric.load_raw(path, optimizer) is not supported with ShardStrategy: a raw file holds a model's weights"
        " only. Load optimizer state from a checkpoint directory together with the set-up model:"
        " fabric.load(path, {'model': model, 'optimizer': optimizer})."
    )


def _sharded_module(state: Mapping[str, Any], caller: str) -> tuple[str, nn.Module]:
    sharded = [(k, v) for k, v in state.items() if isinstance(v, nn.Module) and sharded_module_of(v) is not None]
    if len(sharded) != 1:
        found = [k for k, _ in sharded] or "none"
        doing = "Loading" if "load" in caller else "Saving"
        lightnings = (  # FSDPStrategy's words first, for code and log searches written for it
            "Could not find a FSDP model in the provided checkpoint state." if not sharded else
            f"Found multiple FSDP models in the given state. {doing} checkpoints with FSDP is currently limited to a"
            " single model per checkpoint."
        )
        raise ValueError(
            f"{lightnings} {caller} with ShardStrategy needs exactly one module set up with fabric.setup_module() in"
            f" the state (found {found}). Save or load each sharded module in a checkpoint of its own."
        )
    return sharded[0]
