"""torch's own gradient norms, asked of a sharded model's parameters, give the whole tensors' norm.

[Note: torch's gradient norms on sharded parameters]
Plain PyTorch code clips with ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` and measures with
``torch.nn.utils.get_total_norm(grads)``. On a sharded model each parameter's ``.grad`` holds this rank's rows, so
torch's function would return this rank's part of the norm and clip every rank by a different coefficient. Both
functions compute the norm through one module-level function of ``torch.nn.utils.clip_grad`` (the one
``get_total_norm`` names), looked up at call time; once a model is sharded, that function is routed here:

- tensors that are all gradients of one sharded model's parameters get the norm over every rank's rows
  (``clipping.global_grad_norm``: one all-reduce; replicas, tensor-parallel parts and pipeline stages counted as
  the strategy's own clipping counts them), the same on every rank, so every rank scales by the same coefficient
  (``clip_grads_with_norm_`` itself is element-wise and needs nothing);
- tensors none of which is such a gradient go to torch's function unchanged;
- a mix, or gradients of two sharded models at once, is refused naming the call: part of the answer would be a
  shard's.

It is a collective whenever sharded gradients are given: every rank must call it, as with DDP every rank clips.
``torch.nn.utils.clip_grad_value_`` is element-wise and right on shards as it is.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_shard.engine.clipping import global_grad_norm

if TYPE_CHECKING:
    from lightning_shard.engine.param_shard import ShardedParam
    from lightning_shard.engine.sharded_module import ShardedModule

_LIVE: weakref.WeakSet[ShardedModule] = weakref.WeakSet()
_TORCH_TOTAL_NORM: Callable[..., Tensor] | None = None  # torch's own function, once routed


def watch(engine: ShardedModule) -> None:
    """Route torch's gradient norm through ``whole_grad_norm`` (once per process) and let it find ``engine``'s
    gradients."""
    global _TORCH_TOTAL_NORM
    _LIVE.add(engine)
    if _TORCH_TOTAL_NORM is None:
        import torch.nn.utils as utils
        import torch.nn.utils.clip_grad as clip_grad

        _TORCH_TOTAL_NORM = clip_grad._get_total_norm
        clip_grad._get_total_norm = whole_grad_norm  # what clip_grad_norm_ calls
        utils.get_total_norm = whole_grad_norm  # type: ignore[assignment]


@torch.no_grad()
def whole_grad_norm(
    tensors: Tensor | Iterable[Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """``torch.nn.utils.get_total_norm``, whole-tensor on sharded gradients (see [Note: torch's gradient norms on
    sharded parameters])."""
    assert _TORCH_TOTAL_NORM is not None
    listed = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    found = _sharded_owners(listed)
    if not any(found):
        return _TORCH_TOTAL_NORM(listed, norm_type, error_if_nonfinite, foreach)
    engines = {id(owner[0]): owner[0] for owner in found if owner is not None}
    if len(engines) > 1 or not all(found):
        others = sum(1 for owner in found if owner is None)
        raise ValueError(
            "torch.nn.utils.clip_grad_norm_ / get_total_norm was given gradients of a model sharded by ShardStrategy"
            + (f" together with {others} other tensor(s)" if others else " of two sharded models at once")
            + ": each sharded gradient holds this rank's rows, so no single norm covers them all. Clip each sharded"
            " model on its own (clip_grad_norm_(model.parameters(), max_norm)), or use the strategy's clipping"
            " (fabric.clip_gradients, Trainer(gradient_clip_val=...))."
        )
    (engine,) = engines.values()
    params: list[Any] = [owner[1].sharded for owner in found if owner is not None]
    total = global_grad_norm(params, engine.mesh, engine.device, float(norm_type))
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot"
            " be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set"
            " `error_if_nonfinite=False`"
        )
    return total.to(listed[0].device)


def _sharded_owners(tensors: list[Tensor]) -> list[tuple[ShardedModule, ShardedParam] | None]:
    """For each tensor: the sharded model and parameter whose gradient it is, or ``None``."""
    by_grad: dict[int, tuple[ShardedModule, ShardedParam]] = {}
    for engine in list(_LIVE):
        for p in engine.sharded_params():
            if p.sharded.grad is not None:
                by_grad[id(p.sharded.grad)] = (engine, p)
    return [by_grad.get(id(t)) for t in tensors]
