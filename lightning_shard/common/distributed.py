"""Process-group set-up and the small collectives both front ends' strategies expose (barrier, broadcast)."""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import group as _group

from lightning_shard.common.options import ShardOptions
from lightning_shard.engine.mesh import ShardMesh, build_shard_mesh, mesh_shape
from lightning_shard.engine.policies import ShardingStrategy

T = TypeVar("T")


def init_process_group(
    cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta | None, device: torch.device
) -> bool:
    """Initialise the default process group unless one exists; return whether this call created it.

    A group created here outlives the strategy (as with Lightning's own strategies), so that the model can still
    run forward after training (sampling); it is destroyed when the program ends.
    """
    owns = not _distributed_is_initialized()
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(cluster_environment, backend, **kwargs)
    if owns:
        atexit.unregister(_destroy_process_group_at_exit)
        atexit.register(_destroy_process_group_at_exit)
    return owns


def _destroy_process_group_at_exit() -> None:
    if _distributed_is_initialized():
        dist.destroy_process_group()


def barrier(device: torch.device) -> None:
    """Wait for every rank (a no-op without a process group)."""
    if not _distributed_is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` as rank ``src`` holds it (picklable objects; a no-op without a process group)."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def start_mesh(
    options: ShardOptions,
    cluster_environment: ClusterEnvironment,
    num_nodes: int,
    num_processes: int,
    device: torch.device,
    backend: str,
) -> ShardMesh:
    """Initialise the process group (unless one exists) and build this rank's ``(replicas, shard_size)`` mesh.

    The mesh is validated on every rank before any collective, so a bad ``device_mesh`` cannot hang the others;
    ``HYBRID_SHARD`` without one shards inside a node and replicates across nodes, ``(num_nodes, num_processes)``.
    """
    device_mesh = options.device_mesh
    if options.sharding_strategy is ShardingStrategy.HYBRID_SHARD and device_mesh is None:
        device_mesh = (num_nodes, num_processes)
    mesh_shape(options.sharding_strategy, num_nodes * num_processes, device_mesh)
    init_process_group(cluster_environment, backend, options.timeout, device)
    return build_shard_mesh(options.sharding_strategy, device_mesh, backend)
