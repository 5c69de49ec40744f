"""torch.compile and sharding: compiled blocks run their forward compiled, the sharding hooks run eagerly.

[Note: compiled blocks and the sharding hooks]
Users compile per block, as with PyTorch's ``fully_shard``: ``block.compile()`` (``nn.Module.compile``)
or ``torch.compile(block)`` put in place of the block, before the model is sharded (in
``configure_model``, under ``fabric.init_module()``, or before ``shard_model``). Both compile the
block's ``Module.__call__`` (``_call_impl``), which runs the module's forward hooks, so dynamo would
trace into the engine's hooks: the all-gather, the process group object (dynamo cannot read a
``ProcessGroup``: "UnsafeScriptObjectError ... OpaqueObject"), the unit's Python state. Two steps
keep the hooks out of the compiled region:

- Every hook the engine registers on a module is wrapped by ``outside_compiled_code``
  (``torch._dynamo.disable``): dynamo stops its graph at the hook, the hook runs in eager Python,
  and the rest of ``_call_impl`` (the block's forward) is compiled as the next graph. So a compiled
  block is a few graphs, compiled once: what dynamo guards on (the unsharded parameters' shapes,
  dtypes and ``requires_grad``, the inputs) is the same at every step, since a unit exposes the same
  unsharded ``nn.Parameter`` objects at every forward; only their storage is freed and refilled
  between uses, which is not guarded. Backward runs the compiled graph's backward, reading the
  unsharded faces the pre-backward hook has gathered again (see [Note: unit states and autograd]).
- ``adopt_compiled_wrappers`` replaces each ``torch.compile(block)`` wrapper (an ``OptimizedModule``
  holding the block as ``_orig_mod``) in its parent by the block itself, compiled in place with the
  wrapper's own compile settings, as ``block.compile()`` would have done. The module tree, the
  policies' view of it (``auto_wrap_policy={Block}`` matches the block, not the wrapper) and every
  parameter name are then those of the eager model: checkpoints carry no ``_orig_mod.`` and load into
  a compiled or an eager model alike.

A compiled module that holds several units (a model's inner stack, or the whole model under
Fabric's ``torch.compile(model)``) works the same way, with a graph break at every unit's hooks: the
compiled code between them is what it compiles. Per block is the recommended form: each block is one
graph, and the code around the blocks stays eager Python. Two forms are refused, before any shard is
made: the model given to the engine wrapped by ``torch.compile`` (its parameters would be named
``_orig_mod.*``; pass the module and compile its blocks), and, under the Trainer, a compiled
LightningModule (``lit.compile()``): the strategy runs ``training_step`` through the module's call
(see [Note: the root unit]), so dynamo would compile the whole step, logging and bookkeeping included,
and recompile whenever that Python state changes (e.g. at every step for ``self.losses.append(...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])


def outside_compiled_code(hook: F) -> F:
    """``hook`` as dynamo sees it: never traced, always run eagerly (a graph break in compiled code that calls it)."""
    return torch._dynamo.disable(hook, recursive=True)  # type: ignore[return-value]


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` (or ``adopt_compiled_wrappers``) made its calls run compiled."""
    return getattr(module, "_compiled_call_impl", None) is not None


def adopt_compiled_wrappers(root: nn.Module) -> list[str]:
    """Replace every ``torch.compile(module)`` wrapper below ``root`` by its module compiled in place; return the
    qualified names of the replaced children. See [Note: compiled blocks and the sharding hooks]."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(root, OptimizedModule):
        raise whole_model_compiled_error(type(root._orig_mod).__name__)
    adopted: list[str] = []
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        prefix, parent = stack.pop()
        for name, child in list(parent._modules.items()):
            if isinstance(child, OptimizedModule):
                inner = child._orig_mod
                # What ``inner.compile(**settings)`` does, with the wrapper's own compile context (backend, mode...).
                inner._compiled_call_impl = child.dynamo_ctx(inner._call_impl)
                parent._modules[name] = inner
                adopted.append(prefix + name)
                child = inner
            if child is not None:
                stack.append((f"{prefix}{name}.", child))
    return adopted


def refuse_compiled_root(root: nn.Module) -> None:
    """Raise if ``root`` (the LightningModule under the Trainer) is compiled in place: see [Note: compiled blocks
    and the sharding hooks]. Every rank builds the same model, so every rank raises."""
    if is_compiled_in_place(root):
        raise whole_model_compiled_error(type(root).__name__)


def whole_model_compiled_error(model_class: str) -> ValueError:
    return ValueError(
        f"The whole model ({model_class}) is compiled, which ShardStrategy does not run: compile per block"
        " instead. Call block.compile() (or replace each block by torch.compile(block)) for every module"
        " auto_wrap_policy selects, e.g. in configure_model() or under fabric.init_module(), and leave the"
        f" {model_class} itself uncompiled."
    )
