"""lightning_shard: fully sharded data parallel training as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"shard"``, ``"shard_grad_op"`` and
``"shard_hybrid"`` with Lightning, so ``Trainer(strategy="shard")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_shard.checkpoint_format import CheckpointError
from lightning_shard.checkpoint_load import LoadResult, load_safetensors_into
from lightning_shard.consolidate import CheckpointSummary, consolidate, inspect
from lightning_shard.estimate import MemoryEstimate, estimate_memory
from lightning_shard.memory import MemoryReport, ReplicatedMemoryBytes, ShardMemoryBytes
from lightning_shard.mixed_precision import MixedPrecision
from lightning_shard.monitor import ShardMonitor
from lightning_shard.policies import (
    CallableWrapPolicy,
    GradSync,
    ModuleClassWrapPolicy,
    ShardingStrategy,
    SizeWrapPolicy,
)
from lightning_shard.precision import ShardedGradScaler, ShardPrecision
from lightning_shard.strategy import ShardStrategy

__version__ = "0.1.0"

ShardStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "CallableWrapPolicy",
    "CheckpointError",
    "CheckpointSummary",
    "LoadResult",
    "MemoryEstimate",
    "GradSync",
    "MemoryReport",
    "MixedPrecision",
    "ModuleClassWrapPolicy",
    "ReplicatedMemoryBytes",
    "ShardMemoryBytes",
    "ShardMonitor",
    "ShardPrecision",
    "ShardStrategy",
    "ShardedGradScaler",
    "ShardingStrategy",
    "SizeWrapPolicy",
    "__version__",
    "consolidate",
    "estimate_memory",
    "inspect",
    "load_safetensors_into",
]
