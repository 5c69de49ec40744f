"""Setting a module up for sharded training, and the accumulation context: the same for both front ends."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_shard.common.options import ShardOptions
from lightning_shard.engine.activation_checkpointing import apply_activation_checkpointing
from lightning_shard.engine.mesh import ShardMesh
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.option_choices import GradSync
from lightning_shard.engine.parallel.apply import PipelinePlan, apply_parallelism
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of


def setup_sharded_module(
    module: nn.Module,
    options: ShardOptions,
    mesh: ShardMesh,
    device: torch.device,
    mixed_precision: MixedPrecision | None,
) -> ShardedModule:
    """Shard ``module`` in place (it stays the same object) in the layout of ``mesh`` (see ``apply_parallelism``),
    apply activation checkpointing, and move modules without parameters of their own (metrics) to ``device``. A
    module sharded before keeps its shards and takes rank 0's buffers, as DDP's set-up synchronises them."""
    offloads = options.cpu_offload and device.type != "cpu"
    if options.cpu_offload and not offloads:
        rank_zero_warn(
            "ShardStrategy(cpu_offload=True) has no effect on a CPU device: the shards already live in CPU"
            " memory. It offloads when training on GPUs."
        )
    sharded_before = sharded_module_of(module) is not None
    pipeline = PipelinePlan(options.pipeline_schedule, options.microbatches, options.pipeline_split_points)
    engine = apply_parallelism(
        module, mesh, options.sharding_strategy, options.wrap_policy, device, mixed_precision, cpu_offload=offloads,
        param_init=options.param_init, cpu_allocator=options.cpu_allocator, pipeline=pipeline, inform=rank_zero_info,
    )
    engine.buffer_sync.enabled = options.broadcast_buffers
    if len(engine.units) == 1 and mesh.shard_size > 1 and not sharded_before:
        rank_zero_warn(
            f"ShardStrategy made the whole {type(module).__name__} one unit: no auto_wrap_policy and no wrap() or"
            " mark_unit() chose smaller ones, so every step gathers the full model on every rank and only gradients"
            " and optimizer state stay sharded. Pass auto_wrap_policy={YourBlock} (in a LightningCLI YAML:"
            " strategy: {class_path: lightning_shard.ShardStrategy, init_args: {auto_wrap_policy: [YourBlock]}})."
        )
    if sharded_before:
        engine.buffer_sync.broadcast()
    if options.checkpointing_policy is not None:
        apply_activation_checkpointing(module, options.checkpointing_policy)
    _move_param_free_modules(module, device)
    return engine


@contextmanager
def accumulating(engine: ShardedModule, grad_sync: GradSync) -> Generator[None, None, None]:
    """A micro-batch that does not end an accumulation window (the Trainer's ``block_backward_sync``, Fabric's
    ``no_backward_sync``). With ``grad_sync="step"`` its gradients stay unreduced on the unsharded weights; with
    ``"microbatch"`` they are reduced right away, as always. Either way the next forward broadcasts no buffers, as
    after DDP's ``no_sync()`` (see [Note: buffers follow DDP])."""
    holds = grad_sync is GradSync.STEP
    engine.buffer_sync.accumulating = True
    if holds:
        engine.hold_gradients(True)
    try:
        yield
    finally:
        if holds:
            engine.hold_gradients(False)
        engine.buffer_sync.accumulating = False


def _move_param_free_modules(model: nn.Module, device: torch.device) -> None:
    """Move modules without parameters of their own (torchmetrics metrics, buffer-only modules) to ``device``."""
    if device.type == "cpu":
        return
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is None and module is not model:
            module._apply(lambda t: t.to(device) if t.device != device else t, recurse=False)
