"""Loading a checkpoint directory (or a plain ``.safetensors`` model file) into a sharded model.

Each rank reads only the rows of each tensor that its shards hold, whatever world size, mesh,
sharding strategy or wrap policy wrote the checkpoint. Every load step ends with the ranks agreeing
on success, so a damaged file stops all ranks with the same error instead of leaving some waiting.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.agreement import agree
from lightning_shard.checkpoint.format import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    TRAINER_STATE_JSON,
    TRAINER_STATE_TENSORS,
    CheckpointError,
    from_json_tree,
    iter_index_tensors,
    model_ties,
    read_index,
    read_rows,
)
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of


@dataclass(frozen=True)
class ShardedCheckpointSource:
    """Stands for the model or optimizer tensors of a checkpoint directory in Lightning's checkpoint dict; the
    strategy reads them from disk into the shards when Lightning asks it to load them."""

    directory: Path
    index: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class LoadResult:
    """Keys the model expected but the checkpoint lacks, and keys the checkpoint has but the model does not."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_trainer_state(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict without model and optimizer tensors, and the index. Never unpickles."""
    from safetensors.torch import load_file

    index = read_index(directory)
    try:
        state_json = json.loads((directory / TRAINER_STATE_JSON).read_text())
        tensors = load_file(str(directory / TRAINER_STATE_TENSORS))
    except Exception as err:  # noqa: BLE001 - a damaged file: name it
        raise CheckpointError(f"Cannot read the trainer state in {directory}: {err}") from None
    return from_json_tree(state_json, tensors), index


def load_model(
    engine: ShardedModule, module: nn.Module, directory: Path, index: dict[str, Any], strict: bool = True
) -> LoadResult:
    """Copy this rank's rows of every parameter (and every buffer) from the checkpoint into ``module``. Collective."""
    stored = {key for key, _ in iter_index_tensors(index, MODEL_PREFIX)}
    ties = model_ties(index)
    available = stored | set(ties)
    for p in engine.sharded_params():  # a tied weight stored under any one of its names covers them all
        if any(f in available for f in p.fqns):
            available |= set(p.fqns)
    result = _key_check(module, available, strict)
    agree(lambda: _load_model_rows(engine, module, directory, index, ties))
    return result


def _key_check(module: nn.Module, available: set[str], strict: bool) -> LoadResult:
    expected = set(module.state_dict().keys())
    result = LoadResult(sorted(expected - available), sorted(available - expected))
    if strict and (result.missing_keys or result.unexpected_keys):
        raise CheckpointError(
            f"The checkpoint does not match the model: missing keys {result.missing_keys}, unexpected keys"
            f" {result.unexpected_keys}. Set LightningModule.strict_loading = False to load the keys that match."
        )
    return result


def _load_model_rows(
    engine: ShardedModule, module: nn.Module, directory: Path, index: dict[str, Any], ties: dict[str, str]
) -> None:
    entries = dict(iter_index_tensors(index, MODEL_PREFIX))
    mismatched, plan = [], []
    for p in engine.sharded_params():
        key = next((ties.get(f, f) for f in p.fqns if ties.get(f, f) in entries), None)
        if key is None:
            continue
        if tuple(entries[key]["shape"]) != tuple(p.global_shape):
            mismatched.append(f"{key}: checkpoint {tuple(entries[key]['shape'])}, model {tuple(p.global_shape)}")
        plan.append((key, p))
    owned = {f for p in engine.sharded_params() for f in p.fqns}
    buffers = [(k, b) for k, b in module.named_buffers(remove_duplicate=False) if k in entries and k not in owned]
    for key, buf in buffers:
        if tuple(entries[key]["shape"]) != tuple(buf.shape):
            mismatched.append(f"{key}: checkpoint {tuple(entries[key]['shape'])}, model {tuple(buf.shape)}")
    if mismatched:
        raise CheckpointError("Checkpoint tensors do not match the model's shapes: " + "; ".join(mismatched))
    with torch.no_grad():
        for key, p in plan:  # read everything first would double memory; a failure stops all ranks via agree()
            rows = read_rows(directory, entries[key], p.first_row, p.first_row + p.local_rows)
            p.sharded.copy_(rows.reshape(p.sharded.shape))
        for key, buf in buffers:
            buf.copy_(read_rows(directory, entries[key], 0, entries[key]["shape"][0] if entries[key]["shape"] else 1))


