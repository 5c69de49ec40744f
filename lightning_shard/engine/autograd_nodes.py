"""The two autograd functions a unit inserts into the graph: one on its forward inputs, whose backward tells the
unit its gradients are complete, and one that makes backward reach a unit this rank did not use."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_shard.engine.param_shard import ShardedParam


class BackwardUnit(Protocol):
    """What the autograd functions use of their unit (``lightning_shard.engine.unit.ShardUnit``)."""

    trainable: list[ShardedParam]

    def post_backward(self) -> None: ...


class ReachedByBackward(torch.autograd.Function):
    """Identity on a unit's floating outputs that makes them require grad through one of its trainable weights,
    which gets no gradient from it.

    [Note: a unit some ranks skip]
    A rank whose forward uses none of a unit's trainable parameters, on inputs that need no
    gradient (a branch taken on some ranks only), gets outputs that need no gradient: left alone,
    its backward would never reach the unit, nor the units after it through their inputs, while
    the other ranks gather and reduce there. Every rank must issue the same collectives in the
    same order, so such outputs are routed through this function: the backward reaches the unit
    where it reaches it on the other ranks, and the unit reduces zeros (and flags) for what this
    rank did not use. The root is left out: it is gathered for the whole step and reduced at the
    end of backward on every rank, and its outputs are what the user's code receives.
    """

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, *outputs: Tensor) -> tuple[Tensor, ...]:
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        return (None, *grads)

    @staticmethod
    def wrap_outputs(unit: BackwardUnit, output: Any) -> tuple[Any, list[Tensor]]:
        flat, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.is_floating_point()]
        if not positions:
            return output, []
        wrapped = ReachedByBackward.apply(unit.trainable[0].unsharded, *(flat[i] for i in positions))
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec), list(wrapped)


class RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once the unit's gradients are all computed."""

    @staticmethod
    def forward(ctx: Any, unit: BackwardUnit, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.unit.post_backward()
        return (None, *grads)

    @staticmethod
    def wrap_inputs(unit: BackwardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
        if not positions:
            return args, kwargs
        wrapped = RegisterPostBackward.apply(unit, *(flat[i] for i in positions))
        for i, t in zip(positions, wrapped):
            flat[i] = t
        return tree_unflatten(flat, spec)
