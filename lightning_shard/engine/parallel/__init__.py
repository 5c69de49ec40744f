"""The parallel dimensions: one owner of the layout (``dims``: the sizes of pipeline x data x context x tensor
ranks, their checks, the ``DeviceMesh``, the process groups and every rank question; see [Note: the parallel
layout]), one entry point that applies them to a module in a fixed order (``apply``: the pipeline stage, the
shards, the tied weights, the context-parallel steps), and one module per dimension that is not the sharding itself
(``pipeline``: the stages and their schedule; ``context``: the sequence split over the context-parallel ranks, and
``ulysses``: the attention that sees the whole sequence anyway). Tensor parallelism predates this package and lives
in ``parallel/tensor.py``: the user's plan is applied before the engine shards.
"""

from lightning_shard.engine.parallel.context import ContextParallel, ContextParallelError
from lightning_shard.engine.parallel.dims import ParallelDims

__all__ = ["ContextParallel", "ContextParallelError", "ParallelDims"]
