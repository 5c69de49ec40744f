"""lightning_shard for the Lightning ``Trainer``: ``ShardStrategy`` and its precision plugin ``ShardPrecision``
(both also importable from ``lightning_shard``), and ``Preempted``, what ``fit`` raises after a preemption."""

from lightning_shard.trainer.precision import ShardPrecision
from lightning_shard.trainer.preemption import Preempted
from lightning_shard.trainer.strategy import ShardStrategy

__all__ = ["Preempted", "ShardPrecision", "ShardStrategy"]
