"""Process-group set-up and the small collectives both front ends' strategies expose (barrier, broadcast,
all-reduce). Each is counted and watched like the engine's own (see [Note: progress records]): past the timeout it
raises ``StalledRanksError`` naming the ranks that did not arrive."""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor

from lightning_shard.common.options import ShardOptions
from lightning_shard.engine.mesh import ShardMesh, build_shard_mesh, mesh_shape
from lightning_shard.engine.policies import ShardingStrategy
from lightning_shard.engine.progress import RECORD, publisher, start_publishing, stop_publishing
from lightning_shard.engine.stall import bound_waits, rendezvous_timeout, watching

T = TypeVar("T")


def init_process_group(
    cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device
) -> bool:
    """Initialise the default process group unless one exists; return whether this call created it.

    In a group created here every collective waits at most ``timeout`` (see [Note: how a wait ends] in
    ``lightning_shard.engine.stall``); a group that existed keeps its own timeout. A group created here outlives
    the strategy (as with Lightning's own strategies), so that the model can still run forward after training
    (sampling); it is destroyed when the program ends.
    """
    owns = not _distributed_is_initialized()
    kwargs: dict[str, Any] = {"timeout": rendezvous_timeout(timeout)}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(cluster_environment, backend, **kwargs)
    if owns:
        bound_waits(timeout)
        atexit.unregister(_destroy_process_group_at_exit)
        atexit.register(_destroy_process_group_at_exit)
    return owns


def _destroy_process_group_at_exit() -> None:
    stop_publishing()  # its thread must not be inside the group's store while the group goes
    if _distributed_is_initialized():
        dist.destroy_process_group()


def _publishing_thread_stoppable() -> None:
    """Give the progress thread a ``stop()``: test suites that check for threads left behind by a test (Lightning's
    own among them) stop a daemon thread that has one and fail on any other. Stopping it stops publishing progress
    until the next set-up starts it again; the process group and the model are unaffected."""
    running = publisher()
    if running is not None:
        running._thread.stop = stop_publishing  # type: ignore[attr-defined]


def barrier(device: torch.device) -> None:
    """Wait for every rank (a no-op without a process group)."""
    if not _distributed_is_initialized():
        return
    with watching(RECORD.enter("barrier")):
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` as rank ``src`` holds it (picklable objects; a no-op without a process group)."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    with watching(RECORD.enter(f"broadcast from rank {src}")):
        dist.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def reduce_tensor(tensor: Tensor, group: Any | None, reduce_op: ReduceOp | str | None) -> Tensor:
    """``tensor`` reduced over ``group`` (all ranks when ``None``) with ``reduce_op`` ("mean", "sum", ...), as the
    strategies' ``reduce``/``all_reduce`` (logged metrics, the loops' decisions); unchanged without a process group."""
    if not _distributed_is_initialized():
        return tensor
    with watching(RECORD.enter("all-reduce of a logged value or loop decision")):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


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
    owns = init_process_group(cluster_environment, backend, options.timeout, device)
    start_publishing(
        dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), options.timeout
    )
    _publishing_thread_stoppable()
    mesh = build_shard_mesh(options.sharding_strategy, device_mesh, backend)
    if owns:
        for group in mesh.owned_groups:
            bound_waits(options.timeout, group)
    return mesh
