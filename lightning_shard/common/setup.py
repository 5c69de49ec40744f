"""Setting a module up for sharded training, and the accumulation context: the same for both front ends."""

from __future__ import annotations

import functools
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_shard.common.options import ShardOptions
from lightning_shard.engine.activation_checkpointing import apply_activation_checkpointing
from lightning_shard.engine.mesh import ShardMesh
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.option_choices import GradSync
from lightning_shard.engine.parallel.pipeline import Pipeline, PipelineError, StageSplit, outermost_blocks
from lightning_shard.engine.parallel.pipeline_ranks import PipelineRanks
from lightning_shard.engine.policies import ModuleClassWrapPolicy, WrapPolicy
from lightning_shard.engine.sharded_module import ShardedModule, shard_module, sharded_module_of


def setup_sharded_module(
    module: nn.Module,
    options: ShardOptions,
    mesh: ShardMesh,
    device: torch.device,
    mixed_precision: MixedPrecision | None,
) -> ShardedModule:
    """Shard ``module`` in place (it stays the same object), apply activation checkpointing, and move modules without
    parameters of their own (metrics) to ``device``. A module sharded before keeps its shards and takes rank 0's
    buffers, as DDP's set-up synchronises them."""
    offloads = options.cpu_offload and device.type != "cpu"
    if options.cpu_offload and not offloads:
        rank_zero_warn(
            "ShardStrategy(cpu_offload=True) has no effect on a CPU device: the shards already live in CPU"
            " memory. It offloads when training on GPUs."
        )
    sharded_before = sharded_module_of(module) is not None
    policy, stage = options.wrap_policy, None
    if options.pipeline_parallel_size > 1 and not sharded_before:  # keep this rank's stage only, before sharding
        assert mesh.pipeline is not None  # start_mesh builds it for pipeline_parallel_size > 1
        stage = install_pipeline(module, options, mesh.pipeline, device)
        policy = stage.blocks
    engine = shard_module(
        module, mesh, options.sharding_strategy, policy, device, mixed_precision, cpu_offload=offloads,
        param_init=options.param_init, cpu_allocator=options.cpu_allocator,
    )
    engine.buffer_sync.enabled = options.broadcast_buffers
    if stage is not None:  # the ties' names are under the pipelined submodule's
        prefix = stage.prefix + "." if stage.prefix else ""
        shards = {n.removeprefix(prefix): p.sharded for p in engine.sharded_params() for n in p.fqns}
        stage.pipeline.ties.bind(shards, stage.pipeline.ranks, mesh.owned_groups, offloads, mesh.shard_backend)
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
    if mesh.context_parallel is not None:  # every call of the module is a step on a split batch
        mesh.context_parallel.attach(module)
        if stage is not None:  # and so is each forward 1F1B repeats in the backward
            stage.pipeline.recompute_under = functools.partial(mesh.context_parallel.step, module)
    _move_param_free_modules(module, device)
    return engine


@dataclass(frozen=True)
class InstalledPipeline:
    """This rank's stage of a module: its schedule, the name of the submodule that runs it (``""``: the module),
    and the block rule that split it (also the units it is sharded by)."""

    pipeline: Pipeline
    prefix: str
    blocks: WrapPolicy


def install_pipeline(
    module: nn.Module, options: ShardOptions, ranks: PipelineRanks, device: torch.device
) -> InstalledPipeline:
    """Prune ``module`` to this rank's pipeline stage and make each outermost call of its pipelined submodule (see
    ``pipelined_submodule``) a run of the schedule. The blocks are ``auto_wrap_policy``'s, or without one the
    model's repeated blocks (see ``repeated_blocks``). The split is recorded on the module for checkpoints."""
    is_block = options.wrap_policy if options.wrap_policy is not None else repeated_blocks(module)
    if not callable(is_block):
        raise PipelineError(
            f"pipeline_parallel_size={options.pipeline_parallel_size} needs blocks named by class, class name or a"
            f" callable (module, name) -> bool in auto_wrap_policy, got {type(is_block).__name__}."
        )
    name, target = pipelined_submodule(module, is_block)
    outside = [n for n, _ in module.named_parameters() if name and not n.startswith(name + ".")]
    if outside:  # every stage would hold and write them
        raise PipelineError(
            f"{type(module).__name__} holds {', '.join(outside[:5])} outside {name}, the module whose blocks the"
            f" pipeline stages split: move them into {name} (before its blocks: the first stage; after: the last)."
        )
    split = StageSplit.of(target, is_block, options.pipeline_parallel_size,
                          None if options.pipeline_split_points is None else list(options.pipeline_split_points))
    pipeline = Pipeline.install(target, split, ranks, options.pipeline_schedule, options.microbatches, device)
    module._pipeline = pipeline  # type: ignore[assignment]
    module._pipeline_split = (name, split)  # type: ignore[assignment]
    return InstalledPipeline(pipeline, name, is_block)


def repeated_blocks(root: nn.Module) -> ModuleClassWrapPolicy:
    """The block rule of a model given no ``auto_wrap_policy``: the class of the children of its longest
    ``nn.ModuleList`` or ``nn.Sequential`` whose children (at least two, each holding parameters) are all of one
    class (a transformer's layers; the first such list when several are as long). Raises ``PipelineError`` when it
    has none."""
    found: list[tuple[int, str, type[nn.Module]]] = []
    for name, m in root.named_modules():
        children = list(m.children())
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(children) > 1:
            if len({type(c) for c in children}) == 1 and all(_holds_parameters(c) for c in children):
                found.append((len(children), name, type(children[0])))
    if not found:
        raise PipelineError(
            f"pipeline_parallel_size splits the model into stages of whole blocks, but {type(root).__name__} has no"
            " nn.ModuleList or nn.Sequential of repeated blocks to split, and no auto_wrap_policy names them. Pass"
            " auto_wrap_policy={YourBlock} (the class or class name of the transformer block)."
        )
    count, name, cls = max(found, key=lambda item: item[0])  # the first of the longest
    rank_zero_info(
        f"pipeline_parallel_size splits {type(root).__name__} at its {count} {cls.__name__} blocks ({name}), which"
        " are also its sharding units; pass auto_wrap_policy to choose other blocks."
    )
    return ModuleClassWrapPolicy(frozenset({cls}))


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def pipelined_submodule(root: nn.Module, is_block: Any) -> tuple[str, nn.Module]:
    """The module whose calls run the schedule: the child of ``root`` holding every block (a LightningModule's
    ``self.model``), or ``root`` itself when its blocks are spread over its children."""
    heads = {name.split(".", 1)[0] for name, _ in outermost_blocks(root, is_block)}
    if len(heads) == 1:
        head = heads.pop()
        child = getattr(root, head)
        if not isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and not is_block(child, head):
            return head, child
    return "", root


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
