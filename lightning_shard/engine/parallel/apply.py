"""A module set up in the parallel layout of its mesh, in one fixed, visible order: keep this rank's pipeline stage
(the other stages' modules pruned), shard what is left, bind the weights tied across stages, and make every call of
the module a context-parallel step. A tensor-parallel plan comes before all of them (the user applies it on
``device_mesh["tensor_parallel"]``), activation checkpointing after. The engine holds what this builds
(``ShardedModule.pipeline_stage``); nothing is stored on the module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_shard.engine.mesh import ShardMesh
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.option_choices import CpuAllocator, ParamInit, PipelineSchedule, ShardingStrategy
from lightning_shard.engine.parallel.pipeline import (
    Pipeline,
    PipelineError,
    PipelineStage,
    StageSplit,
    outermost_blocks,
)
from lightning_shard.engine.parallel.pipeline_ranks import PipelineRanks
from lightning_shard.engine.policies import ModuleClassWrapPolicy, WrapPolicy
from lightning_shard.engine.sharded_module import ShardedModule, shard_module, sharded_module_of


@dataclass(frozen=True)
class PipelinePlan:
    """How the pipeline stages run the module: the schedule, the microbatches of each call, and the blocks where
    stages 1, 2, ... begin (``None``: stages as even as possible)."""

    schedule: PipelineSchedule
    microbatches: int
    split_points: Sequence[str] | None = None


def apply_parallelism(
    module: nn.Module, mesh: ShardMesh, strategy: ShardingStrategy, policy: WrapPolicy | None, device: torch.device,
    mixed_precision: MixedPrecision | None, *, cpu_offload: bool, param_init: ParamInit, cpu_allocator: CpuAllocator,
    pipeline: PipelinePlan, inform: Callable[[str], None] | None = None,
) -> ShardedModule:  # fmt: skip
    """Shard ``module`` in place in the layout of ``mesh`` and return its engine (see ``shard_module`` for the
    sharding arguments). Under pipeline parallelism only this rank's stage is kept, split at ``policy``'s blocks
    (without one, the model's repeated blocks, named through ``inform``) as ``pipeline`` says, and each outermost
    call runs the schedule. A module sharded before keeps its stage and its shards."""
    stage = None
    if mesh.pipeline is not None and sharded_module_of(module) is None:  # keep this rank's stage only, then shard
        stage = install_pipeline(module, policy, mesh.pipeline, pipeline, device, inform)
        policy = stage.blocks
    engine = shard_module(module, mesh, strategy, policy, device, mixed_precision, cpu_offload, param_init,
                          cpu_allocator)  # fmt: skip
    if stage is not None:  # the ties' names are under the pipelined submodule's
        prefix = stage.prefix + "." if stage.prefix else ""
        shards = {n.removeprefix(prefix): p.sharded for p in engine.sharded_params() for n in p.fqns}
        stage.pipeline.ties.bind(shards, mesh, cpu_offload)
        engine.pipeline_stage = stage
    if mesh.context_parallel is not None:  # every call of the module is a step on a split batch
        mesh.context_parallel.attach(module)
        if stage is not None:  # and so is each forward 1F1B repeats in the backward
            stage.pipeline.recompute_under = functools.partial(mesh.context_parallel.step, module)
    return engine


def install_pipeline(
    module: nn.Module, policy: WrapPolicy | None, ranks: PipelineRanks, plan: PipelinePlan, device: torch.device,
    inform: Callable[[str], None] | None = None,
) -> PipelineStage:  # fmt: skip
    """Prune ``module`` to this rank's pipeline stage and make each outermost call of its pipelined submodule (see
    ``pipelined_submodule``) a run of the schedule. The blocks are ``policy``'s, or without one the model's repeated
    blocks (see ``repeated_blocks``)."""
    is_block = policy if policy is not None else repeated_blocks(module, inform)
    if not callable(is_block):
        raise PipelineError(
            f"pipeline_parallel_size={ranks.size} needs blocks named by class, class name or a callable"
            f" (module, name) -> bool in auto_wrap_policy, got {type(is_block).__name__}."
        )
    name, target = pipelined_submodule(module, is_block)
    outside = [n for n, _ in module.named_parameters() if name and not n.startswith(name + ".")]
    if outside:  # every stage would hold and write them
        raise PipelineError(
            f"{type(module).__name__} holds {', '.join(outside[:5])} outside {name}, the module whose blocks the"
            f" pipeline stages split: move them into {name} (before its blocks: the first stage; after: the last)."
        )
    points = None if plan.split_points is None else list(plan.split_points)
    split = StageSplit.of(target, is_block, ranks.size, points)
    pipeline = Pipeline.install(target, split, ranks, plan.schedule, plan.microbatches, device)
    return PipelineStage(pipeline, name, split, is_block)


def repeated_blocks(root: nn.Module, inform: Callable[[str], None] | None = None) -> ModuleClassWrapPolicy:
    """The block rule of a model given no ``auto_wrap_policy``: the class of the children of its longest
    ``nn.ModuleList`` or ``nn.Sequential`` whose children (at least two, each holding parameters) are all of one
    class (a transformer's layers; the first such list when several are as long), named to the user through
    ``inform``. Raises ``PipelineError`` when it has none."""
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
    if inform is not None:
        inform(
            f"pipeline_parallel_size splits {type(root).__name__} at its {count} {cls.__name__} blocks ({name}),"
            " which are also its sharding units; pass auto_wrap_policy to choose other blocks."
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
