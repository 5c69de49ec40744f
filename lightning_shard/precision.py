"""``ShardPrecision``: the Lightning precision plugin of ``ShardStrategy``.

It handles every precision string the Trainer accepts with sharding: ``"32-true"``, ``"bf16-mixed"``,
``"16-mixed"``, ``"bf16-true"`` and ``"16-true"``. Under the mixed ones the shards stay fp32 (master
weights), the all-gather and the compute run in bf16/fp16 (see ``MixedPrecision``) and the forward
runs under autocast, as Lightning's FSDP plugin does. ``"16-mixed"`` scales the loss with
``ShardedGradScaler``, whose inf/nan check is agreed by all ranks, so every rank skips the same steps.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard import collectives
from lightning_shard.mixed_precision import MixedPrecision, check_precision, mixed_precision_for, true_dtype_for

ShardPrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
_AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/nan check is agreed by all ranks in one all-reduce.

    Each rank sees only its shards of the gradients, so an overflow shows up on the rank that holds
    those rows; taking the maximum over ranks makes every rank skip the same steps and keep the same scale.
    """

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        comm_device = self._scale.device if self._scale is not None else torch.device(self._device)
        if not per_device:  # this rank holds no gradient rows: it still votes
            per_device[comm_device] = torch.zeros(1, device=comm_device)
        found = torch.stack([v.reshape(()).to(comm_device) for v in per_device.values()]).max().reshape(1)
        collectives.all_reduce_max(found, None)  # on the scaler's device: gradients may live in CPU memory
        for v in per_device.values():
            v.copy_(found.reshape(v.shape))


class ShardPrecision(Precision):
    """Precision plugin for ``ShardStrategy``; created from the Trainer's ``precision=`` or passed explicitly.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or ``"16-true"``.
        scaler: the loss scaler for ``"16-mixed"`` (default: a ``ShardedGradScaler``).
        device: device type autocast runs on; the strategy sets it to its device's type.
    """

    def __init__(
        self, precision: ShardPrecisionName = "32-true", scaler: ShardedGradScaler | None = None, device: str = "cpu"
    ) -> None:
        check_precision(precision)
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not use a loss scaler; only '16-mixed' does.")
        self.precision = precision
        self.device = device
        self._owns_scaler = scaler is None and precision == "16-mixed"
        self.scaler = ShardedGradScaler(device) if self._owns_scaler else scaler
        self.clip_norm_fn: Callable[[Optimizer, float], Tensor] | None = None  # set by the strategy

    def set_device(self, device_type: str) -> None:
        """Run autocast (and the default loss scaler) on ``device_type``; called by the strategy at setup."""
        if self._owns_scaler and device_type != self.device and self.scaler is not None:
            self.scaler = ShardedGradScaler(device_type)
        self.device = device_type

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        """The dtypes this precision implies for the shards (``None``: gather and compute in the parameters' dtype)."""
        return mixed_precision_for(self.precision)

    @property
    def _true_dtype(self) -> torch.dtype | None:
        return true_dtype_for(self.precision)

    # Module and tensors #

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        dtype = self._true_dtype
        return module.to(dtype=dtype) if dtype is not None else module

    @override
    def tensor_init_context(self) -> Any:
        dtype = self._true_dtype
        return _DtypeContextManager(dtype) if dtype is not None else nullcontext()

    @override
    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision in _AUTOCAST_DTYPE:
            dtype = _AUTOCAST_DTYPE[self.precision]
            with torch.autocast(self.device, dtype=dtype, cache_enabled=False):
                yield
        else:
            with self.tensor_init_context():
                yield

    @override
    def convert_input(self, data: Any) -> Any:
        dtype = self._true_dtype
        if dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

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

    # Checkpoint #

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
