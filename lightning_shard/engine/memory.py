"""What this rank's model state costs, counted from the tensors that exist, against full replication."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor
from torch.optim import Optimizer

from lightning_shard.engine.sharded_module import ShardedModule


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


@dataclass(frozen=True)
class ShardMemoryBytes(ModelStateBytes):
    """Bytes this rank holds for its shards (padding included)."""


@dataclass(frozen=True)
class ReplicatedMemoryBytes(ModelStateBytes):
    """Bytes the same model state would take on one rank without sharding (as with DDP)."""


@dataclass(frozen=True)
class MemoryReport:
    """``strategy.memory_report()``: this rank's sharded model state next to full replication."""

    rank: int
    sharded: ShardMemoryBytes
    replicated: ReplicatedMemoryBytes

    @property
    def fraction_of_replicated(self) -> float:
        return self.sharded.total / self.replicated.total if self.replicated.total else 0.0

    def __str__(self) -> str:
        s, r = self.sharded, self.replicated
        return (
            f"params {_mb(s.parameters)} / {_mb(r.parameters)}, grads {_mb(s.gradients)} / {_mb(r.gradients)},"
            f" optimizer {_mb(s.optimizer_state)} / {_mb(r.optimizer_state)}"
            f" (sharded / replicated; total {self.fraction_of_replicated:.1%} of replicated)"
        )


def memory_report(engine: ShardedModule, optimizers: Iterable[Optimizer], rank: int) -> MemoryReport:
    """Count the bytes of the sharded parameters, their gradients and the optimizer state on this rank. Gradients
    are the memory this rank holds for them: each unit's gradient buffer once it has one (kept through
    ``zero_grad()``, see [Note: the buffer pool]), and any other ``.grad`` of a shard."""
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    param_storages = {u.flat_sharded.untyped_storage().data_ptr(): u.flat_sharded.nbytes for u in engine.units}
    grads = [p.sharded.grad for p in by_shard.values() if p.sharded.grad is not None]
    # The gradient memory a unit keeps from its first reduction on: still held after zero_grad() sets .grad to None
    # (the next reduction lands in it), so it counts whether or not a .grad views it now.
    grads += [u.sharded_grads for u in engine.units if u.sharded_grads is not None]
    full_params = sum(p.numel * p.sharded.element_size() for p in by_shard.values())
    full_grads = sum(p.numel * p.sharded.element_size() for p in by_shard.values() if p.requires_grad)
    full_state_bytes = 0
    state_tensors: list[Tensor] = []
    for optimizer in optimizers:
        for shard, state in optimizer.state.items():
            p = by_shard.get(id(shard))
            for value in state.values():
                if not isinstance(value, Tensor):
                    continue
                state_tensors.append(value)
                if p is not None and value.shape == shard.shape and value.dim() > 0:
                    full_state_bytes += p.numel * value.element_size()
                else:
                    full_state_bytes += value.nbytes
    state_bytes = _unique_storage_bytes(state_tensors)
    return MemoryReport(
        rank=rank,
        sharded=ShardMemoryBytes(sum(param_storages.values()), _unique_storage_bytes(grads), state_bytes),
        replicated=ReplicatedMemoryBytes(full_params, full_grads, full_state_bytes),
    )


def _unique_storage_bytes(tensors: Iterable[Tensor]) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
