"""Loading a foreign checkpoint (a Lightning ``.ckpt``, a DCP directory) into a sharded model and its optimizers.

Each rank reads only the rows of each parameter and of each per-parameter optimizer tensor that its shards hold,
one tensor at a time, whatever world size or strategy wrote the checkpoint; every step ends with the ranks agreeing
on success, as loading a checkpoint directory does (``load``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.foreign.foreign import (
    ForeignCheckpoint,
    ForeignOptimizer,
    ForeignTensor,
    ParamKeys,
    check_named_groups,
    name_positions,
)
from lightning_shard.checkpoint.format import CheckpointError, check_loadable
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.load.load import LoadResult, check_model_keys, covered_keys
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.sharded_module import ShardedModule


def load_foreign_model(
    engine: ShardedModule, module: nn.Module, source: ForeignCheckpoint, strict: bool = True
) -> LoadResult:
    """Copy this rank's rows of every parameter and every buffer from ``source`` into ``module``. Collective."""
    available = covered_keys(engine, set(source.model) | set(source.ties))
    result = check_model_keys(module, available, strict, str(source.where))
    rows = agree(lambda: _model_rows(engine, module, source))
    with torch.no_grad():  # once every rank has read everything (see [Note: a failed load changes nothing])
        for target, value in rows:
            target.copy_(value.reshape(target.shape))
    engine.mark_initialized(available)  # see [Note: parameters nothing initialises]
    return result


def _model_rows(engine: ShardedModule, module: nn.Module, source: ForeignCheckpoint) -> list[tuple[Tensor, Tensor]]:
    """This rank's rows of every parameter and buffer ``source`` holds, read (nothing of the model is written yet),
    each with the tensor of the model it goes to."""
    stored = {**{alias: source.model[key] for alias, key in source.ties.items() if key in source.model},
              **source.model}
    plan = [(key, p) for p in engine.sharded_params() if (key := next((f for f in p.fqns if f in stored), None))]
    owned = {f for p in engine.sharded_params() for f in p.fqns}
    buffers = [(k, b) for k, b in module.named_buffers(remove_duplicate=False) if k in stored and k not in owned]
    targets = [(k, p.full_shape, p.dtype) for k, p in plan] + [(k, b.shape, b.dtype) for k, b in buffers]
    problems = [m for k, shape, dtype in targets
                if (m := check_loadable(k, stored[k].shape, stored[k].dtype, shape, dtype))]
    if problems:  # before anything is read
        raise CheckpointError(f"{source.where} does not match the model's shapes: " + "; ".join(problems))
    rows = [(p.sharded, _rows_of(p, stored[key])) for key, p in plan]
    return rows + [(buffer, stored[key].read_all()) for key, buffer in buffers]


def load_foreign_optimizers(
    engine: ShardedModule, optimizers: Sequence[Optimizer], source: ForeignCheckpoint, strict: bool = True
) -> None:
    """Load every optimizer's state from ``source``, this rank's rows of its per-parameter tensors. Collective.

    A position-keyed state (torch's ``optimizer.state_dict()``) is mapped to parameters as [Note: position-keyed
    optimizer state] says; a name-keyed one by name. With ``strict=False``, parameters the checkpoint does not know
    start with fresh state."""
    if len(source.optimizers) != len(optimizers):
        raise CheckpointError(
            f"{source.where} holds {len(source.optimizers)} optimizer states; the model has {len(optimizers)}."
        )
    states = agree(lambda: [
        _optimizer_state(engine, optimizer, saved, f"Optimizer {i} of {source.where}", strict)
        for i, (optimizer, saved) in enumerate(zip(optimizers, source.optimizers))
    ])
    for optimizer, state in zip(optimizers, states):
        optimizer.load_state_dict(state)


def _optimizer_state(
    engine: ShardedModule, optimizer: Optimizer, saved: ForeignOptimizer, what: str, strict: bool
) -> dict[str, Any]:
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    unknown = [q for g in optimizer.param_groups for q in g["params"] if id(q) not in by_shard]
    if unknown:
        raise CheckpointError(f"{what}: the optimizer holds {len(unknown)} tensors that are not sharded parameters.")
    groups = [[by_shard[id(q)].fqn for q in g["params"]] for g in optimizer.param_groups]
    if saved.keys is ParamKeys.POSITION:
        module_order = [by_shard[id(q)].fqn for q in engine.root.parameters() if id(q) in by_shard]
        names: dict[Any, str] = name_positions([g["params"] for g in saved.param_groups], groups, module_order, what)
    else:  # a tied parameter may be stored under any of its names
        alias = {f: p.fqn for p in engine.sharded_params() for f in p.fqns}
        check_named_groups([[alias.get(n, n) for n in g["params"]] for g in saved.param_groups], groups, what, strict)
        in_groups = {n for g in groups for n in g}
        names = {f: name for f, name in alias.items() if name in in_groups}
    position = {name: j for j, name in enumerate(n for g in groups for n in g)}
    sharded = {p.fqn: p for p in engine.sharded_params()}
    state: dict[int, dict[str, Any]] = {}
    for key, values in saved.state.items():
        if key not in names:
            if strict:
                raise CheckpointError(f"{what} holds state for {key!r}, which is not in the optimizer's groups.")
            continue
        p = sharded[names[key]]
        state[position[p.fqn]] = {name: _value_for(p, name, v, optimizer, what) for name, v in values.items()}
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [position[n] for n in current]}
                    for g, current in zip(saved.param_groups, groups)]
    return {"state": state, "param_groups": param_groups}


def _value_for(p: ShardedParam, name: str, value: Any, optimizer: Optimizer, what: str) -> Any:
    """This rank's part of one state value of parameter ``p``: the rows its shard holds of a tensor shaped like the
    parameter, the whole of anything else (``step``)."""
    if not isinstance(value, ForeignTensor):
        return value
    shape = tuple(p.full_shape)
    if value.shape and value.shape != shape:
        raise CheckpointError(
            f"{what}: the state {name!r} of {p.fqn} has shape {list(value.shape)}, the parameter {list(shape)}; a"
            " sharded optimizer holds per-parameter state shaped like its parameter (or scalars)."
        )
    if value.shape or (not shape and name in per_element_states(optimizer)):
        return _rows_of(p, value).reshape(p.sharded.shape)
    return value.read_all()


def _rows_of(p: ShardedParam, stored: ForeignTensor) -> Tensor:
    """This rank's rows of ``stored`` for ``p`` (of them its columns, for a tensor-parallel block of dim 1)."""
    start, stop, columns = p.rows_in_full()
    rows = stored.read(start, stop)
    return rows if columns is None else rows[:, columns[0] : columns[1]].contiguous()


def per_element_states(optimizer: Optimizer) -> set[str]:
    """The names of the state an optimizer of this class keeps per element of a parameter (``exp_avg``), as opposed
    to per parameter (``step``). Needed only for 0-dim parameters, where both are 0-dim: learned from one step of a
    fresh optimizer of the same class on a two-element probe."""
    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.zeros(2)
    try:
        accepted = inspect.signature(type(optimizer)).parameters
        takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
        options = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}  # defaults may hold more
        trial = type(optimizer)([probe], **options)
        trial.step()
    except Exception as err:  # noqa: BLE001 - an optimizer class that cannot be probed: say so
        raise CheckpointError(
            f"Cannot tell which state of {type(optimizer).__name__} is per element for a 0-dim parameter"
            f" ({type(err).__name__}: {err})."
        ) from None
    return {k for k, v in trial.state[probe].items() if isinstance(v, Tensor) and v.shape == probe.shape}
