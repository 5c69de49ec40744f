"""lightning_shard: fully sharded data parallel training as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"shard"``, ``"shard_grad_op"``, ``"shard_hybrid"`` and
``"shard_offload"`` with Lightning's Trainer and Fabric, so ``Trainer(strategy="shard")`` and
``Fabric(strategy="shard")`` work. The Fabric strategy is ``lightning_shard.fabric.ShardStrategy``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_shard.checkpoint.foreign.gguf import load_gguf_into
from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.load.load import LoadResult, load_safetensors_into
from lightning_shard.checkpoint.tools.consolidate import CheckpointSummary, consolidate, inspect
from lightning_shard.checkpoint.tools.export import ExportResult, export_hf, export_peft
from lightning_shard.checkpoint.tools.gguf_export import GgufExport, export_gguf
from lightning_shard.checkpoint.tools.lightning_export import LightningExport, export_lightning
from lightning_shard.data import GlobalBatchLoader, GlobalBatchSampler
from lightning_shard.engine.estimate import MemoryEstimate, estimate_memory
from lightning_shard.engine.full_params import summon_full_params
from lightning_shard.engine.grad_scaler import ShardedGradScaler
from lightning_shard.engine.memory import MemoryReport, ReplicatedMemoryBytes, ShardMemoryBytes
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.policies import (
    CallableWrapPolicy,
    GradSync,
    ModuleClassWrapPolicy,
    ShardingStrategy,
    SizeWrapPolicy,
)
from lightning_shard.engine.stall import StalledRanksError
from lightning_shard.engine.tensor_parallel import hf_tensor_parallel_plan
from lightning_shard.engine.wrapping import mark_unit
from lightning_shard.fabric import ShardStrategy as _FabricShardStrategy
from lightning_shard.generation import generate
from lightning_shard.inference import load_from_checkpoint
from lightning_shard.monitor import ShardMonitor
from lightning_shard.trainer.precision import ShardPrecision
from lightning_shard.trainer.strategy import ShardStrategy

__version__ = "0.1.0"

ShardStrategy.register_strategies(StrategyRegistry)
_FabricShardStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "CallableWrapPolicy",
    "CheckpointError",
    "CheckpointSummary",
    "ExportResult",
    "GgufExport",
    "GlobalBatchLoader",
    "GlobalBatchSampler",
    "LoadResult",
    "MemoryEstimate",
    "GradSync",
    "LightningExport",
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
    "StalledRanksError",
    "__version__",
    "consolidate",
    "estimate_memory",
    "export_gguf",
    "export_hf",
    "export_lightning",
    "export_peft",
    "generate",
    "hf_tensor_parallel_plan",
    "inspect",
    "load_from_checkpoint",
    "load_gguf_into",
    "load_safetensors_into",
    "mark_unit",
    "summon_full_params",
]
