"""The precision behaviour both front ends' plugins share: which dtypes a precision string implies for the shards,
autocast for the mixed ones, casting for the true ones, and the loss scaler for ``"16-mixed"``.

The ``Trainer`` plugin (``lightning_shard.ShardPrecision``) and the ``Fabric`` plugin
(``lightning_shard.fabric.ShardPrecision``) each add only what their framework's loop calls differently
(backward and the optimizer step).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, TypeVar

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning_utilities import apply_to_collection
from torch import Tensor, nn

from lightning_shard.engine.grad_scaler import ShardedGradScaler
from lightning_shard.engine.mixed_precision import MixedPrecision, check_precision, mixed_precision_for, true_dtype_for

ShardPrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ShardDtypes:
    """Mixin for a Lightning precision plugin: the dtype side of sharded precision (see the module docstring)."""

    precision: Any  # one of ShardPrecisionName (a narrower type in Lightning's precision base classes)
    device: str
    scaler: ShardedGradScaler | None

    def __init__(
        self, precision: ShardPrecisionName = "32-true", scaler: ShardedGradScaler | None = None, device: str = "cpu"
    ) -> None:
        """``precision``: one of ``ShardPrecisionName``; ``scaler``: the loss scaler for ``"16-mixed"`` (default: a
        ``ShardedGradScaler``); ``device``: the device type autocast runs on (the strategy sets it at setup)."""
        check_precision(precision)
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not use a loss scaler; only '16-mixed' does.")
        self.precision = precision
        self.device = device
        self._owns_scaler = scaler is None and precision == "16-mixed"
        self.scaler = ShardedGradScaler(device) if self._owns_scaler else scaler

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

    def convert_module(self, module: nn.Module) -> nn.Module:
        dtype = self._true_dtype
        return module.to(dtype=dtype) if dtype is not None else module

    def tensor_init_context(self) -> Any:
        dtype = self._true_dtype
        return _DtypeContextManager(dtype) if dtype is not None else nullcontext()

    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision in AUTOCAST_DTYPE:
            with torch.autocast(self.device, dtype=AUTOCAST_DTYPE[self.precision], cache_enabled=False):
                yield
        else:
            with self.tensor_init_context():
                yield

    def convert_input(self, data: Any) -> Any:
        dtype = self._true_dtype
        if dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=dtype)

    def convert_output(self, data: Any) -> Any:
        if self._true_dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


P = TypeVar("P", bound=ShardDtypes)


def translate_precision(
    plugin: Any,
    shard_class: type[P],
    mixed_class: type[Any],
    half_class: type[Any],
    plain_class: type[Any],
    choices: str,
) -> P | None:
    """The front end's ``ShardPrecision`` for the plugin Lightning picked from its ``precision=`` argument (its
    ``mixed_class``, ``half_class`` or ``plain_class`` plugin), or ``plugin`` itself if it already is one."""
    if plugin is None or isinstance(plugin, shard_class):
        return plugin
    make: Any = shard_class  # each front end's ShardPrecision(precision, scaler=None, device="cpu")
    if isinstance(plugin, mixed_class):
        return make(plugin.precision, device=plugin.device)
    if isinstance(plugin, half_class):
        return make(plugin.precision)
    if type(plugin) is plain_class:
        return make("32-true")
    raise TypeError(
        f"ShardStrategy works with the {shard_class.__module__}.{shard_class.__name__} plugin; found"
        f" {type(plugin).__name__}. {choices}"
    )