def load_optimizers(
    engine: ShardedModule, optimizers: Sequence[Optimizer], directory: Path, index: dict[str, Any], strict: bool = True
) -> None:
    """Load every optimizer's state (this rank's rows of per-parameter tensors) from the checkpoint. Collective.

    With ``strict=False``, parameters the checkpoint does not know start with fresh optimizer state.
    """
    saved = index.get("optimizers", [])
    if len(saved) != len(optimizers):
        raise CheckpointError(f"The checkpoint holds {len(saved)} optimizer states; the model has {len(optimizers)}.")
    states = agree(lambda: [_optimizer_state(engine, opt, i, meta, directory, index, strict)
                            for i, (opt, meta) in enumerate(zip(optimizers, saved))])
    for optimizer, state in zip(optimizers, states):
        optimizer.load_state_dict(state)


def _optimizer_state(
    engine: ShardedModule,
    optimizer: Optimizer,
    i: int,
    meta: dict[str, Any],
    directory: Path,
    index: dict[str, Any],
    strict: bool,
) -> dict[str, Any]:
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    current = [[by_shard[id(q)].fqn for q in group["params"]] for group in optimizer.param_groups]
    position = {name: j for j, name in enumerate(n for group in current for n in group)}
    stored = [group["params"] for group in meta["param_groups"]]
    if [sorted(g) for g in current] != [sorted(g) for g in stored] and (strict or len(stored) != len(current)):
        raise CheckpointError(
            f"Optimizer {i} in the checkpoint has parameter groups {stored}, the model's optimizer has {current}."
        )
    groups = []
    for group, names_in_group in zip(meta["param_groups"], current):
        options = from_json_tree(group["options"], {})
        groups.append({**options, "params": [position[n] for n in names_in_group]})
    state: dict[int, dict[str, Any]] = {}
    sharded = {p.fqn: p for p in engine.sharded_params()}
    for key, entry in iter_index_tensors(index, f"{OPTIMIZER_PREFIX}{i}/"):
        fqn, name = key.rsplit("/", 1)
        if fqn not in position:  # strict=False: the model no longer has this parameter
            continue
        p = sharded[fqn]
        if entry["shape"] and tuple(entry["shape"]) == tuple(p.global_shape):
            value = read_rows(directory, entry, p.first_row, p.first_row + p.local_rows).reshape(p.sharded.shape)
        else:
            value = read_rows(directory, entry, 0, entry["shape"][0] if entry["shape"] else 1)
        state.setdefault(position[fqn], {})[name] = value  # load_state_dict() moves it as the optimizer wants
    for fqn, values in meta.get("values", {}).items():
        if fqn in position:
            state.setdefault(position[fqn], {}).update({k: from_json_tree(v, {}) for k, v in values.items()})

    return {"state": state, "param_groups": groups}




# --------------------------------------------------------------------------------------------------
# A plain model file
# --------------------------------------------------------------------------------------------------


def load_safetensors_into(
    module: nn.Module,
    path: str | Path,
    prefix: str = "",
    strict: bool = True,
    rename: Callable[[str], str] | None = None,
) -> LoadResult:
    """Load a full ``.safetensors`` model file (a consolidated checkpoint, a Hugging Face model file) into a model
    that ``ShardStrategy`` has sharded; each rank reads only its rows. ``prefix`` is prepended to the file's keys
    to match the module's ``state_dict`` keys (e.g. ``"model."`` when the LightningModule holds the network as
    ``self.model``), after ``rename`` (if given) maps each file key. Returns the missing and unexpected keys.
    Collective: every rank must call it, e.g. in ``on_fit_start``."""
    from safetensors import safe_open

    engine = sharded_module_of(module)
    if engine is None:
        raise CheckpointError(
            "load_safetensors_into() needs the model ShardStrategy has sharded (the LightningModule after the"
            " Trainer set it up, e.g. from on_fit_start); this module is not sharded."
        )

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            shapes = {k: list(f.get_slice(k).get_shape()) for k in keys}
            dtypes = {k: str(f.get_slice(k).get_dtype()) for k in keys}
    except Exception as err:  # noqa: BLE001 - a damaged or missing file: name it
        raise CheckpointError(f"Cannot read the safetensors file {path}: {err}") from None
    from lightning_shard.checkpoint.format import dtype_name

    index: dict[str, Any] = {"tensors": {}}
    for key in keys:
        dtype = _SAFETENSORS_TO_TORCH.get(dtypes[key])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {dtypes[key]}.")
        index["tensors"][MODEL_PREFIX + prefix + (rename(key) if rename else key)] = {
            "shape": shapes[key], "dtype": dtype_name(dtype),
            "pieces": [{"file": path.name, "key": key, "rows": [0, shapes[key][0] if shapes[key] else 1]}],
        }
    return load_model(engine, module, path.parent, index, strict=strict)


_SAFETENSORS_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
