"""A sharded model's and its optimizers' state as state dicts, full or sharded: what the Trainer's
``strategy.lightning_module_state_dict()`` and ``strategy.optimizer_state(optimizer)`` and Fabric's
``get_module_state_dict`` and ``get_optimizer_state`` return, and what plain-PyTorch code gets from
``model_state_dict`` and ``optimizer_state_dict``.

    from lightning_shard.checkpoint.state_dicts import model_state_dict, optimizer_state_dict

    full = model_state_dict(model, "full")          # collective; rank 0: {name: CPU tensor}, other ranks: {}
    shards = model_state_dict(model, "sharded")     # collective; every rank: {name: DTensor view of its rows}

[Note: state dicts of a sharded model]
The contract is the one Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy`` give and that
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``get_optimizer_state_dict`` give for FSDP2
(optimizer state keyed by name in both layouts, as the latter and Fabric's ``FSDPStrategy`` key it; the Trainer's
strategies renumber the full layout's keys by position on rank 0).

- Names are those of the unsharded module's ``state_dict()``, in its order: buffers included, a tied weight under each
  of its names (one tensor object), extra state as the module gives it. Optimizer state is keyed by parameter name
  (a tied parameter's first name, as ``named_parameters()`` lists it): ``{"state": {name: {key: value}},
  "param_groups": [{options..., "params": [name, ...]}]}``, each group's options as ``optimizer.state_dict()``
  gives them; state that does not exist yet (before the first step) is absent, as in ``optimizer.state_dict()``.
- ``"full"``: on global rank 0, every parameter and every per-parameter optimizer tensor gathered into a new CPU
  tensor of its global shape, one tensor at a time (each all-gather over the shard group; the other ranks of the
  shard group take part and drop what they receive at once, so they hold at most one full tensor beside their
  shards, and the ranks of other replicas take part in nothing). Buffers and scalar optimizer state (``step``) are
  rank 0's, moved to the CPU. Every other rank gets ``{}``.
- ``"sharded"``: on every rank, each parameter as a ``DTensor`` over the mesh (``ShardMesh.device_mesh``, see
  [Note: the DeviceMesh of a ShardMesh]): ``Shard(0)`` over the shard dimension and ``Replicate()`` over the replicate
  dimension, whose local tensor is a view of this rank's rows of the live shard (no copy: later steps show in it, as
  in a plain module's ``state_dict()``). Dim-0 shards of ``ceil(rows / shard_size)`` rows are exactly
  ``torch.chunk``'s, which is how ``Shard(0)`` splits, so a rank holding fewer rows or none gets a local tensor of
  that many rows; the global shape and stride are given explicitly. Per-parameter optimizer tensors (``exp_avg``,
  ``momentum_buffer``) are ``DTensor`` views the same way; buffers and scalar optimizer state are this rank's plain
  tensors (identical on every rank), as FSDP2 gives them. Optimizer tensors of another shape are passed as this rank
  holds them, as the checkpoint directory stores them.
- A 0-dim parameter is one row, held by shard rank 0 alone; ``DTensor`` cannot shard a 0-dim tensor (nor does FSDP2
  accept one), so under ``"sharded"`` it is a ``DTensor`` replicated on every rank (``Replicate()`` on every mesh
  dimension) whose value each rank receives from its shard rank 0 (one broadcast of one element: a copy, not a view).
  Its per-row optimizer state likewise.
- Under tensor parallelism the mesh is the plan's ``("data_parallel", "tensor_parallel")`` mesh and the shape the
  whole tensor's: a row-wise part is ``[Shard(0), Shard(1)]``, a column-wise part ``[_StridedShard(0), Shard(0)]``
  (split by the data-parallel ranks after the tensor-parallel split, as FSDP2 with a plan gives it), a replicated one
  ``[Shard(0), Replicate()]`` (``Replicate()`` first under ``NO_SHARD``); ``"full"`` gathers over both.

Either layout is a collective: every rank calls it, in the same order. Nothing is written anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.load.directory import sharded_engine
from lightning_shard.engine.option_choices import StateDictType
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.progress import about
from lightning_shard.engine.sharded_module import ShardedModule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


def model_state_dict(module: nn.Module, layout: StateDictType | str) -> dict[str, Any]:
    """The state dict of ``module`` (sharded by ``lightning_shard``) in ``layout`` (``"full"`` or ``"sharded"``); see
    [Note: state dicts of a sharded model]. Collective."""
    engine = sharded_engine(module, "model_state_dict()", TypeError)
    _refuse_tensor_parallel(engine)
    with _plain_tensors():
        made = _Layout(engine, StateDictType.parse(layout))
        if made.idle:
            return {}
        out: dict[str, Any] = {}
        whole: dict[int, Any] = {}  # a tied weight is made once (gathered once, on every rank alike), under each name
        for key, p, value in _entries(engine):
            if p is not None and id(p) not in whole:
                whole[id(p)] = made.rows(p, p.sharded.detach())
            out[key] = whole[id(p)] if p is not None else made.plain(value)
        return out if made.holds else {}


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer, layout: StateDictType | str) -> dict[str, Any]:
    """The state of ``optimizer`` (built on the shards of ``module``) keyed by parameter name, in ``layout``; see
    [Note: state dicts of a sharded model]. Collective."""
    engine = sharded_engine(module, "optimizer_state_dict()", TypeError)
    _refuse_tensor_parallel(engine)
    params, state, groups = _named_optimizer_state(engine, optimizer)
    with _plain_tensors():
        made = _Layout(engine, StateDictType.parse(layout))
        if made.idle:
            return {}
        out = {name: {key: made.rows(params[name], value.detach()) if _is_per_row(params[name], value)
                      else made.plain(value)
                      for key, value in sorted(param_state.items())}  # the same order on every rank: each is collective
               for name, param_state in state.items()}
        return {"state": out, "param_groups": groups} if made.holds else {}


def state_dicts_available(engine: ShardedModule) -> bool:
    """Whether ``engine``'s model has state dicts: under tensor parallelism the data-parallel ranks must be one axis
    (the 2-D mesh's ``"data_parallel"``), not a ``HYBRID_SHARD`` layout of them. Checkpoints (``save_checkpoint``,
    ``fabric.save``) hold every tensor whole in any layout."""
    mesh = engine.mesh
    return not (mesh.tensor_parallel_size > 1 and mesh.replicas > 1 and mesh.shard_size > 1)


def _refuse_tensor_parallel(engine: ShardedModule) -> None:
    """State dicts where ``state_dicts_available`` says there are none are refused, not given in a layout that would
    mislead."""
    if not state_dicts_available(engine):
        raise NotImplementedError(
            "state_dict() of a model trained with tensor_parallel_size > 1 and HYBRID_SHARD is not available yet."
            " Save a checkpoint (trainer.save_checkpoint / fabric.save: every tensor whole, loadable at any size) and"
            " read it with `lightning-shard consolidate` or `export`."
        )


class _Layout:
    """What a state dict in ``layout`` makes of each value (see [Note: state dicts of a sharded model]): of this rank's
    rows of a parameter or of a state shaped like it (``rows``), and of anything else (``plain``). ``"full"``: the
    whole tensor gathered on global rank 0, which alone ``holds`` the state dict; the ranks of other replicas than
    replica 0 (whose ranks gather) take no part (``idle``). ``"sharded"``: a ``DTensor`` view on every rank."""

    def __init__(self, engine: ShardedModule, layout: StateDictType) -> None:
        mesh, self.engine, self.full = engine.mesh, engine, layout is StateDictType.FULL
        self.idle = self.full and mesh.replicate_rank != 0
        self.holds = not self.full or (mesh.rank == 0 and mesh.tensor_parallel_rank == 0)
        self.units = _unit_names(engine)
        self.device_mesh = None if self.full else _device_mesh(engine)

    def rows(self, p: ShardedParam, local: Tensor) -> Tensor | None:
        if self.device_mesh is not None:
            return _as_dtensor(self.engine, self.device_mesh, p, local, self.units[id(p)])
        full = _gather_to_cpu(self.engine, p, local, self.units[id(p)])
        return full if self.holds else None  # the other ranks hold at most one full tensor at a time

    def plain(self, value: Any) -> Any:
        if isinstance(value, Tensor) and self.holds:
            return value.detach().cpu() if self.full else value.detach()
        return value if self.holds else None


def _gather_to_cpu(engine: ShardedModule, p: ShardedParam, local: Tensor, unit: str) -> Tensor:
    """``p``'s full tensor from every rank's rows ``local`` (shaped like ``p.sharded``), in a CPU tensor of its own
    (not a view into a padded buffer: ``torch.save`` of a view writes its whole storage). Collective."""
    with about(unit):  # a stalled gather names the unit
        full = engine.gather_whole(p, local).cpu()
    if full.untyped_storage().nbytes() != full.numel() * full.element_size():
        full = full.clone()
    return full


def _device_mesh(engine: ShardedModule) -> DeviceMesh:
    """The mesh the DTensors live on, for the device the shards live on (the CPU under ``cpu_offload``), so that no
    local tensor is moved; under tensor parallelism the ``("data_parallel", "tensor_parallel")`` mesh of the plan."""
    if engine.mesh.tensor_parallel_root is not None:
        return engine.mesh.tensor_parallel_root
    return engine.mesh.device_mesh(engine.sharding_strategy, engine.units[0].shard_device.type)


def _as_dtensor(engine: ShardedModule, device_mesh: DeviceMesh, p: ShardedParam, local: Tensor, unit: str) -> DTensor:
    """``local`` (this rank's rows of ``p``, or of a tensor shaped like it) as a DTensor of ``p``'s global shape."""
    from torch.distributed.tensor import DTensor, Replicate

    if len(p.global_shape) == 0:  # one row, on shard rank 0 alone: replicated (see the note)
        scalar = _scalar_from_shard_rank0(engine, device_mesh, p, local, unit)
        placements: list[Placement] = [Replicate()] * device_mesh.ndim
        return DTensor.from_local(scalar, device_mesh, placements, shape=torch.Size(), stride=())
    two_d = engine.mesh.tensor_parallel_root is not None  # a plan placed parameters on the 2-D mesh
    placements = _two_d_placements(engine, p) if two_d else _placements(device_mesh)
    return DTensor.from_local(
        local, device_mesh, placements, shape=p.full_shape, stride=_contiguous_stride(p.full_shape)
    )


def _two_d_placements(engine: ShardedModule, p: ShardedParam) -> list[Placement]:
    """Under tensor parallelism, the placements of this rank's rows on the ``("data_parallel", "tensor_parallel")``
    mesh: the data-parallel ranks split the tensor-parallel part by rows (``Replicate()`` under ``NO_SHARD``); a part
    that is itself rows of the whole tensor (``Shard(0)``) is split after the tensor-parallel split, which
    ``_StridedShard`` says, as FSDP2 with a tensor-parallel plan does."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = p.tensor_parallel
    tp_placement: Placement = tp.placements[0] if tp is not None else Replicate()
    if engine.mesh.shard_size == 1:
        return [Replicate(), tp_placement]
    if tp is not None and tp.shard_dim == 0:
        return [_StridedShard(0, split_factor=engine.mesh.tensor_parallel_size), tp_placement]
    return [Shard(0), tp_placement]


def _placements(device_mesh: DeviceMesh) -> list[Placement]:
    """``Shard(0)`` along the mesh's ``"shard"`` dimension, ``Replicate()`` along ``"replicate"``."""
    from torch.distributed.tensor import Replicate, Shard

    names = device_mesh.mesh_dim_names or ()
    return [Shard(0) if name == "shard" else Replicate() for name in names]


def _scalar_from_shard_rank0(
    engine: ShardedModule, device_mesh: DeviceMesh, p: ShardedParam, local: Tensor, unit: str
) -> Tensor:
    """The value of a 0-dim ``p`` (its one row, held by shard rank 0) on every rank. Collective over the mesh's shard
    dimension."""
    if p.shard_size == 1:
        return local.view(())  # every rank holds the row
    if p.local_rows == 1:  # shard rank 0 sends its row and keeps the view of it
        sent = local.view(()).to(engine.device)
    else:
        sent = torch.empty((), dtype=local.dtype, device=engine.device)
    with about(unit):
        dist.broadcast(sent, group=engine.mesh.shard_group or dist.group.WORLD, group_src=0)
    return local.view(()) if p.local_rows == 1 else sent.to(local.device)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


# Names #


def _entries(engine: ShardedModule) -> Iterator[tuple[str, ShardedParam | None, Any]]:
    """The root's ``state_dict()`` entries in order, as ``(key, the parameter it holds or None, value)``. A parameter
    is recognised by its name or by the tensor the module holds for it (either face: the unsharded one while a unit
    is gathered), so the shards are read whatever the units' state."""
    by_name: dict[str, ShardedParam] = {}
    by_tensor: dict[int, ShardedParam] = {}
    for p in engine.sharded_params():
        by_name.update(dict.fromkeys(p.fqns, p))
        for face in (getattr(p, "sharded", None), getattr(p, "unsharded", None)):
            if face is not None:
                by_tensor[id(face)] = p
    for key, value in engine.root.state_dict(keep_vars=True).items():
        held = by_name.get(key) or (by_tensor.get(id(value)) if isinstance(value, Tensor) else None)
        yield key, held, value


def _named_optimizer_state(
    engine: ShardedModule, optimizer: Optimizer
) -> tuple[dict[str, ShardedParam], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``optimizer``'s per-parameter state keyed by parameter name, in parameter order, and its groups with
    ``"params"`` as names. Raises ``ValueError`` (on every rank alike) if it holds tensors that are not shards of
    ``engine``'s model."""
    by_shard = {id(p.sharded): p for p in engine.sharded_params()}
    params = [q for group in optimizer.param_groups for q in group["params"]]
    foreign = [i for i, q in enumerate(params) if id(q) not in by_shard]
    if foreign:
        raise ValueError(
            f"The optimizer holds {len(foreign)} tensor(s) (positions {foreign} in its parameter groups) that are"
            " not shards of the sharded model, so its state cannot be named by parameter. Build the optimizer from"
            " the sharded model's parameters (after it was set up), and pass the optimizer of that model."
        )
    packed = optimizer.state_dict()
    names = [by_shard[id(q)].fqn for q in params]
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[i] for i in group["params"]]}
        for group in packed["param_groups"]
    ]
    state = {names[i]: dict(packed["state"][i]) for i in sorted(packed["state"])}
    return {names[i]: by_shard[id(q)] for i, q in enumerate(params)}, state, groups


def _is_per_row(p: ShardedParam, value: Any) -> bool:
    """Whether an optimizer state value holds this rank's rows of a tensor shaped like ``p`` (as the checkpoint
    writer decides it: the shard's own shape)."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape == p.sharded.shape


def _unit_names(engine: ShardedModule) -> dict[int, str]:
    """``id(parameter)`` -> the name of the unit holding it, for naming a stalled collective."""
    return {id(p): unit.name for unit in engine.units for p in unit.params}


@contextmanager
def _plain_tensors() -> Iterator[None]:
    """Build state dicts as normal tensors without autograd, also under inference mode (a Lightning evaluation hook
    that saves a checkpoint), so that they can be used and changed anywhere afterwards."""
    with torch.no_grad(), torch.inference_mode(False):
        yield
