"""The parallel dimensions beyond sharding: the mesh of data x context x tensor ranks (``dims``) and one module per
dimension that is not the sharding itself (``context``: the sequence split over the context-parallel ranks, and
``ulysses``: the attention that sees the whole sequence anyway). Tensor parallelism predates this package and lives
in ``engine/tensor_parallel.py``.

The order is fixed and visible in ``ParallelDims``: global rank ``g`` sits at data-parallel rank ``g // (C * T)``,
context-parallel rank ``(g // T) % C`` and tensor-parallel rank ``g % T``. The engine shards each parameter (each
rank's tensor-parallel part of it) over the ``D * C`` ranks of one tensor-parallel coordinate, context-parallel
ranks included, as FSDP2 and torchtitan do: see [Note: context-parallel ranks shard and reduce like data-parallel
ones] in ``context.py``.
"""

from lightning_shard.engine.parallel.context import ContextParallel, ContextParallelError
from lightning_shard.engine.parallel.dims import ParallelDims

__all__ = ["ContextParallel", "ContextParallelError", "ParallelDims"]
