"""Memory estimates per rank from a model's shapes alone (build it on the meta device: nothing is allocated).

    from lightning_shard import estimate_memory

    with torch.device("meta"):
        model = GPT()
    print(estimate_memory(model, world_size=8, auto_wrap_policy={"Block"}, precision="bf16-mixed"))

The estimate follows the engine's own layout: dim-0 shards padded to ``ceil(rows / shard_size)``
rows, tied weights stored once, parameters owned by the unit that encloses all their uses.

[Note: what a step holds beside the model state]
A training step's peak comes in backward. Beside the model state (shards, their gradient memory, the optimizer
state) a rank then holds, in the units' compute dtype and padded:

- gathered units (``gathered_peak``): the root unit, gathered from the step's start to the end of backward; the
  unit whose backward runs and the one prefetched for the next backward; and a third block of that size: on the
  flat paths the prefetch's rank-major gather buffer, on gloo's point-to-point path the block of the unit just
  resharded, which the buffer pool keeps for the next prefetch. ``SHARD_GRAD_OP`` keeps every unit gathered from
  its forward to its backward instead.
- gradients in reduction (``temporaries``): the running unit's unsharded gradients (on gloo's point-to-point path
  sent straight from them), the root's (accumulating through backward, reduced last), and the reduction buffers
  of both, which the pool keeps from one reduction to the next: one rank-major buffer (in the reduce dtype) per
  reduction on NCCL (what is reduce-scattered) and on gloo's point-to-point path with more than two ranks (what is
  received), two on gloo above ``POINT_TO_POINT_MAX_RANKS`` (what ``all_to_all`` sends and receives), none on two
  gloo ranks (the rows are received straight into the shards' gradient memory).

Measured against simulated ranks of the 1B GPT (docs/benchmarks.md, "Scaling the world size"); activations come on
top and are not estimated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_shard.engine.collectives import CollectivePath, collective_path
from lightning_shard.engine.mixed_precision import check_precision, mixed_precision_for, parse_dtype, true_dtype_for
from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.parallel.dims import ParallelDims
from lightning_shard.engine.parallel.tensor import hf_tensor_parallel_plan, planned_local_shapes
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.planning import plan_units
from lightning_shard.engine.policies import WrapPolicySpec, resolve_wrap_policy

_STATE_TENSORS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}  # per-parameter tensors of the param's shape
Backend = Literal["nccl", "gloo"]
_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per rank; ``model_state`` is what ``strategy.memory_report().sharded.total`` measures on rank 0
    (other ranks hold the same padded shards, and no more optimizer state: only their real rows have any).
    ``gathered_peak`` and ``temporaries`` are what a training step holds beside it at its peak (see [Note: what a
    step holds beside the model state]); activations are not included."""

    parameters: int
    gradients: int
    optimizer_state: int
    gathered_peak: int  # the root unit, the two largest other units in flight and a third unit-sized block
    largest_unit: str
    cpu_offload: bool = False  # model state in CPU memory; only the gathered units on the device
    temporaries: int = 0  # unsharded gradients being reduced and the reductions' buffers

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def step_buffers(self) -> int:
        """What a training step holds beside the model state at its peak: gathered units and temporaries."""
        return self.gathered_peak + self.temporaries

    @property
    def total(self) -> int:
        return self.model_state + self.step_buffers

    @property
    def device_total(self) -> int:
        """Bytes on the training device: everything, or with ``cpu_offload`` only the step's buffers."""
        return self.step_buffers if self.cpu_offload else self.total

    @property
    def host_total(self) -> int:
        """Bytes in CPU memory because of offloading (``cpu_offload``): the model state."""
        return self.model_state if self.cpu_offload else 0

    def __str__(self) -> str:
        mib = 2**20
        where = f"; in CPU memory {self.host_total / mib:.1f} MiB; on the device" if self.cpu_offload else ";"
        return (
            f"per rank: parameters {self.parameters / mib:.1f} MiB, gradients {self.gradients / mib:.1f} MiB,"
            f" optimizer {self.optimizer_state / mib:.1f} MiB, gathered units (peak) {self.gathered_peak / mib:.1f}"
            f" MiB [largest unit: {self.largest_unit or '<root>'}], gradients in reduction and their buffers"
            f" {self.temporaries / mib:.1f} MiB{where} total {self.device_total / mib:.1f} MiB"
            f" (activations not included)"
        )


@dataclass(frozen=True)
class _UnitBytes:
    """One unit's buffers in a step: ``gathered`` its full weights (compute dtype, padded), ``gradients`` its
    unsharded gradients (compute dtype), ``reduced`` one rank-major reduction buffer (reduce dtype, padded, with the
    "was used" flags)."""

    name: str
    gathered: int
    gradients: int
    reduced: int


