"""lightning_shard for Lightning Fabric: ``ShardStrategy`` and its precision plugin.

    import lightning as L
    from lightning_shard.fabric import ShardStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardStrategy(auto_wrap_policy={Block}))

Importing ``lightning_shard`` registers the strategy names (``"shard"``, ``"shard_grad_op"``, ``"shard_hybrid"``,
``"shard_offload"``) in Fabric's registry too, so ``Fabric(strategy="shard")`` works.
"""

from lightning_shard.fabric.precision import ShardPrecision
from lightning_shard.fabric.strategy import ShardStrategy

__all__ = ["ShardPrecision", "ShardStrategy"]
