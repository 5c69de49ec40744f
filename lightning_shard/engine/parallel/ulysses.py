"""Attention over the whole sequence when each context-parallel rank holds a part of it: all-to-all of heads.

[Note: Ulysses attention]
Each of the ``C`` context-parallel ranks holds the queries, keys and values of its part of the sequence for every
head, ``(B, H, S / C, D)``. One all-to-all per tensor trades the split: afterwards each rank holds ``H / C`` heads
for the whole sequence, ``(B, H / C, S, D)``, runs ``scaled_dot_product_attention`` on them exactly as the model
would on one rank (causal or not, with its scale), and a second all-to-all trades the output back to ``(B, H, S / C,
D)``. Attention is computed per head, so nothing else changes; the cost is four all-to-alls of the activations per
attention call (their backward is the inverse all-to-all), and ``H`` (and the key/value heads under grouped-query
attention) must be a multiple of ``C``. The rank's part of the sequence is not contiguous (see [Note: the causal
load balance] in ``context.py``): after the first all-to-all the sequence arrives in rank order, which
``order`` puts back into the sequence's own order before attention, and the output is put back into rank order
after it. Every collective here works on gloo, so this runs on CPU; it needs no ring of partial softmaxes, unlike
torch's ``context_parallel`` (ring attention over the flash and efficient SDPA kernels, CUDA only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 of a ``(C, ...)`` tensor; its backward is the same exchange of the
    gradients (an all-to-all is its own inverse when every rank sends equal parts)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _exchange(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _exchange(grad.contiguous(), ctx.group), None


def _exchange(tensor: Tensor, group: ProcessGroup) -> Tensor:
    out = torch.empty_like(tensor)
    with record_function("ContextParallel::all_to_all"):
        dist.all_to_all_single(out, tensor.contiguous(), group=group)
    return out


def sequence_to_heads(x: Tensor, group: ProcessGroup, size: int, order: Tensor) -> Tensor:
    """``(B, H, S / C, D)`` of this rank's positions to ``(B, H / C, S, D)`` of its heads, in sequence order."""
    b, h, s, d = x.shape
    parts = x.reshape(b, size, h // size, s, d).transpose(0, 1)  # (C, B, H/C, S/C, D): part j goes to rank j
    received = _AllToAll.apply(parts.contiguous(), group)  # (C, B, H/C, S/C, D): rank i's positions, my heads
    whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)  # rank order
    return whole.index_select(2, order)


def heads_to_sequence(x: Tensor, group: ProcessGroup, size: int, unorder: Tensor) -> Tensor:
    """The inverse of ``sequence_to_heads``: ``(B, H / C, S, D)`` in sequence order to ``(B, H, S / C, D)``."""
    b, h_part, s_all, d = x.shape
    s = s_all // size
    ranked = x.index_select(2, unorder).reshape(b, h_part, size, s, d).permute(2, 0, 1, 3, 4)  # (C, B, H/C, S/C, D)
    received = _AllToAll.apply(ranked.contiguous(), group)  # (C, B, H/C, S/C, D): head part j of my positions
    return received.transpose(0, 1).reshape(b, h_part * size, s, d)


def ulysses_attention(
    sdpa: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: ProcessGroup,
    size: int,
    order: Tensor,
    unorder: Tensor,
    **kwargs: Any,
) -> Tensor:
    """``sdpa(query, key, value, **kwargs)`` over the whole sequence, each argument ``(B, H, S / C, D)`` of this
    rank's positions; returns this rank's positions of the output. See [Note: Ulysses attention]."""
    with record_function("ContextParallel::ulysses"):
        q, k, v = (sequence_to_heads(t, group, size, order) for t in (query, key, value))
        out = sdpa(q, k, v, **kwargs)
        return heads_to_sequence(out, group, size, unorder)
