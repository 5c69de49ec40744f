"""Activation checkpointing of chosen modules, working with sharding.

The chosen modules' ``forward`` runs under non-reentrant ``torch.utils.checkpoint``: their
activations are dropped after forward and recomputed in backward. The recomputation calls the
original ``forward`` directly (not the module, so no sharding hook runs twice); by then the unit
holding the weights has been gathered again by its pre-backward hook and its modules hold the
unsharded faces (see [Note: unit states and autograd]).

[Note: PyTorch's checkpoint_wrapper and units]
PyTorch's ``checkpoint_wrapper`` (and its ``apply_activation_checkpointing``, which applies it) recomputes by
calling the wrapped module itself, so the forward hooks of every unit inside the wrapper run again in
backward, where they would reshard and re-register what the backward in progress is using. A unit inside a
``CheckpointWrapper`` is therefore refused when the model is sharded (``refuse_units_inside_checkpoint_wrappers``);
a wrapper around a module inside a unit, around the root's modules, or chosen as the unit itself is fine. A
model checkpointed both ways is recomputed twice in backward, which a warning names.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.utils.checkpoint
from torch import nn

from lightning_shard.engine.diagnostics import warn_rank0
from lightning_shard.engine.policies import WrapPolicy, select_unit_modules

_MARK = "_lightning_shard_checkpointed"


def apply_activation_checkpointing(root: nn.Module, policy: WrapPolicy) -> list[str]:
    """Checkpoint every module ``policy`` selects (once; applying again is a no-op); return their names.

    A model that PyTorch's ``checkpoint_wrapper`` (or its ``apply_activation_checkpointing``) already checkpoints
    gets a warning: the policy is applied as well, so modules selected by both are recomputed twice."""
    _warn_if_checkpointed_already(root)
    names = []
    for name, module in select_unit_modules(root, policy):
        if not getattr(module, _MARK, False):
            module.forward = functools.partial(_checkpointed, module.forward)  # type: ignore[method-assign]
            setattr(module, _MARK, True)
        names.append(name)
    return names


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _warn_if_checkpointed_already(root: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = [name or "<root>" for name, m in root.named_modules() if isinstance(m, CheckpointWrapper)]
    if wrapped:
        warn_rank0(
            "FSDP checkpointing is configured, but the model already contains checkpointed layers."  # Lightning's
            " The model is already checkpointed by PyTorch's checkpoint_wrapper (or apply_activation_checkpointing)"
            f" at {', '.join(wrapped)}, and activation_checkpointing_policy checkpoints it as well: a module"
            " checkpointed both ways is recomputed twice in backward. Use one of the two: drop"
            " activation_checkpointing_policy, or the checkpoint_wrapper/apply_activation_checkpointing call.",
            stacklevel=4,
        )


def refuse_units_inside_checkpoint_wrappers(root: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    """Raise ``ValueError`` if any of the named ``units`` of ``root`` lies inside PyTorch's ``CheckpointWrapper`` (see
    [Note: PyTorch's checkpoint_wrapper and units])."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    unit_ids = {id(m) for _, m in units}
    inside = [
        f"{prefix}.{inner_name} (inside {prefix or '<root>'})" if prefix else f"{inner_name} (inside <root>)"
        for prefix, wrapper in root.named_modules()
        if isinstance(wrapper, CheckpointWrapper)
        for inner_name, inner in wrapper.named_modules()
        if inner is not wrapper and id(inner) in unit_ids
    ]
    if inside:
        raise ValueError(
            f"These sharding units are inside PyTorch's checkpoint_wrapper: {', '.join(inside)}. Its recomputation in"
            " backward calls them again, which ShardStrategy cannot run. Drop checkpoint_wrapper/"
            "apply_activation_checkpointing and pass activation_checkpointing_policy (the same module classes) to"
            " ShardStrategy instead, or make each wrapper the unit (auto_wrap_policy={'CheckpointWrapper'})."
        )
