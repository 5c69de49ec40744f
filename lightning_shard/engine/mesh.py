"""The data-parallel layout of ranks: who shards with whom, and who replicates with whom.

Every sharding strategy is one shape of the same 2-D mesh ``(replicas, shard_size)``:
``FULL_SHARD``/``SHARD_GRAD_OP`` are ``(1, world)``, ``NO_SHARD`` is ``(world, 1)`` and
``HYBRID_SHARD`` is whatever ``device_mesh`` says. Rank ``r`` sits at row ``r // shard_size``,
column ``r % shard_size``: the ranks of one row shard a parameter among themselves (the shard
group), the ranks of one column hold the same shard and all-reduce its gradient (the replicate group).

[Note: the DeviceMesh of a ShardMesh]
State dicts hand out shards as ``DTensor``s, which need the mesh as a ``torch.distributed`` ``DeviceMesh``.
``ShardMesh.device_mesh`` builds it from the process groups the mesh already has (``DeviceMesh.from_group``:
no new communicator for an axis that communicates), in the shape FSDP2 uses for the same layout:
``FULL_SHARD``/``SHARD_GRAD_OP`` a 1-D mesh ``("shard",)`` over the shard group, ``NO_SHARD`` a 1-D mesh
``("replicate",)`` over the replicate group (either one the default group at world size 1), ``HYBRID_SHARD``
the 2-D mesh ``("replicate", "shard")`` of shape ``(replicas, shard_size)`` that ``device_mesh`` named. An
axis of size 1 of that 2-D mesh has no group here, so this rank gets a group of its own for it, created
locally (``use_local_synchronization``: no other rank takes part). It is built on first use, cached, rebuilt if
the groups change (``ShardedModule.rebind_mesh``), and dropped with the groups it created by ``destroy()``.
With tensor parallelism the mesh spans the data-parallel ranks of this rank's tensor-parallel coordinate (see
[Note: the data-parallel ranks under tensor parallelism]), and its axes are groups of those ranks. A
model outlives its run: the Trainer's teardown destroys the groups this mesh created, while state dicts may still be
read after ``fit`` returned. A ``DTensor`` finds its groups by name, so a destroyed group is replaced by a new group
of the same ranks, created by its members alone; state-dict reads are collective, so every member builds the mesh
at the same point, in the same order (the replicate axis first).

[Note: the data-parallel ranks under tensor parallelism]
With ``tensor_parallel_size = T > 1`` the world is the 2-D mesh ``(data_parallel, tensor_parallel)`` that
Lightning's ``ModelParallelStrategy`` builds: global rank ``g`` sits at data-parallel rank ``g // T`` and
tensor-parallel rank ``g % T``. The tensor-parallel plan splits each layer over the ``T`` ranks of one row; the
engine shards each rank's part over the ranks of its column, so a ``ShardMesh`` is the mesh above over those
``world / T`` data-parallel ranks: ``rank`` and ``world_size`` count data-parallel ranks, its groups are groups of
the column's global ranks (``global_rank``), and gradients are averaged over the column only. Initial values agree
with data-parallel rank 0 of the column (every column holds other parts of the tensor-parallel parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_shard.engine.option_choices import ShardingStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_shard.engine.parallel.context import ContextParallel
    from lightning_shard.engine.parallel.pipeline_ranks import PipelineRanks


@dataclass
class ShardMesh:
    """This rank's place in the ``(replicas, shard_size)`` mesh and the process groups along each axis.

    A group is ``None`` when its axis has size 1 (nothing to communicate). With tensor parallelism, ``rank`` and
    ``world_size`` count the data-parallel ranks of this rank's column (see [Note: the data-parallel ranks under
    tensor parallelism]).
    """

    rank: int
    world_size: int
    replicas: int
    shard_size: int
    shard_group: ProcessGroup | None
    replicate_group: ProcessGroup | None
    # The groups created here that this rank is a member of (its shard and replicate groups), destroyed by
    # ``destroy()``. The groups of other rows and columns are created too (every rank must call ``new_group`` for
    # each), but this rank holds only a placeholder for them: no timeout to set, nothing to destroy.
    owned_groups: list[ProcessGroup] = field(default_factory=list)
    shard_backend: str | None = None  # the shard group's backend, recorded while the group is registered
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    # Every data-parallel rank of this column, when neither axis is all of them (HYBRID_SHARD under tensor
    # parallelism) or the column is this rank alone (one data-parallel rank); see ``data_parallel_group``.
    column_data_parallel_group: ProcessGroup | None = None
    # The tensor-parallel group, and the sharded faces holding rows of one tensor-parallel part (ids), which the
    # global gradient norm sums over that group; set by ``shard_module``.
    tensor_parallel_group: ProcessGroup | None = None
    tensor_parallel_parts: set[int] = field(default_factory=set)
    tensor_parallel_root: DeviceMesh | None = None  # the plan's ("data_parallel", "tensor_parallel") mesh
    # The context-parallel group whose ranks split each sequence (they are among this mesh's ranks, which shard and
    # reduce over them as over data-parallel ones); ``None`` without context parallelism.
    context_parallel: ContextParallel | None = None
    # This rank's pipeline group (the mesh's ranks are those of one stage); ``None`` without pipeline parallelism.
    pipeline_parallel_size: int = 1
    pipeline: PipelineRanks | None = None
    stage_offset: int = 0  # the global rank of the stage's first rank
    _device_mesh: _DeviceMeshCache | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shard_rank(self) -> int:
        """This rank's index inside its shard group: which rows of each parameter it holds."""
        return self.rank % self.shard_size

    @property
    def replicate_rank(self) -> int:
        return self.rank // self.shard_size

    def global_rank(self, data_parallel_rank: int) -> int:
        """The global rank of data-parallel rank ``data_parallel_rank`` of this rank's column."""
        return self.stage_offset + data_parallel_rank * self.tensor_parallel_size + self.tensor_parallel_rank

    @property
    def data_parallel_group(self) -> ProcessGroup | None:
        """Every data-parallel rank of this rank's column (``None``: the default group, without tensor parallelism).
        """
        if self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1:
            return None
        if self.replicas == 1 and self.shard_size > 1:
            return self.shard_group
        if self.shard_size == 1 and self.replicas > 1:
            return self.replicate_group
        return self.column_data_parallel_group  # never None here: None would mean every rank, all columns

    @property
    def buffer_group(self) -> ProcessGroup | None:
        """The ranks whose buffers agree with their first rank's: every rank (``None``), or under pipeline
        parallelism this stage's data-parallel ranks (each stage holds its own modules' buffers)."""
        return self.data_parallel_group if self.pipeline is not None else None

    def destroy(self) -> None:
        """Destroy the sub-groups this mesh created (never the default group)."""
        self._drop_device_mesh()
        for group in self.owned_groups:
            dist.destroy_process_group(group)
        self.owned_groups.clear()

    # DeviceMesh: see [Note: the DeviceMesh of a ShardMesh] #

    def device_mesh(self, strategy: ShardingStrategy, device_type: str) -> DeviceMesh:
        """This mesh as a ``DeviceMesh`` for ``device_type`` (``"cpu"``, ``"cuda"``) with dimension names
        ``"shard"`` and/or ``"replicate"``; built from the existing groups on first use and cached. Not a collective.
        """
        groups = (self.shard_group, self.replicate_group)
        cached = self._device_mesh
        if cached is not None and cached.matches(strategy, device_type, groups):
            return cached.mesh
        self._drop_device_mesh()
        self._device_mesh = _DeviceMeshCache.build(self, strategy, device_type)
        return self._device_mesh.mesh

    def _drop_device_mesh(self) -> None:
        cached, self._device_mesh = self._device_mesh, None
        if cached is not None:
            for group in cached.own_groups:
                if dist.is_initialized():  # else it went with the default group
                    dist.destroy_process_group(group)


