"""Memory estimates per rank from a model's shapes alone (build it on the meta device: nothing is allocated).

    from lightning_shard import estimate_memory

    with torch.device("meta"):
        model = GPT()
    print(estimate_memory(model, world_size=8, auto_wrap_policy={"Block"}, precision="bf16-mixed"))

The estimate follows the engine's own layout: dim-0 shards padded to ``ceil(rows / shard_size)``
rows, tied weights stored once, parameters owned by the unit that encloses all their uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from lightning_shard.engine.mesh import mesh_shape
from lightning_shard.engine.mixed_precision import check_precision, mixed_precision_for, parse_dtype, true_dtype_for
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.planning import plan_units
from lightning_shard.engine.policies import ShardingStrategy, WrapPolicySpec, resolve_wrap_policy

_STATE_TENSORS = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}  # per-parameter tensors of the param's shape


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes per rank; ``model_state`` is what ``strategy.memory_report().sharded.total`` measures on rank 0
    (other ranks hold the same padded shards, and no more optimizer state: only their real rows have any)."""

    parameters: int
    gradients: int
    optimizer_state: int
    gathered_peak: int  # full weights of the two largest units in flight plus one all-gather buffer
    largest_unit: str
    cpu_offload: bool = False  # model state in CPU memory; only the gathered units on the device

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        return self.model_state + self.gathered_peak

    @property
    def device_total(self) -> int:
        """Bytes on the training device: everything, or with ``cpu_offload`` only the gathered units."""
        return self.gathered_peak if self.cpu_offload else self.total

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
            f" MiB [largest unit: {self.largest_unit or '<root>'}]{where} total {self.device_total / mib:.1f} MiB"
            f" (activations not included)"
        )


def estimate_memory(
    model: nn.Module,
    world_size: int,
    sharding_strategy: ShardingStrategy | str = "FULL_SHARD",
    precision: str = "32-true",
    optimizer: str = "adamw",
    auto_wrap_policy: WrapPolicySpec = None,
    device_mesh: tuple[int, int] | None = None,
    cpu_offload: bool = False,
) -> MemoryEstimate:
    """Per-rank bytes of parameter shards, gradient shards, optimizer state and gathered units for ``model``; with
    ``cpu_offload`` the model state is counted as CPU memory and only the gathered units as device memory."""
    strategy = ShardingStrategy.parse(sharding_strategy)
    if optimizer not in _STATE_TENSORS:
        raise ValueError(f"Unknown optimizer {optimizer!r}. Valid values are: {', '.join(_STATE_TENSORS)}.")
    if strategy is ShardingStrategy.HYBRID_SHARD and device_mesh is None:
        device_mesh = (1, world_size)
    _, shard_size = mesh_shape(strategy, world_size, device_mesh)
    check_precision(precision)
    true_dtype = true_dtype_for(precision)
    mixed = mixed_precision_for(precision)
    params = grads = state = 0
    unit_sizes: list[tuple[int, str]] = []
    for name, _, owned in plan_units(model, resolve_wrap_policy(auto_wrap_policy)):
        unit_full = 0
        trainable = 0
        for use, param in owned:
            dtype = true_dtype or param.dtype
            sp = ShardedParam(use.fqns, use.owners, param.shape, dtype, param.requires_grad, shard_size, 0)
            compute = (parse_dtype(mixed.param_dtype) if mixed else None) or dtype
            params += sp.padded_shard_numel * dtype.itemsize
            unit_full += sp.padded_shard_numel * shard_size * compute.itemsize
            if param.requires_grad:
                trainable += 1
                grads += sp.padded_shard_numel * dtype.itemsize
                local = math.ceil(sp.rows / shard_size) * sp.row_numel  # rank 0 holds the most rows
                state += _STATE_TENSORS[optimizer] * local * dtype.itemsize + (4 if optimizer.startswith("adam") else 0)
        if trainable and world_size > 1:  # the "was used" flags, kept with the reduced gradients (none on one rank)
            grads += trainable * dtype.itemsize
        unit_sizes.append((unit_full, name))
    unit_sizes.sort(reverse=True)
    largest = unit_sizes[0] if unit_sizes else (0, "")
    second = unit_sizes[1][0] if len(unit_sizes) > 1 else 0
    gathered = 0 if shard_size == 1 and not mixed and not cpu_offload else 2 * largest[0] + second
    return MemoryEstimate(params, grads, state, gathered, largest[1], cpu_offload)
