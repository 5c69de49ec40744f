"""The sizes of the parallel dimensions and the ``DeviceMesh`` they make, as torchtitan's ``parallel_dims.py`` has
them: pipeline x data x context x tensor, in that order (tensor-parallel ranks adjacent, the fastest-varying
coordinate; each pipeline stage a contiguous block of ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ParallelDims:
    """How the world splits: ``pipeline * data * context * tensor`` ranks."""

    data: int
    """Ranks that see different batches."""
    context: int = 1
    """Ranks that split each sequence of one batch (context parallelism); 1: none."""
    tensor: int = 1
    """Ranks that split each layer by a tensor-parallel plan; 1: none."""
    pipeline: int = 1
    """Ranks that each hold a stage of the model's blocks (pipeline parallelism); 1: none."""

    @classmethod
    def of_world(cls, world_size: int, context: int = 1, tensor: int = 1) -> ParallelDims:
        """The dims filling ``world_size`` ranks with ``context`` x ``tensor`` ranks per data-parallel rank; raises
        ``ValueError`` when they do not divide it."""
        if context < 1 or tensor < 1 or world_size % (context * tensor):
            raise ValueError(
                f"context_parallel_size={context} x tensor_parallel_size={tensor} does not divide the world size"
                f" {world_size}; choose sizes whose product divides {world_size}."
            )
        return cls(world_size // (context * tensor), context, tensor)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data * self.context * self.tensor

    def data_parallel_rank(self, global_rank: int) -> int:
        """Which batches ``global_rank`` sees: the ranks of one context x tensor block see the same ones."""
        return (global_rank % (self.data * self.context * self.tensor)) // (self.context * self.tensor)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ``("data_parallel", "context_parallel", "tensor_parallel")`` ``DeviceMesh``, with
        ``"pipeline_parallel"`` in front when ``pipeline > 1``. Collective: every rank calls it, in the same order."""
        from torch.distributed.device_mesh import init_device_mesh

        shape: tuple[int, ...] = (self.data, self.context, self.tensor)
        names: tuple[str, ...] = ("data_parallel", "context_parallel", "tensor_parallel")
        if self.pipeline > 1:
            shape, names = (self.pipeline, *shape), ("pipeline_parallel", *names)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