@dataclass
class _DeviceMeshCache:
    """A ``DeviceMesh`` built for a strategy and device type from the mesh's groups ``groups`` (compared by identity),
    over the live groups ``used``, some of them created for it (``own_groups``)."""

    strategy: ShardingStrategy
    device_type: str
    groups: tuple[ProcessGroup | None, ProcessGroup | None]
    mesh: DeviceMesh
    used: list[ProcessGroup]
    own_groups: list[ProcessGroup]

    def matches(
        self, strategy: ShardingStrategy, device_type: str, groups: tuple[ProcessGroup | None, ProcessGroup | None]
    ) -> bool:
        same_groups = all(a is b for a, b in zip(self.groups, groups))
        alive = all(_is_registered(group) for group in self.used)
        return self.strategy is strategy and self.device_type == device_type and same_groups and alive

    @classmethod
    def build(cls, mesh: ShardMesh, strategy: ShardingStrategy, device_type: str) -> _DeviceMeshCache:
        from torch.distributed.device_mesh import DeviceMesh

        own: list[ProcessGroup] = []
        first = mesh.replicate_rank * mesh.shard_size
        row = [mesh.global_rank(r) for r in range(first, first + mesh.shard_size)]
        column = [mesh.global_rank(r) for r in range(mesh.shard_rank, mesh.world_size, mesh.shard_size)]
        alone = mesh.tensor_parallel_size == 1 and mesh.pipeline_parallel_size == 1
        world = dist.group.WORLD if alone else None  # the default group is all the ranks

        def live(group: ProcessGroup | None, ranks: list[int]) -> ProcessGroup:
            """``group``, or a new group of ``ranks`` (this rank's row or column) if it has none (an axis of size 1)
            or it was destroyed: its members create it, every member as it builds this mesh."""
            if group is not None and _is_registered(group):
                return group
            own.append(dist.new_group(ranks, use_local_synchronization=True))
            return own[-1]

        match strategy:
            case ShardingStrategy.FULL_SHARD | ShardingStrategy.SHARD_GRAD_OP:
                used = [live(mesh.shard_group or world, row)]
                device_mesh = DeviceMesh.from_group(used[0], device_type, mesh_dim_names=("shard",))
            case ShardingStrategy.NO_SHARD:
                used = [live(mesh.replicate_group or world, column)]
                device_mesh = DeviceMesh.from_group(used[0], device_type, mesh_dim_names=("replicate",))
            case ShardingStrategy.HYBRID_SHARD:
                used = [live(mesh.replicate_group, column), live(mesh.shard_group, row)]
                layout = torch.tensor([mesh.global_rank(r) for r in range(mesh.world_size)])
                layout = layout.view(mesh.replicas, mesh.shard_size)
                device_mesh = DeviceMesh.from_group(
                    used, device_type, mesh=layout, mesh_dim_names=("replicate", "shard")
                )
            case _:
                raise AssertionError(strategy)
        return cls(strategy, device_type, (mesh.shard_group, mesh.replicate_group), device_mesh, used, own)


