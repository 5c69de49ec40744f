"""The one owner of the parallel layout, as torchtitan's ``parallel_dims.py`` is: the sizes of the parallel
dimensions, their checks and derived defaults, the ``DeviceMesh`` and the members of the process groups they make
(``engine/mesh.py`` creates those groups from them), and every answer to "which rank sits where". Nothing else in
the package computes with ranks: the sampler, the shard and replicate groups, the pipeline stages and the weights
tied across them ask ``ParallelDims``.

[Note: the parallel layout]
The world is the mesh pipeline x data x context x tensor, in that order (``P x D x C x T`` ranks): global rank ``g``
sits at stage ``g // (D * C * T)``, data-parallel rank ``(g // (C * T)) % D``, context-parallel rank ``(g // T) % C``
and tensor-parallel rank ``g % T``. Tensor-parallel ranks are adjacent (the fastest-varying coordinate) and each
stage is a contiguous block of ``D * C * T`` ranks. The batches split over the ``D`` data-parallel ranks: the
``C * T`` ranks of one block see the same batches (the context-parallel ranks then split each batch's sequences),
and so do the stages of one pipeline.

Every sharding strategy is one shape of the same 2-D mesh ``(replicas, shard)`` of the ``D * C`` ranks the engine
shards over (see the next note): ``FULL_SHARD``/``SHARD_GRAD_OP`` are ``(1, D * C)``, ``NO_SHARD`` is ``(D * C, 1)``
and ``HYBRID_SHARD`` is whatever ``device_mesh`` says (the strategies' default: ``(num_nodes, D * C / num_nodes)``,
sharding inside a node and replicating across nodes). The rank at index ``r`` of them sits at row ``r // shard``,
column ``r % shard``: the ranks of one row shard a parameter among themselves (the shard group), the ranks of one
column hold the same shard and all-reduce its gradient (the replicate group).

[Note: the data-parallel ranks under tensor parallelism]
The engine shards each parameter (under tensor parallelism, each rank's part of it) over the ``D * C`` ranks of one
stage and one tensor-parallel coordinate, context-parallel ranks included, as FSDP2 and torchtitan do (see [Note:
context-parallel ranks shard and reduce like data-parallel ones] in ``context.py``). Call them a column: a rank's
index in its column (``column_rank``) is its data-parallel rank in the engine's sense (``ShardMesh.rank``), its
column's groups are groups of global ranks (``grid``), and gradients are averaged over the column only. Initial
values agree with the column's first rank (every column holds other parts of the tensor-parallel parameters, or
other stages). Without tensor, context and pipeline parallelism the column is the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_shard.engine.option_choices import ShardingStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ParallelSizeError(ValueError, RuntimeError):
    """The parallel sizes do not multiply to the world size: a bad argument value (``ValueError``), and the
    ``RuntimeError`` ``ModelParallelStrategy`` raises for it."""


@dataclass(frozen=True)
class ParallelDims:
    """How the world splits (``pipeline * data * context * tensor`` ranks), how the engine shards over the data x
    context ranks (``replicas`` rows), and where global rank ``rank`` sits: see [Note: the parallel layout]. Needs no
    process group; ``of_world`` checks the sizes and fills in the defaults."""

    data: int
    """Ranks that see different batches."""
    context: int = 1
    """Ranks that split each sequence of one batch (context parallelism); 1: none."""
    tensor: int = 1
    """Ranks that split each layer by a tensor-parallel plan; 1: none."""
    pipeline: int = 1
    """Ranks that each hold a stage of the model's blocks (pipeline parallelism); 1: none."""
    replicas: int = 1
    """Rows of the sharding mesh of the ``data * context`` ranks: 1 shards over all of them (``FULL_SHARD``)."""
    rank: int = 0
    """This process's global rank."""

    @classmethod
    def of_world(
        cls, world_size: int, context: int = 1, tensor: int = 1, *, pipeline: int = 1, data: int | None = None,
        strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD, device_mesh: tuple[int, int] | None = None,
        num_nodes: int | None = None, rank: int = 0,
    ) -> ParallelDims:  # fmt: skip
        """The dims filling ``world_size`` ranks: ``data=None`` ("auto") takes the ranks the other sizes leave, and
        ``HYBRID_SHARD`` without ``device_mesh`` shards inside each of ``num_nodes`` nodes (when given) and replicates
        across them. Raises ``ParallelSizeError`` for sizes whose product is not ``world_size``, ``ValueError`` for
        a ``device_mesh`` that does not fit; checks only, so every rank can call it before any collective."""
        others = pipeline * context * tensor
        if min(pipeline, context, tensor, data or 1) < 1 or (data or world_size // others) * others != world_size:
            raise ParallelSizeError(_size_message(world_size, data, context, tensor, pipeline, num_nodes))
        data = data or world_size // others
        sharded = data * context
        if strategy is ShardingStrategy.HYBRID_SHARD and device_mesh is None and num_nodes and sharded % num_nodes == 0:
            device_mesh = (num_nodes, sharded // num_nodes)
        replicas, _ = mesh_shape(strategy, sharded, device_mesh)
        return cls(data, context, tensor, pipeline, replicas, rank)

    # Sizes #

    @property
    def world_size(self) -> int:
        return self.pipeline * self.stage_size

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage (every rank without pipeline parallelism)."""
        return self.data * self.context * self.tensor

    @property
    def column_size(self) -> int:
        """The data x context ranks of one stage and tensor-parallel coordinate, which the engine shards over."""
        return self.data * self.context

    @property
    def shard(self) -> int:
        """The ranks of one shard group: each holds ``1 / shard`` of every parameter."""
        return self.column_size // self.replicas

    # This rank: see [Note: the parallel layout] #

    @property
    def stage(self) -> int:
        return self.rank // self.stage_size

    @property
    def stage_offset(self) -> int:
        """The global rank of the first rank of this rank's stage (0 without pipeline parallelism)."""
        return self.stage * self.stage_size

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def column_rank(self) -> int:
        """This rank's index among the data x context ranks of its column (see [Note: the data-parallel ranks under
        tensor parallelism])."""
        return self.rank % self.stage_size // self.tensor

    @property
    def data_parallel_rank(self) -> int:
        """Which batches this rank sees: the ranks of one context x tensor block see the same ones."""
        return self.column_rank // self.context

    @property
    def shard_rank(self) -> int:
        """This rank's index inside its shard group: which rows of each parameter it holds."""
        return self.column_rank % self.shard

    @property
    def replicate_rank(self) -> int:
        return self.column_rank // self.shard

    @property
    def sampler_kwargs(self) -> dict[str, Any]:
        """``DistributedSampler``'s ``num_replicas`` and ``rank``: the data split over the data-parallel ranks."""
        return {"num_replicas": self.data, "rank": self.data_parallel_rank}

    # Groups, as global ranks. Every rank creates every group, in the order listed (``new_group``'s rule) #

    def grid(self, stage: int | None = None, tensor_rank: int | None = None) -> list[list[int]]:
        """The global ranks of a column (default: this rank's) as its ``(replicas, shard)`` mesh."""
        stage = self.stage if stage is None else stage
        first = stage * self.stage_size + (self.tensor_rank if tensor_rank is None else tensor_rank)
        return [[first + (row * self.shard + col) * self.tensor for col in range(self.shard)]
                for row in range(self.replicas)]  # fmt: skip

    def _grids(self) -> list[list[list[int]]]:
        return [self.grid(stage, t) for stage in range(self.pipeline) for t in range(self.tensor)]

    def shard_groups(self) -> list[list[int]]:
        """Every row of every column."""
        return [row for grid in self._grids() for row in grid]

    def replicate_groups(self) -> list[list[int]]:
        """Every column of every column's mesh."""
        return [list(column) for grid in self._grids() for column in zip(*grid)]

    def column_groups(self) -> list[list[int]]:
        """Every column, whole."""
        return [[r for row in grid for r in row] for grid in self._grids()]

    def pipeline_group(self) -> list[int]:
        """This rank's pipeline group: the rank at its place in every stage, in stage order."""
        place = self.rank - self.stage_offset
        return [stage * self.stage_size + place for stage in range(self.pipeline)]

    def tie_groups(self, stages: tuple[int, ...]) -> list[list[int]]:
        """For a weight tied across ``stages``: its holders at each place in a stage."""
        return [[stage * self.stage_size + place for stage in stages] for place in range(self.stage_size)]

    # Building: collective, every rank in the same order #

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ``DeviceMesh`` a tensor-parallel plan is applied on, ``("data_parallel", "tensor_parallel")`` as
        ``ModelParallelStrategy`` builds it, with ``"context_parallel"`` between them under context or pipeline
        parallelism and ``"pipeline_parallel"`` in front under pipeline parallelism."""
        from torch.distributed.device_mesh import init_device_mesh

        shape: tuple[int, ...] = (self.data, self.tensor)
        names: tuple[str, ...] = ("data_parallel", "tensor_parallel")
        if self.context > 1 or self.pipeline > 1:
            shape, names = (self.data, self.context, self.tensor), ("data_parallel", "context_parallel", *names[1:])
        if self.pipeline > 1:
            shape, names = (self.pipeline, *shape), ("pipeline_parallel", *names)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)


def mesh_shape(strategy: ShardingStrategy, world_size: int, device_mesh: tuple[int, int] | None) -> tuple[int, int]:
    """The ``(replicas, shard_size)`` shape for ``strategy``; raises ``ValueError`` if ``device_mesh`` cannot fit."""
    if device_mesh is not None:
        if (
            not isinstance(device_mesh, (tuple, list))
            or len(device_mesh) != 2
            or not all(isinstance(n, int) and n > 0 for n in device_mesh)
        ):
            raise ValueError(
                f"device_mesh must be a pair of positive ints (replicas, shard_size), got {device_mesh!r}."
            )
        replicas, shard_size = device_mesh
        if replicas * shard_size != world_size:
            raise ValueError(
                f"device_mesh={tuple(device_mesh)} covers {replicas * shard_size} ranks but the world size is"
                f" {world_size}. Choose (replicas, shard_size) with replicas * shard_size == {world_size}."
            )
    match strategy:
        case ShardingStrategy.FULL_SHARD | ShardingStrategy.SHARD_GRAD_OP:
            if device_mesh is not None and device_mesh[0] != 1:
                raise ValueError(
                    f"device_mesh={tuple(device_mesh)} replicates across {device_mesh[0]} groups, which only"
                    f" HYBRID_SHARD does; use sharding_strategy='HYBRID_SHARD' or drop device_mesh."
                )
            return 1, world_size
        case ShardingStrategy.NO_SHARD:
            return world_size, 1
        case ShardingStrategy.HYBRID_SHARD:
            if device_mesh is None:
                raise ValueError(
                    "HYBRID_SHARD needs device_mesh=(replicas, shard_size), e.g. (num_nodes, devices_per_node)."
                )
            return int(device_mesh[0]), int(device_mesh[1])
    raise AssertionError(strategy)


def _size_message(
    world: int, data: int | None, context: int, tensor: int, pipeline: int, num_nodes: int | None
) -> str:
    sizes = (f" x `pipeline_parallel_size={pipeline}`" if pipeline > 1 else "") + (
        f" x `context_parallel_size={context}`" if context > 1 else ""
    )
    choose = f"With num_nodes={num_nodes} x devices={world // num_nodes}, choose" if num_nodes else "Choose"
    return (
        f"The sizes `data_parallel_size={data or 'auto'}`{sizes} and `tensor_parallel_size={tensor}` multiplied"
        f" should equal the world size ({world}). {choose} sizes whose product is {world}, or leave"
        f" data_parallel_size='auto' with sizes whose product divides {world}."
    )
