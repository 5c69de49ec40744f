"""Full (consolidated) model and optimizer state for Lightning's ``torch.save`` checkpoints.

Saving gathers every sharded tensor into its full shape under the LightningModule's own
``state_dict`` keys, so a checkpoint looks exactly like one from DDP and loads at any world size
or sharding strategy; loading keeps only this rank's rows. Optimizer state is keyed as
``Optimizer.state_dict()`` keys it (by parameter index), with per-parameter tensors in full shape
``(rows, *row_shape)`` (a 0-dim parameter's state as ``(1,)``).
Each rank assembles the full state (one tensor at a time is gathered); rank 0 writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.engine import ShardedModule
from lightning_shard.param_shard import ShardedParam


def full_model_state_dict(engine: ShardedModule, module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every sharded parameter replaced by its full tensor (on CPU). Collective."""
    by_name = {fqn: p for p in engine.sharded_params() for fqn in p.fqns}
    state = module.state_dict()
    for key in state:
        p = by_name.get(key)
        if p is not None:
            state[key] = engine.gather_full(p, p.sharded).cpu()
    return state


def load_full_model_state_dict(
    engine: ShardedModule, module: nn.Module, state: Mapping[str, Any], strict: bool = True
) -> None:
    """Load a full state dict (as saved by DDP or by ``full_model_state_dict``) into the shards."""
    by_name = {fqn: p for p in engine.sharded_params() for fqn in p.fqns}
    expected = set(module.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Checkpoint does not match the model: missing keys {missing}, unexpected keys {unexpected}."
            " Pass strict=False (LightningModule.strict_loading = False) to load the keys that match."
        )
    buffers = dict(module.named_buffers(remove_duplicate=False))
    mismatched = []
    for key, value in state.items():
        if key in by_name:
            p = by_name[key]
            if tuple(value.shape) != tuple(p.global_shape):
                mismatched.append(f"{key}: checkpoint {tuple(value.shape)}, model {tuple(p.global_shape)}")
                continue
            p.copy_rows_from_full(value.to(p.sharded.device))
        elif key in buffers:
            with torch.no_grad():
                buffers[key].copy_(value)
    if mismatched:
        raise RuntimeError("Checkpoint tensors do not match the model's shapes: " + "; ".join(mismatched))


def full_optimizer_state_dict(engine: ShardedModule, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with per-parameter state tensors gathered to full shape. Collective."""
    shards = _shards_by_index(engine, optimizer)
    state = optimizer.state_dict()  # its per-parameter dicts are the live ones: build new ones
    state["state"] = {
        index: {name: _gathered(engine, shards.get(index), value) for name, value in param_state.items()}
        for index, param_state in state["state"].items()
    }
    return state


def _gathered(engine: ShardedModule, p: ShardedParam | None, value: Any) -> Any:
    if p is None or not isinstance(value, Tensor) or value.dim() == 0 or value.shape != p.sharded.shape:
        return value
    return engine.gather_full(p, value).reshape(p.rows, *p.row_shape).cpu()


def load_full_optimizer_state_dict(engine: ShardedModule, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    """Load a state dict from ``full_optimizer_state_dict`` (any world size) into a sharded optimizer."""
    shards = _shards_by_index(engine, optimizer)
    sharded_state: dict[int, dict[str, Any]] = {}
    for index, param_state in state["state"].items():
        p = shards.get(int(index))
        sharded_state[index] = {
            name: _local_rows(p, value) if p is not None and _is_full_tensor(p, value) else value
            for name, value in param_state.items()
        }
    optimizer.load_state_dict({"state": sharded_state, "param_groups": state["param_groups"]})


def _shards_by_index(engine: ShardedModule, optimizer: Optimizer) -> dict[int, ShardedParam]:
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    params = [q for group in optimizer.param_groups for q in group["params"]]
    return {i: by_shard[id(q)] for i, q in enumerate(params) if id(q) in by_shard}


def _is_full_tensor(p: ShardedParam, value: Any) -> bool:
    """Per-parameter state is saved as ``(rows, *row_shape)``: a 0-dim parameter's as ``(1,)``, unlike a scalar step."""
    return isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) == (p.rows, *p.row_shape)


def _local_rows(p: ShardedParam, full: Tensor) -> Tensor:
    rows = full.reshape(p.rows, *p.row_shape)[p.first_row : p.first_row + p.local_rows]
    return rows.to(p.sharded.device).clone().reshape(p.sharded.shape)
