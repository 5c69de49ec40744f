"""This rank's process groups for the layout ``ParallelDims`` works out (see [Note: the parallel layout] in
``parallel/dims.py``): who shards with whom, and who replicates with whom.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.parallel.context import ContextParallel
from lightning_shard.engine.parallel.dims import ParallelDims
from lightning_shard.engine.parallel.pipeline_ranks import PipelineRanks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh



@dataclass
class ShardMesh:
    """This rank's process groups in the layout ``dims`` (built by ``ParallelDims.build``), and the layout's answers
    the engine asks for, by name.

    A group is ``None`` when its axis has size 1 (nothing to communicate). ``rank`` and ``world_size`` count the
    data-parallel ranks of this rank's column (see [Note: the data-parallel ranks under tensor parallelism]).
    """

    dims: ParallelDims
    shard_group: ProcessGroup | None = None
    replicate_group: ProcessGroup | None = None
    # The groups created here that this rank is a member of (its shard and replicate groups), destroyed by
    # ``destroy()``. The groups of other rows and columns are created too (every rank must call ``new_group`` for
    # each), but this rank holds only a placeholder for them: no timeout to set, nothing to destroy.
    owned_groups: list[ProcessGroup] = field(default_factory=list)
    shard_backend: str | None = None  # the shard group's backend, recorded while the group is registered
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
    pipeline: PipelineRanks | None = None
    _device_mesh: _DeviceMeshCache | None = field(default=None, init=False, repr=False, compare=False)

    # The layout, as ``dims`` answers #

    @property
    def rank(self) -> int:
        return self.dims.column_rank

    @property
    def world_size(self) -> int:
        return self.dims.column_size

    @property
    def replicas(self) -> int:
        return self.dims.replicas

    @property
    def shard_size(self) -> int:
        return self.dims.shard

    @property
    def shard_rank(self) -> int:
        """This rank's index inside its shard group: which rows of each parameter it holds."""
        return self.dims.shard_rank

    @property
    def replicate_rank(self) -> int:
        return self.dims.replicate_rank

    @property
    def tensor_parallel_size(self) -> int:
        return self.dims.tensor

    @property
    def tensor_parallel_rank(self) -> int:
        return self.dims.tensor_rank

    @property
    def pipeline_parallel_size(self) -> int:
        return self.dims.pipeline

    @property
    def stage_offset(self) -> int:
        """The global rank of the first rank of this rank's stage (0 without pipeline parallelism)."""
        return self.dims.stage_offset

    # Groups #

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

    def new_groups(self, members: list[list[int]], backend: str | None) -> ProcessGroup | None:
        """Create a process group of each of ``members`` (global ranks; every rank creates every group, in the same
        order: ``new_group``'s rule); return the one holding this rank, kept in ``owned_groups``, or ``None``."""
        mine = None
        for ranks in members:
            group = dist.new_group(ranks, backend=backend)
            if self.dims.rank in ranks:
                mine = group
                self.owned_groups.append(group)
        return mine

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
        grid = mesh.dims.grid()  # this column's global ranks, (replicas, shard_size)
        row, column = grid[mesh.replicate_rank], [ranks[mesh.shard_rank] for ranks in grid]
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
                device_mesh = DeviceMesh.from_group(
                    used, device_type, mesh=torch.tensor(grid), mesh_dim_names=("replicate", "shard")
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


def build_meshes(dims: ParallelDims, device_type: str, backend: str | None) -> tuple[ShardMesh, DeviceMesh]:
    """This rank's ``ShardMesh`` in the layout ``dims`` (its groups, pipeline stage and context-parallel group) and
    the ``DeviceMesh`` of ``ParallelDims.build_mesh``; without tensor, context or pipeline parallelism the latter is
    ``(world, 1)`` and built from existing groups. Collective: every rank calls it, in the same order."""
    device_mesh = dims.build_mesh(device_type) if max(dims.context, dims.tensor, dims.pipeline) > 1 else None
    mesh = build_groups(dims, backend)
    if device_mesh is None:
        return mesh, _data_parallel_only_mesh(dims, mesh, device_type)
    if dims.pipeline > 1:
        group = device_mesh["pipeline_parallel"].get_group()
        mesh.pipeline = PipelineRanks(group, dims.pipeline, dims.stage, dims.pipeline_group())
    if dims.context > 1:
        mesh.context_parallel = ContextParallel.of(device_mesh["context_parallel"])
    return mesh, device_mesh


def build_groups(dims: ParallelDims, backend: str | None = None) -> ShardMesh:
    """This rank's ``ShardMesh``: the shard and replicate groups of its column (``None`` for an axis of size 1),
    and the column's own group when neither is all of it."""
    mesh = ShardMesh(dims)
    whole = dims.tensor == 1 and dims.pipeline == 1  # the column is the world: the default group
    if dims.shard > 1 or dims.pipeline > 1:  # a stage of one rank still has its own group: the world is not it
        world = whole and dims.replicas == 1
        mesh.shard_group = dist.group.WORLD if world else mesh.new_groups(dims.shard_groups(), backend)
    if dims.replicas > 1:
        world = whole and dims.shard == 1
        mesh.replicate_group = dist.group.WORLD if world else mesh.new_groups(dims.replicate_groups(), backend)
    if not whole and (dims.replicas > 1) == (dims.shard > 1):  # both axes or neither: the column's own group
        mesh.column_data_parallel_group = mesh.new_groups(dims.column_groups(), backend)
    mesh.shard_backend = dist.get_backend(mesh.shard_group) if mesh.shard_group is not None else None
    return mesh


def _data_parallel_only_mesh(dims: ParallelDims, mesh: ShardMesh, device_type: str) -> DeviceMesh:
    """``("data_parallel", "tensor_parallel")`` of shape ``(world, 1)``, as ModelParallelStrategy has it: the
    default group, and a group of this rank alone created by it alone (no collective; destroyed with the mesh's
    groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    alone = dist.new_group([dims.rank], use_local_synchronization=True)
    mesh.owned_groups.append(alone)
    world = dist.group.WORLD
    assert world is not None
    layout = torch.arange(dims.world_size).view(-1, 1)
    return DeviceMesh.from_group(
        [world, alone], device_type, mesh=layout, mesh_dim_names=("data_parallel", "tensor_parallel")
    )


def build_shard_mesh(
    strategy: ShardingStrategy,
    device_mesh: tuple[int, int] | None,
    backend: str | None = None,
    tensor_parallel_size: int = 1,
) -> ShardMesh:
    """The engine's ``ShardMesh`` over the default process group, its data-parallel ranks those of each
    tensor-parallel coordinate (see [Note: the data-parallel ranks under tensor parallelism]). Collective."""
    dims = ParallelDims.of_world(dist.get_world_size(), tensor=tensor_parallel_size, strategy=strategy,
                                 device_mesh=device_mesh, rank=dist.get_rank())  # fmt: skip
    return build_groups(dims, backend)
