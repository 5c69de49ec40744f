"""The strategy names both front ends register in Lightning's strategy registries (``Trainer(strategy="shard")``,
``Fabric(strategy="shard")``), and the function that registers them. ``lightning_shard.registration`` registers
them when Lightning is imported, without importing it (see [Note: registering without importing Lightning] there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry

SHARD_STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "shard": ("Fully sharded data parallel (ZeRO-3) on CPU or GPU", {"sharding_strategy": "FULL_SHARD"}),
    "shard_grad_op": ("Sharded gradients and optimizer state (ZeRO-2)", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "shard_hybrid": ("Sharded within groups, replicated across them", {"sharding_strategy": "HYBRID_SHARD"}),
    "shard_offload": (
        "Fully sharded, with shards and optimizer state in CPU memory",
        {"sharding_strategy": "FULL_SHARD", "cpu_offload": True},
    ),
}


def register_shard_strategies(registry: _StrategyRegistry, strategy_class: Callable[..., Any]) -> list[str]:
    """Register ``strategy_class`` under every name of ``SHARD_STRATEGY_NAMES`` not taken yet; return those added."""
    import torch.distributed as dist

    if not dist.is_available():
        return []
    added = []
    for name, (description, init_kwargs) in SHARD_STRATEGY_NAMES.items():
        if name in registry:
            continue
        registry.register(name, strategy_class, description=description, **init_kwargs)
        added.append(name)
    return added