def estimate_memory(
    model: nn.Module,
    world_size: int,
    sharding_strategy: ShardingStrategy | str = "FULL_SHARD",
    precision: str = "32-true",
    optimizer: str = "adamw",
    auto_wrap_policy: WrapPolicySpec = None,
    device_mesh: tuple[int, int] | None = None,
    cpu_offload: bool = False,
    backend: Backend = "nccl",
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: dict[str, Any] | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of parameter shards, gradient shards, optimizer state, gathered units and the step's gradient
    reduction buffers for ``model``; with ``cpu_offload`` the model state is counted as CPU memory and only the step's
    buffers as device memory. ``backend``: the process group's, ``"nccl"`` (GPUs) or ``"gloo"`` (CPUs), whose
    collectives hold different buffers (see [Note: what a step holds beside the model state]).

    With ``tensor_parallel_size = T > 1`` the data-parallel ranks are ``world_size / T`` and the parameters the
    ``tensor_parallel_plan`` (as ``parallelize_module`` takes it; by default the plan a Hugging Face model's config
    carries) splits count with their local shapes."""
    strategy = ShardingStrategy.parse(sharding_strategy)
    # HYBRID_SHARD without device_mesh: as on one node, shards over every data-parallel rank
    dims = ParallelDims.of_world(world_size, tensor=tensor_parallel_size, strategy=strategy, device_mesh=device_mesh,
                                 num_nodes=1)  # fmt: skip
    local_shapes: dict[int, torch.Size] = {}
    if tensor_parallel_size != 1:
        if tensor_parallel_plan is None:
            tensor_parallel_plan = hf_tensor_parallel_plan(model)
        local_shapes = planned_local_shapes(model, tensor_parallel_plan, tensor_parallel_size)
    if optimizer not in _STATE_TENSORS:
        raise ValueError(f"Unknown optimizer {optimizer!r}. Valid values are: {', '.join(_STATE_TENSORS)}.")
    if backend not in _BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}. Valid values are: {', '.join(_BACKENDS)}.")
    shard_size, data_parallel = dims.shard, dims.column_size
    check_precision(precision)
    true_dtype = true_dtype_for(precision)
    mixed = mixed_precision_for(precision)
    params = grads = state = 0
    units: list[_UnitBytes] = []
    for name, _, owned in plan_units(model, resolve_wrap_policy(auto_wrap_policy)):
        unit_full = unit_grads = reduced = trainable = 0
        for use, param in owned:
            dtype = true_dtype or param.dtype
            shape = local_shapes.get(id(param), param.shape)
            sp = ShardedParam(use.fqns, use.owners, shape, dtype, param.requires_grad, shard_size, 0)
            compute = (parse_dtype(mixed.param_dtype) if mixed else None) or dtype
            reduce = (parse_dtype(mixed.reduce_dtype) if mixed else None) or dtype
            params += sp.padded_shard_numel * dtype.itemsize
            unit_full += sp.padded_shard_numel * shard_size * compute.itemsize
            if param.requires_grad:
                trainable += 1
                grads += sp.padded_shard_numel * dtype.itemsize
                unit_grads += sp.numel * compute.itemsize
                reduced += (sp.padded_shard_numel + 1) * shard_size * reduce.itemsize  # its rows and its flag
                local = math.ceil(sp.rows / shard_size) * sp.row_numel  # rank 0 holds the most rows
                state += _STATE_TENSORS[optimizer] * local * dtype.itemsize + (4 if optimizer.startswith("adam") else 0)
        if trainable and data_parallel > 1:  # the "was used" flags, kept with the reduced gradients (none on one rank)
            grads += trainable * dtype.itemsize
        units.append(_UnitBytes(name, unit_full, unit_grads, reduced))
    gathers = not (shard_size == 1 and not mixed and not cpu_offload)
    gathered, largest = _gathered_peak(units, strategy, gathers)
    temporaries = _temporaries(units, data_parallel, _reduction_buffers(backend, shard_size))
    return MemoryEstimate(params, grads, state, gathered, largest, cpu_offload, temporaries)


def _gathered_peak(units: list[_UnitBytes], strategy: ShardingStrategy, gathers: bool) -> tuple[int, str]:
    """The gathered units at a step's peak, and the largest unit's name (see [Note: what a step holds beside the
    model state])."""
    root, others = units[0], sorted(units[1:], key=lambda u: -u.gathered)
    largest = max(units, key=lambda u: u.gathered) if units else root
    if not gathers:
        return 0, largest.name
    if not strategy.reshards_after_forward:  # every unit stays gathered from its forward to its backward
        return sum(u.gathered for u in units) + (others[0].gathered if others else 0), largest.name
    first = others[0].gathered if others else 0
    second = others[1].gathered if len(others) > 1 else 0
    return root.gathered + 2 * first + second, largest.name


def _temporaries(units: list[_UnitBytes], world_size: int, buffers: int) -> int:
    """The unsharded gradients and reduction buffers at a step's peak: the root's (reduced last, its gradients
    accumulate through backward) and the largest of another unit's."""
    if world_size == 1:  # the gradients become the shards' gradients as they are: counted in ``gradients``
        return 0
    root, others = units[0], units[1:]
    other = max((u.gradients + buffers * u.reduced for u in others), default=0)
    return root.gradients + buffers * root.reduced + other


def _reduction_buffers(backend: Backend, shard_size: int) -> int:
    """How many rank-major reduction buffers a unit's gradient reduction holds (see [Note: what a step holds beside
    the model state])."""
    if shard_size == 1:  # replicas only: one buffer, all-reduced in place
        return 1
    device = torch.device("cpu" if backend == "gloo" else "cuda")
    match collective_path(backend, device, shard_size):
        case CollectivePath.POINT_TO_POINT:
            return 1 if shard_size > 2 else 0  # two ranks: received straight into the shards' gradient memory
        case CollectivePath.ALL_TO_ALL:
            return 2  # what is sent and what is received
        case CollectivePath.FLAT:
            return 1  # what is reduce-scattered; the result lands in the shards' gradient memory
    raise AssertionError(backend)
