"""Parameters a tensor-parallel plan made ``DTensor``s: what the engine keeps of their layout.

[Note: DTensor parameters in the engine]
A tensor-parallel plan (``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel``,
``RowwiseParallel``, ...) turns a module's parameters into ``DTensor``s over the 1-D tensor-parallel mesh: each
rank holds a local tensor, a block of the global tensor (``Shard(0)``: rows, ``Shard(1)``: columns) or all of it
(``Replicate()``). The engine shards the *local* tensor over the data-parallel ranks of the same tensor-parallel
coordinate exactly as it shards a plain parameter: by rows, in the unit's flat buffer, gathered per unit. Only
the two faces change:

- the **sharded** face stays a plain ``nn.Parameter`` of this rank's rows of the local tensor: what the optimizer
  steps on, as without tensor parallelism;
- the **unsharded** face is the gathered local tensor presented as the ``DTensor`` the plan made
  (``DTensor.from_local`` over the same mesh and placements, with the global shape and stride): the module's
  forward, the plan's input and output hooks and autograd see the parameter they expect. Its gradient is a
  ``DTensor``; the reduction takes its local tensor (first redistributed to the parameter's placements when the
  plan left it ``Partial``), and reduces it over the data-parallel ranks only.

Gradients of parameters the plan leaves replicated (plain tensors, or ``Replicate()`` DTensors) are the same on
every tensor-parallel rank, because the plan's hooks all-reduce the gradient of each replicated input; the global
norm used for clipping counts each tensor-parallel shard once and each replicated parameter once
(``global_grad_norm``).

[Note: meta-device DTensor parameters]
A model built on the meta device (``init_module(empty_init=True)``, ``torch.device("meta")``) and then given a plan
has ``DTensor`` parameters without values. When the engine initialises a unit (one at a time) it gives each such
parameter a plain tensor of its *global* shape, runs the owning modules' ``reset_parameters()`` on those as on the
model without the plan, checks that every rank drew global rank 0's values (broadcasting only those that differ, as
for any parameter; see [Note: initial values agree with rank 0]) and keeps this rank's block. So the parameters
start from the values the same model built without a plan would have under the same seed, whatever the
tensor-parallel size; drawing each block on its own rank would give blocks that repeat each other on ranks seeded
alike. The cost is one unit's parameters in their global shape at a time, as for any meta-built unit.

A ``transformers`` config names how each layer of the base model splits (``config.base_model_tp_plan``, e.g. Llama's
``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj": "rowwise"}``): ``hf_tensor_parallel_plan``
gives it as ``parallelize_module`` takes it, named from the module it is given.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_shard.engine.torch_compat import root_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

    from lightning_shard.engine.mesh import ShardMesh


@dataclass(frozen=True)
class TensorParallelLayout:
    """How one ``DTensor`` parameter is split over the tensor-parallel mesh."""

    device_mesh: DeviceMesh
    placements: tuple[Placement, ...]
    global_shape: torch.Size
    global_stride: tuple[int, ...]
    local_offset: tuple[int, ...]  # where this rank's local tensor starts in the global tensor, per dim
    local_shape: tuple[int, ...]

    @classmethod
    def of(cls, fqn: str, param: DTensor) -> TensorParallelLayout:
        """The layout of ``param``; refuses layouts the engine cannot shard (a mesh of more than one dimension, a
        ``Partial`` placement, or a shard along a dimension other than 0 and 1)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh, placements = param.device_mesh, tuple(param.placements)
        if mesh.ndim != 1:
            raise ValueError(
                f"Parameter {fqn} is a DTensor over a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; the tensor-parallel"
                " plan must place parameters on the 1-D tensor-parallel mesh (device_mesh['tensor_parallel']): the"
                " strategy shards them over the data-parallel dimension itself."
            )
        for placement in placements:
            if type(placement) is Replicate or (type(placement) is Shard and placement.dim in (0, 1)):
                continue
            raise ValueError(
                f"Parameter {fqn} is a DTensor placed {placement}; the engine shards tensor-parallel parameters"
                " placed Shard(0), Shard(1) or Replicate() (ColwiseParallel, RowwiseParallel, SequenceParallel)."
            )
        shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
        return cls(mesh, placements, param.shape, tuple(param.stride()), tuple(offset), tuple(shape))

    @property
    def shard_dim(self) -> int | None:
        """The dimension the tensor-parallel ranks split (0 or 1); ``None`` when every rank holds all of it."""
        from torch.distributed.tensor import Shard

        placement = self.placements[0]
        return placement.dim if isinstance(placement, Shard) else None

    def face(self, local: Tensor) -> DTensor:
        """``local`` (this rank's block, gathered) presented as the plan's ``DTensor``; shares ``local``'s memory."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(
                local, self.device_mesh, self.placements, run_check=False, shape=self.global_shape,
                stride=self.global_stride,
            )

    def local_block(self, whole: Tensor) -> Tensor:
        """This rank's block of ``whole``, a tensor of the global shape (a view)."""
        return whole[tuple(slice(o, o + n) for o, n in zip(self.local_offset, self.local_shape))]

    def local_grad(self, grad: Tensor) -> Tensor:
        """The local tensor of a gradient the module computed for this parameter, in the parameter's placements."""
        from torch.distributed.tensor import DTensor

        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != self.placements:  # e.g. Partial: summed over the tensor-parallel ranks
            grad = grad.redistribute(self.device_mesh, self.placements)
        return grad.to_local()


