"""What a checkpoint in another format holds, as its readers (``lightning_ckpt``, ``dcp``) describe it: model tensors
and optimizer state that can be read a few rows at a time, and the rest of Lightning's checkpoint dict.

The loader (``foreign_load``) and the converter (``convert``) work on this description only, so neither knows
whether the rows come from a memory-mapped ``.ckpt`` or from the chunks of a DCP directory.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shard.checkpoint.format import CheckpointError


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


def check_named_groups(
    stored_groups: Sequence[Sequence[Any]], groups: Sequence[Sequence[str]], what: str, strict: bool
) -> None:
    """A name-keyed optimizer state's groups hold the names of the optimizer's groups (with ``strict=False``, the
    same number of groups suffices: parameters the checkpoint does not know start fresh)."""
    stored = [sorted(map(str, g)) for g in stored_groups]
    if stored != [sorted(g) for g in groups] and (strict or len(stored) != len(groups)):
        raise CheckpointError(
            f"{what} has parameter groups {[list(g) for g in stored_groups]}, the model's optimizer has"
            f" {[list(g) for g in groups]}."
        )
