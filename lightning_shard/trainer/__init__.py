"""lightning_shard for the Lightning ``Trainer``: ``ShardStrategy`` and its precision plugin ``ShardPrecision``
(both also importable from ``lightning_shard``)."""

from lightning_shard.trainer.precision import ShardPrecision
from lightning_shard.trainer.strategy import ShardStrategy

__all__ = ["ShardPrecision", "ShardStrategy"]
