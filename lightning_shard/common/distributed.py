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
from torch.distributed.device_mesh import DeviceMesh

from lightning_shard.common.options import ShardOptions
from lightning_shard.engine.mesh import ShardMesh, build_shard_mesh, mesh_shape
from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.parallel import ContextParallel, ParallelDims
from lightning_shard.engine.parallel.pipeline_ranks import PipelineRanks
from lightning_shard.engine.progress import RECORD, start_publishing, stop_publishing
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


class ParallelSizeError(ValueError, RuntimeError):
    """``data_parallel_size``, ``context_parallel_size`` and ``tensor_parallel_size`` do not multiply to the world
    size: a bad argument value (``ValueError``), and the ``RuntimeError`` ``ModelParallelStrategy`` raises for it."""


def parallel_sizes(options: ShardOptions, num_nodes: int, num_processes: int) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` on ``num_nodes`` x ``num_processes`` ranks (each data-parallel
    rank holding ``context_parallel_size`` x ``tensor_parallel_size`` ranks); sizes whose product is not the world
    size raise ``ParallelSizeError``. Needs no process group."""
    world, tp, cp = num_nodes * num_processes, options.tensor_parallel_size, options.context_parallel_size
    pp = options.pipeline_parallel_size
    data_parallel = options.data_parallel_size or world // (pp * cp * tp)
    if world % (pp * cp * tp) or pp * data_parallel * cp * tp != world:
        context = f" x `context_parallel_size={cp}`" if cp > 1 else ""
        context = (f" x `pipeline_parallel_size={pp}`" if pp > 1 else "") + context
        raise ParallelSizeError(
            f"The sizes `data_parallel_size={options.data_parallel_size or 'auto'}`{context} and"
            f" `tensor_parallel_size={tp}` multiplied should equal the world size ({world}). With"
            f" num_nodes={num_nodes} x devices={num_processes}, choose sizes whose product is {world}, or leave"
            f" data_parallel_size='auto' with sizes whose product divides {world}."
        )
    return data_parallel, tp


def start_mesh(
    options: ShardOptions,
    cluster_environment: ClusterEnvironment,
    num_nodes: int,
    num_processes: int,
    device: torch.device,
    backend: str,
) -> tuple[ShardMesh, DeviceMesh]:
    """Initialise the process group (unless one exists) and build this rank's ``(replicas, shard_size)`` mesh, and
    the ``("data_parallel", "tensor_parallel")`` ``DeviceMesh`` a tensor-parallel plan is applied on (see [Note: the
    data-parallel ranks under tensor parallelism]; of shape ``(world, 1)`` without tensor parallelism). With
    ``context_parallel_size > 1`` the ``DeviceMesh`` is ``("data_parallel", "context_parallel", "tensor_parallel")``,
    the engine shards over the data x context ranks of each tensor-parallel coordinate, and the mesh carries the
    context parallelism its model's steps run under.

    The meshes are validated on every rank before any collective, so bad sizes cannot hang the others;
    ``HYBRID_SHARD`` without ``device_mesh`` shards inside a node and replicates across nodes: ``(num_nodes,
    num_processes / tensor_parallel_size)``.
    """
    data_parallel, tp = parallel_sizes(options, num_nodes, num_processes)
    sharded = data_parallel * options.context_parallel_size  # the ranks the engine shards over: data x context
    pp = options.pipeline_parallel_size
    device_mesh = options.device_mesh
    if options.sharding_strategy is ShardingStrategy.HYBRID_SHARD and device_mesh is None:
        device_mesh = (num_nodes, sharded // num_nodes) if sharded % num_nodes == 0 else None
    mesh_shape(options.sharding_strategy, sharded, device_mesh)
    owns = init_process_group(cluster_environment, backend, options.timeout, device)
    start_publishing(
        dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size(), options.timeout
    )
    cp = options.context_parallel_size
    if cp > 1 or pp > 1:  # ("data_parallel", "context_parallel", "tensor_parallel"), "pipeline_parallel" before
        tensor_parallel_mesh = ParallelDims(data_parallel, cp, tp, pp).build_mesh(device.type)
    elif tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        tensor_parallel_mesh = init_device_mesh(
            device.type, (data_parallel, tp), mesh_dim_names=("data_parallel", "tensor_parallel")
        )
    mesh = build_shard_mesh(options.sharding_strategy, device_mesh, backend, tensor_parallel_size=tp,
                            pipeline_parallel_size=pp)  # fmt: skip
    if pp > 1:
        mesh.pipeline = PipelineRanks.of(tensor_parallel_mesh["pipeline_parallel"])
    if cp > 1:
        mesh.context_parallel = ContextParallel.of(tensor_parallel_mesh["context_parallel"])
    elif tp == 1 and pp == 1:
        tensor_parallel_mesh = _data_parallel_only_mesh(mesh, device.type)
    if owns:
        for group in mesh.owned_groups:
            bound_waits(options.timeout, group)
    return mesh, tensor_parallel_mesh


def _data_parallel_only_mesh(mesh: ShardMesh, device_type: str) -> DeviceMesh:
    """``("data_parallel", "tensor_parallel")`` of shape ``(world, 1)`` without tensor parallelism, as
    ModelParallelStrategy has it: the default group, and a group of this rank alone created by it alone (no
    collective; destroyed with the mesh's groups)."""
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    mesh.owned_groups.append(alone)
    layout = torch.arange(dist.get_world_size()).view(-1, 1)
    world = dist.group.WORLD
    assert world is not None
    return DeviceMesh.from_group(
        [world, alone], device_type, mesh=layout, mesh_dim_names=("data_parallel", "tensor_parallel")
    )
