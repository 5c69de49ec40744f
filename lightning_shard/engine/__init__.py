"""The sharding engine: plain PyTorch, no Lightning. Both Lightning front ends are built on it, and a PyTorch
script can call it directly (see ``shard_model``).

One concern per module: ``option_choices`` (the named choices of the options: the sharding strategy, gradient
sync...), ``policies`` (wrap policies), ``parallel`` (the one owner of the layout
of ranks, ``parallel.dims``, and the parallel dimensions applied in a fixed order), ``mesh`` (this rank's process
groups: which ranks shard and replicate together), ``param_shard`` (one parameter's rows and its two faces),
``unit`` and ``reduction`` (a unit's all-gather and its gradient reduction), ``collectives`` (the collectives as
plain functions), ``planning`` (which unit owns which parameter), ``wrapping`` (units marked by hand; other
libraries' sharding wrappers refused), ``diagnostics`` (set-up warnings), ``buffers`` (buffers that follow DDP),
``sharded_module`` (the engine of one model and its hooks), ``mixed_precision``, ``grad_scaler``, ``clipping``,
``activation_checkpointing``, ``compile`` (compiled blocks with the sharding hooks outside the compiled code),
``cpu_allocator`` (glibc's malloc reusing the large blocks PyTorch frees every step on CPU), ``memory`` (what a rank
holds), ``estimate`` (what it would hold), ``full_params`` (``summon_full_params``: the full weights in memory for a
``with`` block), ``transformers_buffers`` (meta buffers of Hugging Face models given their values by the model's own
initialisation), ``optimizer_rule`` and ``whole_tensor_step`` (which optimizers run on shards, which run each tensor
whole on one rank) and ``torch_norms`` (torch's gradient norms over whole tensors).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_shard.engine.clipping import clip_grad_norm_ as _clip_shards
from lightning_shard.engine.full_params import summon_full_params
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.option_choices import CpuAllocator, ParamInit, ShardingStrategy, ShardingStrategyName
from lightning_shard.engine.policies import WrapPolicySpec, resolve_wrap_policy
from lightning_shard.engine.sharded_module import ShardedModule, shard_module, sharded_module_of
from lightning_shard.engine.whole_tensor_step import prepare_optimizer as _prepare_optimizer
from lightning_shard.engine.wrapping import mark_unit

__all__ = ["ShardedModule", "clip_grad_norm_", "mark_unit", "prepare_optimizer", "shard_model", "sharded_module_of",
           "summon_full_params"]


def shard_model(
    model: nn.Module,
    *,
    auto_wrap_policy: WrapPolicySpec = None,
    sharding_strategy: ShardingStrategyName | ShardingStrategy = "FULL_SHARD",
    device_mesh: tuple[int, int] | None = None,
    mixed_precision: MixedPrecision | None = None,
    device: torch.device | str | None = None,
    cpu_offload: bool = False,
    param_init: Literal["reset_parameters", "empty"] | ParamInit = "reset_parameters",
    cpu_allocator: Literal["reuse", "system"] | CpuAllocator = "reuse",
    tensor_parallel_size: int = 1,
) -> ShardedModule:
    """Shard ``model`` in place over the default process group, as the Lightning strategies do; return its engine.

    Afterwards ``model.parameters()`` are this rank's rows (build the optimizer from them before any forward with
    gradients, or after its backward: in between, the units that stay gathered for backward show their full
    weights), each forward gathers the units it runs, and each backward leaves this rank's rows of the averaged
    gradients in ``.grad``. A model built on the meta device is materialised and initialised (``reset_parameters()``)
    one unit at a time, or with ``param_init="empty"`` left uninitialised for a load to fill (a forward before that
    raises). Modules marked with ``mark_unit`` are units besides those ``auto_wrap_policy`` selects. The
    arguments mean what the strategies' arguments of the same names mean; ``device`` defaults to
    ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU. The process group must exist
    (``torch.distributed.init_process_group``, e.g. under ``torchrun``).

    With ``tensor_parallel_size = T > 1``, apply the tensor-parallel plan first, on the ``"tensor_parallel"``
    dimension of ``init_device_mesh(device, (world // T, T), mesh_dim_names=("data_parallel",
    "tensor_parallel"))``: each rank's part of every ``DTensor`` parameter is then sharded over the data-parallel
    ranks (see [Note: DTensor parameters in the engine]).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model() shards over the default process group: call torch.distributed.init_process_group() first"
            " (torchrun sets the environment it reads)."
        )
    if not isinstance(cpu_offload, bool):
        raise TypeError(f"cpu_offload must be True or False, got {cpu_offload!r}.")
    if device is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    strategy = ShardingStrategy.parse(sharding_strategy)
    init = ParamInit.parse(param_init)
    mesh = build_shard_mesh(strategy, device_mesh, dist.get_backend(), tensor_parallel_size)
    offload = cpu_offload and device.type != "cpu"
    policy = resolve_wrap_policy(auto_wrap_policy)
    allocator = CpuAllocator.parse(cpu_allocator)
    return shard_module(model, mesh, strategy, policy, device, mixed_precision, offload, init, allocator)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip the gradients of a sharded ``model`` by their global norm over every rank's rows; return that norm,
    the same on every rank (what ``torch.nn.utils.clip_grad_norm_`` gives on an unsharded model). Collective."""
    engine = sharded_module_of(model)
    if engine is None:
        raise TypeError(f"clip_grad_norm_() needs a model sharded by shard_model(), not a {type(model).__name__}.")
    shards = [p.sharded for p in engine.sharded_params()]
    return _clip_shards(shards, engine.mesh, engine.device, max_norm, norm_type)


def prepare_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """Make ``optimizer``, built on a sharded ``model``'s parameters, update them exactly; return it. An element-wise
    optimizer (SGD, AdamW) is left as it is; one whose update reads the whole tensor (Muon, Adafactor) runs each
    tensor's update whole on one rank; one that cannot run exactly, or that nobody declared, raises ``ValueError``
    saying what to do (see ``lightning_shard.declare_optimizer_update``). The Lightning strategies do this for the
    optimizers they set up; an optimizer that steps on shards without it is refused unless it is element-wise."""
    engine = sharded_module_of(model)
    if engine is None:
        raise TypeError(f"prepare_optimizer() needs a model sharded by shard_model(), not a {type(model).__name__}.")
    _prepare_optimizer(optimizer, [engine])
    return optimizer
