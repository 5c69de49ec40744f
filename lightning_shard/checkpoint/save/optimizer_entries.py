"""The optimizers' part of a save: each optimizer's JSON metadata for the index and the tensors it writes, which
are split by rows like their parameter, stored once (0-dim or another shape), or kept as JSON values."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import OPTIMIZER_PREFIX, CheckpointError
from lightning_shard.checkpoint.io.index import optimizer_entry
from lightning_shard.engine.sharded_module import ShardedModule
from lightning_shard.engine.whole_tensor_step import row_state_keys


def optimizer_entries(
    engine: ShardedModule, optimizer: Optimizer, i: int, kept: set[str]
) -> tuple[dict[str, Any], list[Any]]:
    """JSON metadata of optimizer ``i`` and its tensors as (key, ShardedParam or None, tensor), holding the state of
    the parameters named in ``kept`` only (see [Note: weights a checkpoint leaves out])."""
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    shapes = {k: (p.fqn, p.sharded.shape, p.global_shape) for k, p in by_shard.items()}
    meta, tensors = optimizer_plan(optimizer, i, shapes)
    prefix = f"{OPTIMIZER_PREFIX}{i}/"
    tensors = [t for t in tensors if t[0].removeprefix(prefix).rsplit("/", 1)[0] in kept]
    meta["values"] = {fqn: v for fqn, v in meta["values"].items() if fqn in kept}
    for entry in ("scalar_param_states", "whole_param_states"):
        if entry in meta:
            meta[entry] = {fqn: v for fqn, v in meta[entry].items() if fqn in kept}
    return meta, [(name, by_shard[pid] if pid is not None else None, value) for name, pid, value in tensors]


def optimizer_plan(
    optimizer: Optimizer, i: int, params: dict[int, tuple[str, torch.Size, torch.Size]]
) -> tuple[dict[str, Any], list[tuple[str, int | None, Tensor]]]:
    """JSON metadata of optimizer ``i`` and its tensors as (key, id of the parameter whose rows it is split like, or
    ``None`` for scalar state, tensor). ``params``: id of each parameter the optimizer may hold -> (name, the shape
    this rank holds, the global shape)."""
    state = optimizer.state_dict()
    told = row_state_keys(optimizer)  # a whole-tensor optimizer's split, the same on every rank
    held = [q for group in optimizer.param_groups for q in group["params"]]
    missing = [j for j, q in enumerate(held) if id(q) not in params]
    if missing:
        raise CheckpointError(f"Optimizer {i} holds tensors that are not parameters of the sharded model: {missing}.")
    names = [params[id(q)][0] for q in held]
    groups = [([names[j] for j in group["params"]], {k: v for k, v in group.items() if k != "params"})
              for group in state["param_groups"]]
    values: dict[str, dict[str, Any]] = {}
    row_states: dict[str, list[str]] = {}  # 0-dim parameters' states split by rows like them (see the format doc)
    whole_states: dict[str, list[str]] = {}  # states of another shape (Adafactor's row and column statistics)
    tensors: list[Any] = []
    # In parameter and key order, not in the order the optimizer created its state, which may differ between ranks:
    # each rank's pieces are written and gathered in this order.
    for j, param_state in sorted(state["state"].items()):
        fqn, local_shape, global_shape = params[id(held[j])]
        for key, value in sorted(param_state.items()):
            if isinstance(value, Tensor):
                sharded = value.dim() > 0 and value.shape == local_shape
                if told is not None and id(held[j]) in told:
                    sharded = key in told[id(held[j])]
                tensors.append((f"{OPTIMIZER_PREFIX}{i}/{fqn}/{key}", id(held[j]) if sharded else None, value))
                if sharded and not global_shape:
                    row_states.setdefault(fqn, []).append(key)
                elif not sharded and value.dim() > 0:  # the same on every rank, stored once
                    whole_states.setdefault(fqn, []).append(key)
            else:
                values.setdefault(fqn, {})[key] = value
    return optimizer_entry(i, groups, values, row_states, whole_states), tensors
