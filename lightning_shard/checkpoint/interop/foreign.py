"""What a checkpoint in another format holds, as its readers (``lightning_ckpt``, ``dcp``, ``gguf``) describe it:
model tensors and optimizer state that can be read a few rows at a time, and the rest of Lightning's checkpoint dict;
and loading it into a sharded model and its optimizers.

The loader (``load_foreign_model``, ``load_foreign_optimizers``) and the converter (``checkpoint/convert.py``) work on
this description only, so neither knows whether the rows come from a memory-mapped ``.ckpt``, the chunks of a DCP
directory or a GGUF file. Each rank reads only the rows of each parameter and of each per-parameter optimizer tensor
that its shards hold, one tensor at a time, whatever world size or strategy wrote the checkpoint; every step ends with
the ranks agreeing on success, as loading a checkpoint directory does.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.load.directory import (
    LoadResult,
    check_model_keys,
    check_named_groups,
    covered_keys,
    model_targets,
    optimizer_groups,
)
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.sharded_module import ShardedModule


@dataclass(frozen=True)
class ForeignTensor:
    """A tensor of a foreign checkpoint: its global shape and dtype, and how to read rows ``[start, stop)`` of dim 0
    (a 0-dim tensor is one row: ``read(0, 1)`` gives it whole, shape ``()``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[int, int], Tensor] = field(repr=False, compare=False)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def read_all(self) -> Tensor:
        return self.read(0, self.rows)


class ParamKeys(enum.Enum):
    """How a foreign optimizer state names the parameters it holds state for."""

    POSITION = "position"  # torch's optimizer.state_dict(): integers (DDP, single device, FSDPStrategy "full")
    NAME = "name"  # parameter names (torch.distributed.checkpoint's get_optimizer_state_dict: FSDP2, DCP)


@dataclass
class ForeignOptimizer:
    """One optimizer's state: ``param_groups`` as stored (options plus ``"params"``, a list of parameter keys) and,
    per parameter key, its state values (``ForeignTensor`` for tensors, anything plain otherwise)."""

    keys: ParamKeys
    param_groups: list[dict[str, Any]]
    state: dict[int | str, dict[str, ForeignTensor | Any]]


@dataclass
class ForeignCheckpoint:
    """A checkpoint written by another strategy, as read by one of the foreign readers.

    ``model`` maps the LightningModule's ``state_dict`` keys to their tensors; ``ties`` maps a key stored as the
    same tensor as another (tied weights) to that key; ``values`` is Lightning's checkpoint dict without the model
    and optimizer entries (loops, callbacks, schedulers, hyperparameters; a Fabric checkpoint's own values)."""

    path: Path
    kind: str  # what it is, for messages: "the Lightning checkpoint file", "the DCP directory"
    model: dict[str, ForeignTensor]
    optimizers: list[ForeignOptimizer]
    values: dict[str, Any]
    ties: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.kind} {self.path}"


# --------------------------------------------------------------------------------------------------
# Naming the parameters of a position-keyed optimizer state
# --------------------------------------------------------------------------------------------------
#
# [Note: position-keyed optimizer state]
# torch's ``optimizer.state_dict()`` keys the state by integers, not names. What an integer means depends on the
# writer: DDP and single-device training save ``optimizer.state_dict()``, whose integers count the parameters in
# the order of the optimizer's parameter groups (0, 1, 2, ... across the groups); FSDPStrategy with
# state_dict_type="full" and ModelParallelStrategy without distributed checkpoints rekey FSDP's state with
# ``FSDP.rekey_optim_state_dict(..., PARAM_ID, model)``, whose integers count ``model.parameters()`` (the module's
# order, frozen parameters included), each group listing its integers sorted. The two conventions are told apart by
# the groups themselves: the first gives consecutive runs in group order, the second the module positions of each
# group's parameters, sorted. Both are computed from the live optimizer's groups and the module; a checkpoint that
# fits neither is refused, and one that fits both but would place the state differently (possible only when a
# group lists a run of parameters out of module order) is refused too rather than guessed.


def name_positions(
    stored_groups: Sequence[Sequence[Any]], groups: Sequence[Sequence[str]], module_order: Sequence[str], what: str
) -> dict[int, str]:
    """The parameter name of each integer key of a position-keyed optimizer state (see [Note: position-keyed
    optimizer state]). ``stored_groups``: each stored group's ``"params"``; ``groups``: the names in each group of
    the optimizer being loaded, in its order; ``module_order``: the module's parameter names, in
    ``parameters()`` order (frozen ones included)."""
    stored = [list(g) for g in stored_groups]
    if len(stored) != len(groups) or any(len(s) != len(g) for s, g in zip(stored, groups)):
        raise CheckpointError(
            f"{what}: the checkpoint's parameter groups hold {[len(g) for g in stored]} parameters, the optimizer's"
            f" {[len(g) for g in groups]}. Build the optimizer as the run that wrote the checkpoint did."
        )
    by_optimizer_order: dict[int, str] = {}
    for name in (n for g in groups for n in g):
        by_optimizer_order[len(by_optimizer_order)] = name
    position = {name: i for i, name in enumerate(module_order)}
    runs = [list(range(sum(map(len, groups[:i])), sum(map(len, groups[: i + 1])))) for i in range(len(groups))]
    sorted_positions = [sorted(position[n] for n in g) for g in groups]
    by_module_order = {position[n]: n for g in groups for n in g}
    fits_optimizer_order = stored == runs
    fits_module_order = stored == sorted_positions
    if fits_optimizer_order and fits_module_order and by_optimizer_order != by_module_order:
        raise CheckpointError(
            f"{what}: its state is keyed by position and fits both the optimizer's order (as DDP saves it) and the"
            " module's (as FSDPStrategy's full state dict saves it), which place it differently because a parameter"
            " group lists parameters out of the module's order. List each group's parameters in module order"
            " (e.g. filtered from named_parameters()) and save again, or load the model weights only."
        )
    if fits_optimizer_order:
        return by_optimizer_order
    if fits_module_order:
        return by_module_order
    raise CheckpointError(
        f"{what}: its state is keyed by position, but its groups {stored} are neither the optimizer's order"
        f" {runs} (as DDP saves it) nor the module's {sorted_positions} (as FSDPStrategy's full state dict saves"
        " it). Build the optimizer's parameter groups as the run that wrote the checkpoint did."
    )


# --------------------------------------------------------------------------------------------------
# Loading into a sharded model
# --------------------------------------------------------------------------------------------------


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
    plan, buffers, problems = model_targets(engine, module, source.model, source.ties)
    if problems:  # before anything is read
        raise CheckpointError(f"{source.where} does not match the model's shapes: " + "; ".join(problems))
    rows = [(p.sharded, _rows_of(p, source.model[key])) for key, p in plan]
    return rows + [(buffer, source.model[key].read_all()) for key, buffer in buffers]


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
    groups, position = optimizer_groups(engine, optimizer, what)
    if saved.keys is ParamKeys.POSITION:
        by_shard = {id(p.sharded): p for p in engine.sharded_params()}
        module_order = [by_shard[id(q)].fqn for q in engine.root.parameters() if id(q) in by_shard]
        names: dict[Any, str] = name_positions([g["params"] for g in saved.param_groups], groups, module_order, what)
    else:  # a tied parameter may be stored under any of its names
        alias = {f: p.fqn for p in engine.sharded_params() for f in p.fqns}
        check_named_groups([[alias.get(n, n) for n in g["params"]] for g in saved.param_groups], groups, what, strict)
        in_groups = {n for g in groups for n in g}
        names = {f: name for f, name in alias.items() if name in in_groups}
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
