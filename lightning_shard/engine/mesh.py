"""The data-parallel layout of ranks: who shards with whom, and who replicates with whom.

Every sharding strategy is one shape of the same 2-D mesh ``(replicas, shard_size)``:
``FULL_SHARD``/``SHARD_GRAD_OP`` are ``(1, world)``, ``NO_SHARD`` is ``(world, 1)`` and
``HYBRID_SHARD`` is whatever ``device_mesh`` says. Rank ``r`` sits at row ``r // shard_size``,
column ``r % shard_size``: the ranks of one row shard a parameter among themselves (the shard
group), the ranks of one column hold the same shard and all-reduce its gradient (the replicate group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_shard.engine.policies import ShardingStrategy


@dataclass
class ShardMesh:
    """This rank's place in the ``(replicas, shard_size)`` mesh and the process groups along each axis.

    A group is ``None`` when its axis has size 1 (nothing to communicate).
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

    @property
    def shard_rank(self) -> int:
        """This rank's index inside its shard group: which rows of each parameter it holds."""
        return self.rank % self.shard_size

    @property
    def replicate_rank(self) -> int:
        return self.rank // self.shard_size

    def destroy(self) -> None:
        """Destroy the sub-groups this mesh created (never the default group)."""
        for group in self.owned_groups:
            dist.destroy_process_group(group)
        self.owned_groups.clear()


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
    strategy: ShardingStrategy, device_mesh: tuple[int, int] | None, backend: str | None = None
) -> ShardMesh:
    """Create the process groups of the mesh. Collective: every rank must call it, in the same order."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    replicas, shard_size = mesh_shape(strategy, world_size, device_mesh)
    mesh = ShardMesh(rank, world_size, replicas, shard_size, shard_group=None, replicate_group=None)
    if shard_size > 1:
        if replicas == 1:
            mesh.shard_group = dist.group.WORLD
        else:
            for row in range(replicas):  # every rank creates every group, in the same order (new_group's rule)
                group = dist.new_group(list(range(row * shard_size, (row + 1) * shard_size)), backend=backend)
                if row == mesh.replicate_rank:
                    mesh.shard_group = group
                    mesh.owned_groups.append(group)
    if replicas > 1:
        if shard_size == 1:
            mesh.replicate_group = dist.group.WORLD
        else:
            for col in range(shard_size):
                group = dist.new_group(list(range(col, world_size, shard_size)), backend=backend)
                if col == mesh.shard_rank:
                    mesh.replicate_group = group
                    mesh.owned_groups.append(group)
    mesh.shard_backend = dist.get_backend(mesh.shard_group) if mesh.shard_group is not None else None
    return mesh
