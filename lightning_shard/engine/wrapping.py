"""Units named by hand, and the wrappers of other sharding libraries, which are refused.

[Note: manual units]
Besides ``auto_wrap_policy``, a module becomes a unit when it is marked: by ``mark_unit(module)``, or by
PyTorch's ``torch.distributed.fsdp.wrap.wrap(module)`` called inside the strategies' sharded-model context
(the Trainer's ``configure_model()``, Fabric's ``init_module()``), which enters PyTorch's ``enable_wrap``
with ``mark_wrapped`` as the wrapper. Nothing wraps the module: ``wrap`` returns the module itself with
the marker attribute set, so the model's structure and parameter names are those of the unwrapped model
and its checkpoints load into it either way. Outside that context ``wrap`` returns the module unchanged,
as PyTorch's does without ``enable_wrap``. Marked modules and the policy's choice are units together
(``planning.plan_units``); a size policy counts a marked module's parameters as taken.

A marker the engine cannot honour is refused when the model is sharded, never dropped: the root (always
a unit of its own, resharded only after backward), a container without ``forward()`` (never called, so
never gathered), the ``out_proj`` of an ``nn.MultiheadAttention`` (its weights are read without calling
it). ``wrap(module, **kwargs)`` with per-unit settings (``mixed_precision``, ``cpu_offload``, ...) is
refused as it is called: every unit runs with the strategy's settings.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import nn

from lightning_shard.engine.policies import READS_CHILDREN_WEIGHTS, is_callable_module

M = TypeVar("M", bound=nn.Module)

_UNIT_MARK = "_lightning_shard_unit"


def mark_unit(module: M) -> M:
    """Make ``module`` a sharding unit of the model it belongs to, whatever ``auto_wrap_policy`` says; return it.

    The module is not wrapped: it stays the same object, under the same name, with the same parameters. Mark
    modules before the model is sharded (while building it). See [Note: manual units]."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"mark_unit() takes an nn.Module, got {type(module).__name__}.")
    setattr(module, _UNIT_MARK, True)  # a torch.compile wrapper passes it on to the module it holds
    return module


def is_marked_unit(module: nn.Module) -> bool:
    """Whether ``module`` was marked by ``mark_unit`` (or ``wrap`` inside the sharded-model context)."""
    return module.__dict__.get(_UNIT_MARK, False) is True


def mark_wrapped(module: nn.Module, **overrides: Any) -> nn.Module:
    """The ``wrapper_cls`` the strategies give PyTorch's ``enable_wrap``: ``wrap(module)`` marks ``module`` as a unit
    and returns it. Keyword arguments to ``wrap`` are per-unit settings, which are refused."""
    if overrides:
        names = ", ".join(sorted(overrides))
        raise ValueError(
            f"wrap({type(module).__name__}, {names}=...) gives one unit settings of its own, which ShardStrategy"
            " cannot apply: every unit runs with the strategy's arguments (mixed_precision, cpu_offload,"
            " sharding_strategy). Call wrap() without keyword arguments, and set these on ShardStrategy (for"
            " modules kept in fp32, MixedPrecision(keep_fp32=...))."
        )
    return mark_unit(module)


@contextmanager
def wrap_marks_units() -> Generator[None, None, None]:
    """Inside: PyTorch's ``torch.distributed.fsdp.wrap.wrap(module)`` marks ``module`` as a unit (see [Note: manual
    units]). Entered again inside itself it changes nothing; inside another ``enable_wrap`` PyTorch raises."""
    from torch.distributed.fsdp.wrap import _ConfigAutoWrap, enable_wrap

    if _ConfigAutoWrap.in_autowrap_context and _ConfigAutoWrap.wrapper_cls is mark_wrapped:
        yield  # nested (fabric.init_module() inside another): the outer context marks
        return
    with enable_wrap(wrapper_cls=mark_wrapped):
        yield


def marked_units(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The marked modules below ``root``, in module order; a marker that cannot be honoured raises ``ValueError``."""
    if is_marked_unit(root):
        raise ValueError(
            f"The model given to ShardStrategy ({type(root).__name__}) is itself marked as a unit (wrap() or"
            " mark_unit()). It is always the root unit, which stays gathered from its forward to the end of"
            " backward; remove the wrap()/mark_unit() call on it and mark the modules inside it instead."
        )
    selected = [(name, m) for name, m in root.named_modules() if m is not root and is_marked_unit(m)]
    containers = [f"{name} ({type(m).__name__})" for name, m in selected if not is_callable_module(m)]
    if containers:
        raise ValueError(
            f"{', '.join(containers)} is marked as a unit (wrap() or mark_unit()) but has no forward(): a unit is"
            " gathered when its forward runs, so a container would never be. Mark the modules inside it instead."
        )
    unreadable = [
        f"{prefix}{'.' if prefix else ''}{child_name}"
        for prefix, parent in root.named_modules()
        if isinstance(parent, READS_CHILDREN_WEIGHTS)
        for child_name, child in parent.named_children()
        if is_marked_unit(child)
    ]
    if unreadable:
        raise ValueError(
            f"{', '.join(unreadable)} is marked as a unit (wrap() or mark_unit()), but its parent reads its weights"
            " without calling it (nn.MultiheadAttention), so it would never be gathered. Mark the parent instead."
        )
    return selected


def refuse_foreign_sharding(root: nn.Module) -> None:
    """Raise ``TypeError`` if any module of ``root`` is sharded by PyTorch's FSDP (``FullyShardedDataParallel``,
    or ``fully_shard``): its parameters are another library's flat or distributed tensors."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    found = [
        (name or "<root>", "FullyShardedDataParallel" if isinstance(m, FullyShardedDataParallel) else "fully_shard")
        for name, m in root.named_modules()
        if isinstance(m, (FullyShardedDataParallel, FSDPModule))
    ]
    if found:
        shown = ", ".join(f"{name} ({how})" for name, how in found)
        raise TypeError(
            f"These modules are already sharded by PyTorch's FSDP: {shown}. ShardStrategy shards the model itself:"
            " pass the plain module, without FullyShardedDataParallel(...) or fully_shard(...). To choose the units,"
            " use auto_wrap_policy, wrap(module) inside configure_model() / fabric.init_module(), or"
            " lightning_shard.mark_unit(module)."
        )
