"""The arguments of Lightning's ``FSDPStrategy`` that ``ShardStrategy`` takes too, in PyTorch FSDP's own forms.

Code moving from ``FSDPStrategy`` brings PyTorch's objects and flags: a ``torch.distributed.fsdp.ShardingStrategy``
member, a ``CPUOffload``, a ``MixedPrecision``, and the keyword arguments Lightning hands on to FSDP
(``use_orig_params``, ``limit_all_gathers``, ``sync_module_states``). Each is turned into our own argument where
ours does exactly what it asks, and refused with a message saying what ``ShardStrategy`` does instead where it
does not: nothing is dropped silently. (PyTorch's wrap policies are in ``lightning_shard.engine.fsdp_policies``.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_shard.engine.mixed_precision import MixedPrecision

FSDP_FLAG_MEANINGS = {  # what ShardStrategy always does, for each flag
    "use_orig_params": "the optimizer always sees each parameter's own shard under its original name",
    "limit_all_gathers": "at most two units are gathered or gathering at once",
    "sync_module_states": "the initial parameters and buffers are always broadcast from rank 0 at set-up",
}


def sharding_strategy_name(value: Any) -> Any:
    """A member of PyTorch's ``ShardingStrategy`` as its name (``SHARD_GRAD_OP``...); anything else unchanged.
    ``_HYBRID_SHARD_ZERO2``, which has no counterpart, is refused."""
    from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

    name = value.name if isinstance(value, TorchShardingStrategy) else value
    if isinstance(name, str) and name.upper() == "_HYBRID_SHARD_ZERO2":
        raise ValueError(
            "sharding_strategy='_HYBRID_SHARD_ZERO2' (SHARD_GRAD_OP inside groups, replicated across them) has no"
            " counterpart in ShardStrategy. Use 'HYBRID_SHARD' with device_mesh=(replicas, shard_size), which"
            " reshards after forward, or 'SHARD_GRAD_OP' over all ranks."
        )
    return name


def cpu_offload_flag(value: Any) -> Any:
    """PyTorch's ``CPUOffload(offload_params=...)`` as the bool it stands for; anything else unchanged."""
    from torch.distributed.fsdp import CPUOffload

    return value.offload_params if isinstance(value, CPUOffload) else value


def mixed_precision_from_torch(value: Any, has_wrap_policy: bool) -> Any:
    """PyTorch FSDP's ``MixedPrecision`` as ours, field by field with FSDP's meaning; anything else unchanged.

    - ``reduce_dtype=None`` with a ``param_dtype`` reduces in ``param_dtype`` under FSDP: so it does here.
    - ``cast_root_forward_inputs`` (FSDP's default ``True``) is our ``cast_forward_inputs``: the root's floating
      inputs are cast to ``param_dtype``.
    - ``_module_classes_to_ignore`` (``_BatchNorm`` by default) run in full precision under FSDP when an
      ``auto_wrap_policy`` is given: here they become ``keep_fp32``, with the subclasses defined so far (a class
      defined after the strategy is built is not seen).
    - ``keep_low_precision_grads=True`` (the optimizer gets low-precision gradients) and
      ``cast_forward_inputs=True`` (every unit casts its own inputs) cannot be honoured and are refused.
    """
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    if not isinstance(value, TorchMixedPrecision):
        return value
    refused = [name for name in ("keep_low_precision_grads", "cast_forward_inputs") if getattr(value, name)]
    if refused:
        raise ValueError(
            f"mixed_precision=torch.distributed.fsdp.MixedPrecision({', '.join(f'{n}=True' for n in refused)}) cannot"
            " be honoured by ShardStrategy: gradients reach the optimizer in the parameters' dtype, and only the"
            " root module's inputs are cast (cast_root_forward_inputs). Drop these flags, or pass a"
            " lightning_shard.MixedPrecision."
        )
    ignored = value._module_classes_to_ignore if has_wrap_policy else ()
    return MixedPrecision(
        param_dtype=value.param_dtype,
        reduce_dtype=value.reduce_dtype if value.reduce_dtype is not None else value.param_dtype,
        buffer_dtype=value.buffer_dtype,
        cast_forward_inputs=value.cast_root_forward_inputs,
        keep_fp32=tuple(cls for base in ignored for cls in _with_subclasses(base)),
    )


def check_fsdp_flags(**flags: Any) -> None:
    """``use_orig_params``, ``limit_all_gathers``, ``sync_module_states``: ``True`` is what ``ShardStrategy`` always
    does, so it is accepted; ``False`` asks for something it never does and is refused."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}.")
        if not value:
            raise ValueError(
                f"{name}=False cannot be honoured by ShardStrategy: {FSDP_FLAG_MEANINGS[name]}. Drop the argument"
                f" (or pass {name}=True)."
            )


def _with_subclasses(cls: type[nn.Module]) -> list[type[nn.Module]]:
    found, stack = [], [cls]
    while stack:
        current = stack.pop()
        if current not in found:
            found.append(current)
            stack.extend(current.__subclasses__())
    return found
