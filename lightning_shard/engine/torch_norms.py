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
``torch.nn.utils.clip_grad_value_`` is element-wise and right on shards as it is. Lightning's ``grad_norm`` logging
utility computes each norm with ``Tensor.norm`` on the rows, which nothing can route: ``grad_norm`` below is its
whole-tensor counterpart, and the Trainer warns when a LightningModule's source imports Lightning's.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_shard.engine.clipping import global_grad_norm, local_norm_term, reduce_norm_terms
from lightning_shard.engine.mesh import ShardMesh
from lightning_shard.engine.param_shard import ShardedParam


class ShardedModel(Protocol):
    """What the norms read of a sharded model's engine (``sharded_module.ShardedModule``, which registers itself
    here: this module does not import it)."""

    root: nn.Module
    mesh: ShardMesh
    device: torch.device

    def sharded_params(self) -> Iterator[ShardedParam]: ...


_LIVE: weakref.WeakSet[ShardedModel] = weakref.WeakSet()
_TORCH_TOTAL_NORM: Callable[..., Tensor] | None = None  # torch's own function, once routed


def watch(engine: ShardedModel) -> None:
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


def _sharded_owners(tensors: list[Tensor]) -> list[tuple[ShardedModel, ShardedParam] | None]:
    """For each tensor: the sharded model and parameter whose gradient it is, or ``None``."""
    by_grad: dict[int, tuple[ShardedModel, ShardedParam]] = {}
    for engine in list(_LIVE):
        for p in engine.sharded_params():
            if p.sharded.grad is not None:
                by_grad[id(p.sharded.grad)] = (engine, p)
    return [by_grad.get(id(t)) for t in tensors]


@torch.no_grad()
def grad_norm(module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's ``grad_norm(module, norm_type)`` for a sharded model: each parameter's gradient norm over the
    whole tensor and the total norm, the same on every rank (Lightning's own computes each norm with ``Tensor.norm``
    over this rank's rows). Collective: every rank must call it. The keys are Lightning's:
    ``grad_{norm_type}_norm{group_separator}{name}`` and ``grad_{norm_type}_norm_total``."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    # The engine whose root is ``module`` or inside it (Fabric's wrapper holds the root as a submodule).
    engine = next((e for e in list(_LIVE) if any(m is e.root for m in module.modules())), None)
    if engine is None:
        raise ValueError(f"grad_norm() needs a model sharded by ShardStrategy; {type(module).__name__} is not one.")
    by_face = {id(p.sharded): p for p in engine.sharded_params()}
    named = [(name, by_face[id(q)], q.grad) for name, q in module.named_parameters()
             if id(q) in by_face and q.grad is not None]
    if not named:
        return {}
    terms = torch.stack([local_norm_term([grad], norm_type, engine.device, torch.float32)
                         for _, _, grad in named if grad is not None])
    mesh = engine.mesh
    reduce_norm_terms(terms, mesh.shard_group, norm_type)
    if mesh.tensor_parallel_group is not None and mesh.tensor_parallel_parts:
        parts = torch.tensor([id(p.sharded) in mesh.tensor_parallel_parts for _, p, _ in named], device=terms.device)
        split = torch.where(parts, terms, torch.zeros_like(terms))
        reduce_norm_terms(split, mesh.tensor_parallel_group, norm_type)
        terms = torch.where(parts, split, terms)
    norms = terms if math.isinf(norm_type) else terms.pow(1.0 / norm_type)
    result = {f"grad_{norm_type}_norm{group_separator}{name}": norm for (name, _, _), norm in zip(named, norms)}
    total = global_grad_norm([p.sharded for p in engine.sharded_params()], mesh, engine.device, norm_type)
    result[f"grad_{norm_type}_norm_total"] = total
    return result


def warn_if_lightning_grad_norm(module: torch.nn.Module, warn: Callable[[str], Any]) -> None:
    """Warn once if the module's source file imported Lightning's ``grad_norm``, which computes each parameter's norm
    over this rank's rows on a sharded model (see ``grad_norm`` above for the one that does not)."""
    import sys

    lightning_versions = []
    for package in ("lightning.pytorch.utilities", "pytorch_lightning.utilities"):
        found = getattr(sys.modules.get(package), "grad_norm", None)
        if found is not None:
            lightning_versions.append(found)
    source = sys.modules.get(type(module).__module__)
    if source is None or not lightning_versions:
        return
    if any(value is fn for value in vars(source).values() for fn in lightning_versions):
        warn(
            f"{type(module).__name__}'s module imports Lightning's grad_norm, which under ShardStrategy computes each"
            " parameter's norm with Tensor.norm over this rank's rows only. Use lightning_shard.grad_norm(self,"
            " norm_type) instead: the same arguments and keys, each norm over the whole tensor."
        )
