"""lightning_shard for the Lightning ``Trainer``: ``ShardStrategy`` and its precision plugin ``ShardPrecision``
(both also importable from ``lightning_shard``), and ``Preempted``, what ``fit`` raises after a preemption. Each is
imported from its module when first read, so importing this package imports no Lightning (``lightning_shard.lazy``).
"""

from typing import TYPE_CHECKING

from lightning_shard.lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_shard.trainer.precision import ShardPrecision
    from lightning_shard.trainer.preemption import Preempted
    from lightning_shard.trainer.strategy import ShardStrategy
else:
    __getattr__, __dir__ = lazy_attributes(__name__, {
        "Preempted": "lightning_shard.trainer.preemption",
        "ShardPrecision": "lightning_shard.trainer.precision",
        "ShardStrategy": "lightning_shard.trainer.strategy",
    })

__all__ = ["Preempted", "ShardPrecision", "ShardStrategy"]
