"""Gradient clipping by the global norm of sharded gradients: one all-reduce, the same norm on every rank."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_shard.engine import collectives
from lightning_shard.engine.mesh import ShardMesh


def clip_grad_norm_(
    shards: Iterable[Tensor], mesh: ShardMesh, device: torch.device, max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Scale the gradients of ``shards`` so that their global norm is at most ``max_norm``; return that norm.

    The norm covers every rank's rows (summed over the shard group; replicas hold identical shards, so
    they compute the identical value; under pipeline parallelism, summed over the stages too), as
    ``torch.nn.utils.clip_grad_norm_`` computes it on a replicated model.
    """
    shards = list(shards)
    total = global_grad_norm(shards, mesh, device, norm_type)
    clip_grads_with_norm_(shards, max_norm, total)
    return total


def global_grad_norm(shards: Iterable[Tensor], mesh: ShardMesh, device: torch.device, norm_type: float = 2.0) -> Tensor:
    """The norm of the gradients of ``shards`` over every rank's rows (one all-reduce; the same on every rank). Under
    tensor parallelism each tensor-parallel part counts once (a second all-reduce, over the tensor-parallel group)."""
    shards = list(shards)
    dtype = _norm_dtype(shards)
    if mesh.pipeline is not None:  # a weight tied across stages counts once, on its first stage
        shards = [p for p in shards if id(p) not in mesh.pipeline.held_earlier]
    if not mesh.tensor_parallel_parts:
        total = local_norm_term([p.grad for p in shards if p.grad is not None], norm_type, device, dtype)
        reduce_norm_terms(total, mesh.shard_group, norm_type)
    else:  # parts of tensor-parallel parameters, then everything every tensor-parallel rank holds alike
        parts = [p.grad for p in shards if p.grad is not None and id(p) in mesh.tensor_parallel_parts]
        alike = [p.grad for p in shards if p.grad is not None and id(p) not in mesh.tensor_parallel_parts]
        terms = torch.stack([local_norm_term(parts, norm_type, device, dtype),
                             local_norm_term(alike, norm_type, device, dtype)])
        reduce_norm_terms(terms, mesh.shard_group, norm_type)
        split = terms[0].clone()
        reduce_norm_terms(split, mesh.tensor_parallel_group, norm_type)
        total = torch.maximum(split, terms[1]) if math.isinf(norm_type) else split + terms[1]
    if mesh.pipeline is not None:  # the other stages' parameters
        reduce_norm_terms(total, mesh.pipeline.group, norm_type)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def reduce_norm_terms(terms: Tensor, group: ProcessGroup | None, norm_type: float) -> None:
    """Combine each rank's norm terms over ``group`` in place: the max for the inf-norm, else the sum of the
    ``|g| ** p`` terms (nothing without a group)."""
    if group is not None:
        if math.isinf(norm_type):
            collectives.all_reduce_max(terms, group)
        else:
            collectives.all_reduce_sum(terms, group)


def clip_grads_with_norm_(shards: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale the gradients of ``shards`` by ``max_norm / total_norm`` where that is below one (no communication)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in shards:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for dtype, grads in by_dtype.items():  # gradients may live in CPU memory (offload)
        torch._foreach_mul_(grads, clip_coef.to(device=grads[0].device, dtype=dtype))


def _norm_dtype(shards: list[Tensor]) -> torch.dtype:
    """The dtype the norm is computed and returned in: the widest floating dtype of the parameters, at least
    float32 (a float64 model gets a float64 norm, as ``torch.nn.utils.clip_grad_norm_`` gives it). It depends on the
    parameters, not on which have gradients, so every rank all-reduces the same dtype."""
    dtype = torch.float32
    for p in shards:
        if p.dtype.is_floating_point:
            dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def local_norm_term(grads: list[Tensor], norm_type: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """This rank's contribution: the max of |g| for the inf-norm, else the sum of per-tensor norms ** p."""
    grads = [g for g in grads if g.numel() > 0]  # a rank may hold no rows of a parameter: an empty max is undefined
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch.stack([n.to(dtype) for n in torch._foreach_norm(grads, norm_type)]).to(device)
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()
