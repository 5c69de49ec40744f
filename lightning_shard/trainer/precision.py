"""``ShardPrecision``: the Lightning precision plugin of the Trainer's ``ShardStrategy``.

It handles every precision string the Trainer accepts with sharding: ``"32-true"``, ``"bf16-mixed"``,
``"16-mixed"``, ``"bf16-true"`` and ``"16-true"``. Under the mixed ones the shards stay fp32 (master
weights), the all-gather and the compute run in bf16/fp16 (see ``MixedPrecision``) and the forward
runs under autocast, as Lightning's FSDP plugin does. ``"16-mixed"`` scales the loss with
``ShardedGradScaler``, whose inf/nan check is agreed by all ranks, so every rank skips the same steps.
The dtype side is shared with the Fabric plugin (``lightning_shard.common.precision``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.common.precision import ShardDtypes, ShardPrecisionName, translate_precision
from lightning_shard.engine.grad_scaler import ShardedGradScaler


class ShardPrecision(ShardDtypes, Precision):
    """Precision plugin for ``ShardStrategy``; created from the Trainer's ``precision=`` or passed explicitly.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or ``"16-true"``.
        scaler: the loss scaler for ``"16-mixed"`` (default: a ``ShardedGradScaler``).
        device: device type autocast runs on; the strategy sets it to its device's type.
    """

    def __init__(
        self, precision: ShardPrecisionName = "32-true", scaler: ShardedGradScaler | None = None, device: str = "cpu"
    ) -> None:
        super().__init__(precision, scaler, device)
        self.clip_norm_fn: Callable[[Optimizer, float], Tensor] | None = None  # set by the strategy

    # Backward and optimizer step #

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not skip_unscaling:
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self.scaler.update()
        return step_output

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the global norm over all shards (one all-reduce), not each rank's own shard norm."""
        if self.clip_norm_fn is None:
            raise RuntimeError("ShardPrecision clips by norm only under ShardStrategy, after the Trainer set it up.")
        self.clip_norm_fn(optimizer, float(clip_val))


def as_shard_precision(plugin: Precision | None) -> ShardPrecision | None:
    """Accept a ShardPrecision, or translate the plugin Lightning picked from ``Trainer(precision=...)``."""
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    choices = (
        "Pass one of the Trainer precisions '32-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true', or"
        " plugins=[ShardPrecision(...)]."
    )
    return translate_precision(plugin, ShardPrecision, MixedPrecision, HalfPrecision, Precision, choices)
