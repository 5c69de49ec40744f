"""Process-group set-up and the small collectives both front ends' strategies expose (barrier, broadcast,
all-reduce). Each is counted and watched like the engine's own (see [Note: progress records]): past the timeout it
raises ``StalledRanksError`` naming the ranks that did not arrive."""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

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
from lightning_shard.engine.mesh import ShardMesh, build_meshes
from lightning_shard.engine.parallel.dims import ParallelDims
from lightning_shard.engine.parallel.dims import ParallelSizeError as ParallelSizeError  # raised by parallel_dims
from lightning_shard.engine.progress import RECORD, start_publishing, stop_publishing
from lightning_shard.engine.stall import bound_waits, rendezvous_timeout, watching

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

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


def parallel_dims(options: ShardOptions, num_nodes: int, num_processes: int, rank: int) -> ParallelDims:
    """The layout ``options`` ask for on ``num_nodes`` x ``num_processes`` ranks, global rank ``rank`` among them;
    sizes that do not fill the world raise ``ParallelSizeError``, a ``device_mesh`` that does not fit
    ``ValueError``. Needs no process group."""
    return ParallelDims.of_world(
        num_nodes * num_processes, options.context_parallel_size, options.tensor_parallel_size,
        pipeline=options.pipeline_parallel_size, data=options.data_parallel_size, strategy=options.sharding_strategy,
        device_mesh=options.device_mesh, num_nodes=num_nodes, rank=rank,
    )  # fmt: skip


def start_mesh(
    dims: ParallelDims, cluster_environment: ClusterEnvironment, device: torch.device, backend: str, timeout: timedelta
) -> tuple[ShardMesh, DeviceMesh]:
    """Initialise the process group (unless one exists) and build this rank's mesh in the layout ``dims`` (see
    ``ParallelDims.build``), and the ``DeviceMesh`` a tensor-parallel plan is applied on. ``dims`` was checked
    before, on every rank, so bad sizes cannot hang the others."""
    owns = init_process_group(cluster_environment, backend, timeout, device)
    start_publishing(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), timeout)
    mesh, device_mesh = build_meshes(dims, device.type, backend)
    if owns:
        for group in mesh.owned_groups:
            bound_waits(timeout, group)
    return mesh, device_mesh
