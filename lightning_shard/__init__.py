"""lightning_shard: fully sharded data parallel training as a PyTorch Lightning strategy.

Importing the package registers the strategy names ``"shard"``, ``"shard_grad_op"``, ``"shard_hybrid"`` and
``"shard_offload"`` with Lightning's Trainer and Fabric, so ``Trainer(strategy="shard")`` and
``Fabric(strategy="shard")`` work. The Fabric strategy is ``lightning_shard.fabric.ShardStrategy``.

Importing it imports neither torch nor Lightning: each name below is imported from its module when first read
(``lightning_shard.lazy``), and the names are registered once Lightning is imported (see [Note: registering
without importing Lightning] in ``lightning_shard.registration``).
"""

from typing import TYPE_CHECKING

from lightning_shard.lazy import lazy_attributes
from lightning_shard.registration import register_on_import

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lightning_shard.checkpoint.format import CheckpointError
    from lightning_shard.checkpoint.interop.export import ExportResult, GgufExport, LightningExport
    from lightning_shard.checkpoint.interop.gguf import export_gguf, load_gguf_into
    from lightning_shard.checkpoint.interop.hf import consolidate, export_hf, load_safetensors_into
    from lightning_shard.checkpoint.interop.lightning_ckpt import export_lightning
    from lightning_shard.checkpoint.interop.peft import export_peft
    from lightning_shard.checkpoint.load.directory import LoadResult
    from lightning_shard.checkpoint.load.inspect import CheckpointSummary, inspect
    from lightning_shard.data import GlobalBatchLoader, GlobalBatchSampler
    from lightning_shard.engine.estimate import MemoryEstimate, estimate_memory
    from lightning_shard.engine.full_params import summon_full_params
    from lightning_shard.engine.grad_scaler import ShardedGradScaler
    from lightning_shard.engine.memory import MemoryReport, ReplicatedMemoryBytes, ShardMemoryBytes
    from lightning_shard.engine.mixed_precision import MixedPrecision
    from lightning_shard.engine.optimizer_rule import OptimizerUpdate, declare_optimizer_update
    from lightning_shard.engine.option_choices import GradSync, ShardingStrategy
    from lightning_shard.engine.parallel.tensor import hf_tensor_parallel_plan
    from lightning_shard.engine.policies import CallableWrapPolicy, ModuleClassWrapPolicy, SizeWrapPolicy
    from lightning_shard.engine.stall import StalledRanksError
    from lightning_shard.engine.torch_norms import grad_norm
    from lightning_shard.engine.wrapping import mark_unit
    from lightning_shard.generation import generate
    from lightning_shard.inference import load_from_checkpoint
    from lightning_shard.monitor import ShardMonitor
    from lightning_shard.trainer.precision import ShardPrecision
    from lightning_shard.trainer.strategy import ShardStrategy
else:
    __getattr__, __dir__ = lazy_attributes(__name__, {
        "load_gguf_into": "lightning_shard.checkpoint.interop.gguf",
        "CheckpointError": "lightning_shard.checkpoint.format",
        "LoadResult": "lightning_shard.checkpoint.load.directory",
        "load_safetensors_into": "lightning_shard.checkpoint.interop.hf",
        "CheckpointSummary": "lightning_shard.checkpoint.load.inspect",
        "consolidate": "lightning_shard.checkpoint.interop.hf",
        "inspect": "lightning_shard.checkpoint.load.inspect",
        "ExportResult": "lightning_shard.checkpoint.interop.export",
        "export_hf": "lightning_shard.checkpoint.interop.hf",
        "export_peft": "lightning_shard.checkpoint.interop.peft",
        "GgufExport": "lightning_shard.checkpoint.interop.export",
        "export_gguf": "lightning_shard.checkpoint.interop.gguf",
        "LightningExport": "lightning_shard.checkpoint.interop.export",
        "export_lightning": "lightning_shard.checkpoint.interop.lightning_ckpt",
        "GlobalBatchLoader": "lightning_shard.data",
        "GlobalBatchSampler": "lightning_shard.data",
        "MemoryEstimate": "lightning_shard.engine.estimate",
        "estimate_memory": "lightning_shard.engine.estimate",
        "summon_full_params": "lightning_shard.engine.full_params",
        "ShardedGradScaler": "lightning_shard.engine.grad_scaler",
        "MemoryReport": "lightning_shard.engine.memory",
        "ReplicatedMemoryBytes": "lightning_shard.engine.memory",
        "ShardMemoryBytes": "lightning_shard.engine.memory",
        "MixedPrecision": "lightning_shard.engine.mixed_precision",
        "OptimizerUpdate": "lightning_shard.engine.optimizer_rule",
        "declare_optimizer_update": "lightning_shard.engine.optimizer_rule",
        "CallableWrapPolicy": "lightning_shard.engine.policies",
        "GradSync": "lightning_shard.engine.option_choices",
        "ModuleClassWrapPolicy": "lightning_shard.engine.policies",
        "ShardingStrategy": "lightning_shard.engine.option_choices",
        "SizeWrapPolicy": "lightning_shard.engine.policies",
        "StalledRanksError": "lightning_shard.engine.stall",
        "hf_tensor_parallel_plan": "lightning_shard.engine.parallel.tensor",
        "grad_norm": "lightning_shard.engine.torch_norms",
        "mark_unit": "lightning_shard.engine.wrapping",
        "generate": "lightning_shard.generation",
        "load_from_checkpoint": "lightning_shard.inference",
        "ShardMonitor": "lightning_shard.monitor",
        "ShardPrecision": "lightning_shard.trainer.precision",
        "ShardStrategy": "lightning_shard.trainer.strategy",
    })

register_on_import()

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
    "OptimizerUpdate",
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
    "declare_optimizer_update",
    "estimate_memory",
    "export_gguf",
    "export_hf",
    "export_lightning",
    "export_peft",
    "generate",
    "grad_norm",
    "hf_tensor_parallel_plan",
    "inspect",
    "load_from_checkpoint",
    "load_gguf_into",
    "load_safetensors_into",
    "mark_unit",
    "summon_full_params",
]