def tensor_parallel_layout(fqn: str, param: Tensor, tensor_parallel_size: int) -> TensorParallelLayout | None:
    """The layout of ``param`` if a tensor-parallel plan made it a ``DTensor`` over ``tensor_parallel_size`` ranks
    (another size is refused); ``None`` for a plain parameter."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return None
    layout = TensorParallelLayout.of(fqn, param)
    if layout.device_mesh.size() != tensor_parallel_size:
        raise ValueError(
            f"Parameter {fqn} is a DTensor over {layout.device_mesh.size()} ranks but the strategy's"
            f" tensor_parallel_size is {tensor_parallel_size}: apply the plan on device_mesh['tensor_parallel']."
        )
    return layout


def note_tensor_parallel_parts(mesh: ShardMesh, params: list[tuple[TensorParallelLayout | None, Tensor]]) -> None:
    """Record on ``mesh`` the sharded faces (of ``(layout, sharded face)`` pairs) that hold rows of one
    tensor-parallel part, and the tensor-parallel group: the global gradient norm sums those over the group; and the
    plan's 2-D mesh, which state dicts place their ``DTensor``s on."""
    for layout, sharded in params:
        if layout is not None:
            mesh.tensor_parallel_root = root_mesh(layout.device_mesh)
        if layout is not None and layout.shard_dim is not None:
            mesh.tensor_parallel_group = layout.device_mesh.get_group()
            mesh.tensor_parallel_parts.add(id(sharded))


def local_tensor(param: Tensor) -> Tensor:
    """The tensor this rank holds of ``param`` (its local block for a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def planned_local_shapes(model: nn.Module, plan: dict[str, Any], tensor_parallel_size: int) -> dict[int, torch.Size]:
    """The local shape each parameter of ``model`` (``id`` -> shape) would have once ``parallelize_module(model, mesh,
    plan)`` splits it over ``tensor_parallel_size`` ranks (the largest part, as ``torch.chunk`` splits): module names
    matched as ``parallelize_module`` matches them (``*`` within one name), ``ColwiseParallel`` splitting a
    ``Linear``'s output features (dim 0 of weight and bias) and an ``Embedding``'s dim 1, ``RowwiseParallel`` a
    ``Linear``'s input features (dim 1 of the weight) and an ``Embedding``'s rows. Parameters of other modules and
    styles keep their shapes. For estimates on meta-device models: nothing is communicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    shapes: dict[int, torch.Size] = {}
    for name, module in model.named_modules():
        style = next((s for pattern, s in plan.items() if _matches(pattern, name)), None)
        if style is None:
            continue
        embedding = isinstance(module, nn.Embedding)
        for param_name, param in module.named_parameters(recurse=False):
            dim = None
            if isinstance(style, ColwiseParallel):
                dim = 1 if embedding else 0
            elif isinstance(style, RowwiseParallel) and (embedding or param_name == "weight"):
                dim = 0 if embedding else 1
            if dim is not None and param.dim() > dim:
                shape = list(param.shape)
                shape[dim] = math.ceil(shape[dim] / tensor_parallel_size)
                shapes[id(param)] = torch.Size(shape)
    return shapes


def _matches(pattern: str, name: str) -> bool:
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch.fnmatch(part, atom) for atom, part in zip(atoms, parts))


def hf_tensor_parallel_plan(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan ``model.config.base_model_tp_plan`` describes, for ``parallelize_module(model, mesh,
    plan)``: ``"colwise"`` is ``ColwiseParallel()``, ``"rowwise"`` ``RowwiseParallel()``, ``"colwise_rep"`` and
    ``"rowwise_rep"`` the same with a replicated output and input. Other kinds (packed, local, sequence-parallel
    layouts) are refused with a ``ValueError`` naming them: write those layers' styles by hand."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan in its config (config.base_model_tp_plan): pass"
            " parallelize_module a plan of your own ({'layers.*.attn.q_proj': ColwiseParallel(), ...})."
        )
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    unknown = sorted({kind for kind in plan.values() if kind not in styles})
    if unknown:
        raise ValueError(
            f"The tensor-parallel plan of {type(model).__name__} uses {unknown}, which hf_tensor_parallel_plan does not"
            f" translate (it takes {sorted(styles)}). Give those layers torch parallel styles yourself."
        )
    base = getattr(model, "base_model", model)
    prefix = next((f"{name}." for name, module in model.named_modules() if module is base and name), "")
    return {prefix + pattern: styles[kind]() for pattern, kind in plan.items()}
