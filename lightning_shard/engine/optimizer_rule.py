"""Which optimizers run on shards, which run each tensor whole, and which are refused.

[Note: what an optimizer may see of a sharded parameter]
Each rank holds some rows of every parameter (``param_shard``), and the optimizer is built on those rows. That is
exact for an optimizer whose update of an element reads only that element and its own state (SGD, Adam, RMSprop):
every element gets the update it would get on the whole tensor. It is wrong for an optimizer that reads the
whole tensor: Muon orthogonalises each matrix and scales its step by the matrix's shape, Adafactor keeps row and
column statistics and scales by the parameter's norm, LAMB and Shampoo read norms and matrix products. Such an
optimizer must never see rows as if they were the tensor.

So every optimizer is classified before its first step (``OptimizerUpdate``):
- ``ELEMENTWISE``: it runs on the shards as they are (no communication, state split like the parameters).
- ``PER_TENSOR``: each tensor's update runs whole, on one rank of its shard group (its owner, chosen to balance
  the elements each rank updates): the owner receives the other ranks' rows of the gradient, the parameter and
  the state shaped like it, runs the optimizer's own ``step`` on whole tensors, and sends every rank its rows
  back (see ``whole_tensor_step``). Each matrix is orthogonalised once per step, on one rank, by torch's own
  code; between steps the state is split by rows like any other, so checkpoints save and load it at any world
  size. This is the design of distributed Muon in Dion and Moonlight ("each rank owns whole matrices"), applied
  for the step only.
- refused: an optimizer that couples different tensors (LBFGS's line search and curvature pairs are dot
  products over every parameter), or one that needs what sharding does not give (SparseAdam's sparse gradients).

Every optimizer is checked once more before its first step, whatever set it up (a global step pre-hook, installed
when a model is sharded): one that holds sharded parameters and was not prepared by a front end (or by
``lightning_shard.engine.prepare_optimizer`` with the engine alone) is refused there if it is not element-wise, so
that no path runs a whole-tensor update on rows.

``torch.optim``'s optimizers are classified here. An optimizer from elsewhere (the user's own, Lion, LAMB, SOAP,
Shampoo) is refused until the user declares its update with ``declare_optimizer_update``: we cannot tell from the
outside whether a step reads one element or the whole tensor, and guessing wrong would train silently wrong. A
subclass of a known optimizer that does not override ``step`` updates as its parent does.
"""

from __future__ import annotations

import enum
import weakref
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_shard.engine.param_shard import is_shard


class OptimizerUpdate(enum.Enum):
    """What one parameter's update reads (see [Note: what an optimizer may see of a sharded parameter])."""

    ELEMENTWISE = "elementwise"  # each element's update reads that element alone: runs on the shards
    PER_TENSOR = "per_tensor"  # reads the whole tensor, no other tensor: runs whole, on one rank per tensor


def _known() -> dict[type[Optimizer], OptimizerUpdate]:
    optim = torch.optim
    elementwise = ["SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop",
                   "ASGD"]
    per_tensor = ["Muon", "Adafactor"]
    known = {getattr(optim, name): OptimizerUpdate.ELEMENTWISE for name in elementwise if hasattr(optim, name)}
    known |= {getattr(optim, name): OptimizerUpdate.PER_TENSOR for name in per_tensor if hasattr(optim, name)}
    return known


_DECLARED: dict[type[Optimizer], OptimizerUpdate] = _known()

_REFUSED: dict[str, str] = {
    "LBFGS": "its line search and curvature pairs are dot products over every parameter together, which no"
             " per-tensor update can reproduce; use a first-order optimizer (AdamW) or run it without sharding",
    "SparseAdam": "it needs sparse gradients, and sharded gradients are dense; use Adam or AdamW",
}


def declare_optimizer_update(optimizer_class: type[Optimizer], update: OptimizerUpdate | str) -> None:
    """Declare how ``optimizer_class`` updates a parameter, so that ShardStrategy can run it (see [Note: what an
    optimizer may see of a sharded parameter]).

    ``"elementwise"``: each element's new value and state read only that element's gradient and state (Lion,
    bitsandbytes' Adam). ``"per_tensor"``: the update reads the whole tensor (a norm, row or column statistics, a
    matrix product: LAMB, Shampoo, SOAP) but no other tensor; each tensor then runs whole on one rank. An
    optimizer whose step reads several tensors together cannot be declared either way.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(f"declare_optimizer_update() takes a torch.optim.Optimizer subclass, got {optimizer_class!r}.")
    _DECLARED[optimizer_class] = _parse(update)


def optimizer_update(optimizer: Optimizer) -> OptimizerUpdate:
    """How ``optimizer`` must run on sharded parameters; raises ``ValueError`` (naming it and what to do) for one
    that cannot run exactly or that nobody declared."""
    cls = type(optimizer)
    for base in cls.__mro__:
        if base.__name__ in _REFUSED and base.__module__.startswith("torch.optim"):
            raise ValueError(f"ShardStrategy cannot run {cls.__name__}: {_REFUSED[base.__name__]}.")
        if base in _DECLARED:
            return _DECLARED[base]
        if "step" in vars(base):  # its own update, which nobody declared
            break
    raise ValueError(
        f"ShardStrategy does not know how {cls.__qualname__} updates a parameter, and each rank holds only some"
        " rows of each parameter: an update that reads the whole tensor would see rows and train silently wrong."
        f" Declare it before training: lightning_shard.declare_optimizer_update({cls.__name__}, \"elementwise\")"
        " if each element's update reads only that element (Lion), or"
        f" lightning_shard.declare_optimizer_update({cls.__name__}, \"per_tensor\") if it reads the whole tensor"
        " (a norm, row or column statistics, a matrix product: LAMB, Shampoo, SOAP); each tensor then runs whole"
        " on one rank. An optimizer whose step couples different tensors is not supported."
    )


def _parse(update: OptimizerUpdate | str) -> OptimizerUpdate:
    if isinstance(update, OptimizerUpdate):
        return update
    try:
        return OptimizerUpdate(str(update).lower())
    except ValueError:
        valid = ", ".join(repr(u.value) for u in OptimizerUpdate)
        raise ValueError(f"Unknown optimizer update {update!r}; expected one of {valid}.") from None


# Optimizers classified for the shards they hold (and, if per-tensor, made to run each tensor whole).
_PREPARED: weakref.WeakSet[Optimizer] = weakref.WeakSet()
_GUARDING = False


def mark_prepared(optimizer: Optimizer) -> None:
    """``optimizer`` may step on shards: it is element-wise, or its step runs each tensor whole."""
    _PREPARED.add(optimizer)


def guard_optimizer_steps() -> None:
    """Check every optimizer before its steps (once per process; see [Note: what an optimizer may see of a sharded
    parameter])."""
    global _GUARDING
    if not _GUARDING:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_before_step)
        _GUARDING = True


def _check_before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _PREPARED:
        return
    if not any(is_shard(q) for group in optimizer.param_groups for q in group["params"]):
        return  # nothing sharded (yet: a group may be added later, so this is not remembered)
    if optimizer_update(optimizer) is OptimizerUpdate.ELEMENTWISE:
        _PREPARED.add(optimizer)
        return
    raise ValueError(
        f"{type(optimizer).__name__} updates each parameter from the whole tensor and holds sharded parameters, but"
        " it was not set up for them, so it would see this rank's rows only. Pass it through the strategy"
        " (return it from configure_optimizers, or fabric.setup_optimizers(optimizer)), or with the engine alone"
        " call lightning_shard.engine.prepare_optimizer(optimizer, model) before its first step."
    )
