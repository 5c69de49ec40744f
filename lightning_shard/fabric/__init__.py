"""lightning_shard for Lightning Fabric: ``ShardStrategy`` and its precision plugin.

    import lightning as L
    from lightning_shard.fabric import ShardStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardStrategy(auto_wrap_policy={Block}))

Importing ``lightning_shard`` registers the strategy names (``"shard"``, ``"shard_grad_op"``, ``"shard_hybrid"``,
``"shard_offload"``) in Fabric's registry too, so ``Fabric(strategy="shard")`` works. Both names are imported from
their modules when first read, so importing this package imports no Lightning (``lightning_shard.lazy``).
"""

from typing import TYPE_CHECKING

from lightning_shard.lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_shard.fabric.precision import ShardPrecision
    from lightning_shard.fabric.strategy import ShardStrategy
else:
    __getattr__, __dir__ = lazy_attributes(__name__, {
        "ShardPrecision": "lightning_shard.fabric.precision",
        "ShardStrategy": "lightning_shard.fabric.strategy",
    })

__all__ = ["ShardPrecision", "ShardStrategy"]