def _is_registered(group: ProcessGroup) -> bool:
    """Whether ``group`` is still a live process group (not destroyed, e.g. by the Trainer's teardown)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


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


def build_shard_mesh(
    strategy: ShardingStrategy,
    device_mesh: tuple[int, int] | None,
    backend: str | None = None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> ShardMesh:
    """Create the process groups of the mesh (over the data-parallel ranks of this rank's tensor-parallel column when
    ``tensor_parallel_size > 1``, and of this rank's pipeline stage when ``pipeline_parallel_size > 1``: stage ``s``
    holds the global ranks ``s * W / P`` to ``(s + 1) * W / P - 1``). Collective: every rank must call it, in the
    same order."""
    world, tp, pp = dist.get_world_size(), tensor_parallel_size, pipeline_parallel_size
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} does not divide the world {world}.")
    stage, global_rank = divmod(dist.get_rank(), world // pp)  # the rank inside its stage
    world //= pp
    replicas, shard_size = mesh_shape(strategy, world // tp, device_mesh)
    mesh = ShardMesh(global_rank // tp, world // tp, replicas, shard_size, shard_group=None, replicate_group=None,
                     tensor_parallel_size=tp, tensor_parallel_rank=global_rank % tp, pipeline_parallel_size=pp,
                     stage_offset=stage * world)

    def groups(members: list[list[int]], mine: int) -> ProcessGroup:
        """Every rank creates every group (``new_group``'s rule), each column's in turn; returns this rank's group:
        the one of ``members`` (data-parallel ranks, the same in every column) at ``mine`` in this rank's column."""
        own: ProcessGroup | None = None
        for each_stage in range(pp):
            for column in range(tp):
                for i, ranks in enumerate(members):
                    group = dist.new_group([each_stage * world + r * tp + column for r in ranks], backend=backend)
                    if each_stage == stage and column == mesh.tensor_parallel_rank and i == mine:
                        own = group
                        mesh.owned_groups.append(group)
        assert own is not None
        return own

    if shard_size > 1 or pp > 1:  # a stage of one rank still has its own group: the world is other stages' too
        if replicas == 1 and tp == 1 and pp == 1:
            mesh.shard_group = dist.group.WORLD
        else:
            rows = [list(range(row * shard_size, (row + 1) * shard_size)) for row in range(replicas)]
            mesh.shard_group = groups(rows, mesh.replicate_rank)
    if replicas > 1:
        if shard_size == 1 and tp == 1 and pp == 1:
            mesh.replicate_group = dist.group.WORLD
        else:
            columns = [list(range(col, world // tp, shard_size)) for col in range(shard_size)]
            mesh.replicate_group = groups(columns, mesh.shard_rank)
    if (tp > 1 or pp > 1) and (replicas > 1) == (shard_size > 1):  # both axes or neither: the column's own group
        mesh.column_data_parallel_group = groups([list(range(world // tp))], 0)
    mesh.shard_backend = dist.get_backend(mesh.shard_group) if mesh.shard_group is not None else None
    return mesh
