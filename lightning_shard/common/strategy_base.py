"""What both front ends' ``ShardStrategy`` classes are made of besides their framework's hooks: the devices and
ranks, the mesh, and the small collectives. Lightning's ``ParallelStrategy`` differs between the Trainer and
Fabric, so this is a mixin placed before it in each front end's class."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.types import ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor

from lightning_shard.checkpoint.io.storage import is_url
from lightning_shard.checkpoint.save.background import BackgroundSaver
from lightning_shard.common.distributed import barrier, broadcast_object, parallel_dims, reduce_tensor, start_mesh
from lightning_shard.common.options import ShardOptions, ShardOptionsMixin, check_backend_for_device
from lightning_shard.engine.mesh import ShardMesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_shard.engine.parallel.dims import ParallelDims

T = TypeVar("T")


class ShardStrategyMixin(ShardOptionsMixin):
    """Devices, ranks, mesh and collectives of a ``ShardStrategy``, for either front end."""

    # Provided by Lightning's ParallelStrategy (either front end's).
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    local_rank: int
    node_rank: int
    global_rank: int
    num_nodes: int
    # Set by _take_arguments, in the front end's constructor.
    _process_group_backend: str | None
    _saver: BackgroundSaver
    _mesh: ShardMesh | None
    _tensor_parallel_mesh: DeviceMesh | None = None

    def _take_arguments(self, arguments: dict[str, Any]) -> None:
        """Check the sharding arguments (``ShardOptions.parse``): a bad one raises here, before any process exists."""
        self.options = ShardOptions.parse(**arguments)
        self._process_group_backend = self.options.process_group_backend
        self._saver = BackgroundSaver()  # at most one background save in flight
        self._mesh = None

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data split over the data-parallel ranks: the ranks of one context x tensor-parallel block see the same
        batches (the context-parallel ranks then split each batch's sequences), and so do the stages of one pipeline."""
        return self._parallel_dims().sampler_kwargs

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("data_parallel", "tensor_parallel")`` ``DeviceMesh`` (as ``ModelParallelStrategy``'s) that a
        tensor-parallel plan is applied on (its tensor-parallel size is ``tensor_parallel_size``, 1 by default);
        with ``context_parallel_size > 1``, ``("data_parallel", "context_parallel", "tensor_parallel")``. Exists once
        the processes are set up."""
        if self._tensor_parallel_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._tensor_parallel_mesh

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def offloads(self) -> bool:
        """Whether shards live in CPU memory while the model computes on an accelerator (``cpu_offload``)."""
        return self.options.cpu_offload and self.root_device.type != "cpu"

    @property
    def mesh(self) -> ShardMesh:
        """This rank's place in the ``(replicas, shard_size)`` mesh; available once the processes are set up."""
        if self._mesh is None:
            raise RuntimeError(
                "The ShardStrategy mesh exists only once the processes are set up (by the Trainer, or fabric.launch())."
            )
        return self._mesh

    def _url_options(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The strategy's ``storage_options`` for ``path`` when it is a URL (a local path takes none)."""
        return self.options.storage_options if is_url(path) else None

    def _parallel_dims(self) -> ParallelDims:
        """The layout of this rank; see ``parallel_dims``."""
        return parallel_dims(self.options, self.num_nodes, self.num_processes, self.global_rank)

    def _check_parallel_sizes(self) -> None:
        """Refuse parallel sizes whose product is not the world size, and a ``device_mesh`` that does not fit it,
        before any rank is assigned or process group created."""
        self._parallel_dims()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _start_mesh(self) -> None:
        """Initialise the process group (unless one exists) and build the mesh; see ``start_mesh``."""
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        check_backend_for_device(backend, self.root_device.type)
        assert self.cluster_environment is not None
        self._mesh, self._tensor_parallel_mesh = start_mesh(
            self._parallel_dims(), self.cluster_environment, self.root_device, backend, self.options.timeout
        )

    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """``tensor`` reduced over all ranks (mean by default; Fabric's ``fabric.all_reduce``); a non-tensor is
        returned unchanged."""
        return reduce_tensor(tensor, group, reduce_op) if isinstance(tensor, Tensor) else tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return broadcast_object(obj, src)


def refuse_unpickling(weights_only: bool | None) -> None:
    """A checkpoint load of ``ShardStrategy`` never runs a pickle (see [Note: no pickle runs]): ``weights_only=None``
    and ``True`` read alike; ``False``, a request to run a checkpoint's pickle, cannot be honoured and is refused."""
    if weights_only is False:
        raise ValueError(
            "weights_only=False asks to run the checkpoint's pickle, which ShardStrategy never does: its checkpoints"
            " hold no pickle, and a Lightning .ckpt is read with torch.load(weights_only=True) (tensors, plain"
            " containers and the types Lightning writes). Leave weights_only unset; to load a .ckpt holding other"
            " objects, load it with torch.load in the process that trusts it and save the state dict again."
        )



def refuse_local_storage_options(path: str | os.PathLike[str], storage_options: Any) -> None:
    """``save_checkpoint(local_path, storage_options=...)`` is a ``TypeError``, in the words of Lightning's own
    strategies first: the options configure an fsspec file system, which only a URL has. The same on every rank,
    before any collective."""
    if storage_options is not None and not is_url(path):
        raise TypeError(
            "`ShardStrategy.save_checkpoint(..., storage_options=...)` is not supported for the local path"
            f" {os.fspath(path)!r}: storage_options apply only to URLs (s3://, gs://, az://...). Remove them, or save"
            " to a URL."
        )
