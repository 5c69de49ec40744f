"""Gradient clipping by the global norm of sharded gradients: one all-reduce, the same norm on every rank."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_shard.engine import collectives
from lightning_shard.engine.mesh import ShardMesh


def clip_grad_norm_(
    shards: Iterable[Tensor], mesh: ShardMesh, device: torch.device, max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Scale the gradients of ``shards`` so that their global norm is at most ``max_norm``; return that norm.

    The norm covers every rank's rows (summed over the shard group; replicas hold identical shards, so
    they compute the identical value), as ``torch.nn.utils.clip_grad_norm_`` computes it on a replicated model.
    """
    shards = list(shards)
    total = global_grad_norm(shards, mesh, device, norm_type)
    clip_grads_with_norm_(shards, max_norm, total)
    return total


def global_grad_norm(shards: Iterable[Tensor], mesh: ShardMesh, device: torch.device, norm_type: float = 2.0) -> Tensor:
    """The norm of the gradients of ``shards`` over every rank's rows (one all-reduce; the same on every rank)."""
    grads = [p.grad for p in shards if p.grad is not None]
    total = _local_norm_term(grads, norm_type, device)
    if mesh.shard_group is not None:
        if math.isinf(norm_type):
            collectives.all_reduce_max(total, mesh.shard_group)
        else:
            collectives.all_reduce_sum(total, mesh.shard_group)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_grads_with_norm_(shards: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale the gradients of ``shards`` by ``max_norm / total_norm`` where that is below one (no communication)."""
    grads = [p.grad for p in shards if p.grad is not None]
    if grads:
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, clip_coef.to(grads[0].device))  # gradients may live in CPU memory (offload)


def _local_norm_term(grads: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """This rank's contribution: the max of |g| for the inf-norm, else the sum of per-tensor norms ** p."""
    grads = [g for g in grads if g.numel() > 0]  # a rank may hold no rows of a parameter: an empty max is undefined
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([n.float() for n in torch._foreach_norm(grads, norm_type)]).to(device)
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()
