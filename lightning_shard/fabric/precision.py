"""``ShardPrecision`` for Fabric: the precision plugin of ``lightning_shard.fabric.ShardStrategy``.

It accepts the precision strings Fabric passes (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
``"16-true"``) and behaves as the Trainer's plugin does: fp32 master shards under the mixed ones, bf16/fp16
all-gathers and compute under autocast, and for ``"16-mixed"`` a loss scaler whose inf/nan check every rank
agrees on (see ``lightning_shard.common.precision``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning.fabric.utilities.types import Optimizable
from lightning_utilities import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_shard.common.precision import ShardDtypes


class ShardPrecision(ShardDtypes, Precision):
    """Precision plugin for Fabric's ``ShardStrategy``; created from ``Fabric(precision=...)`` or passed explicitly.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or ``"16-true"``.
        scaler: the loss scaler for ``"16-mixed"`` (default: a ``ShardedGradScaler``).
        device: device type autocast runs on; the strategy sets it to its device's type.
    """

    @override
    def convert_output(self, data: Any) -> Any:
        """Floating outputs of the set-up module come back in the default dtype (fp32), as with Fabric's own mixed
        and half precision plugins, so a loss computed from them outside the module is computed in fp32."""
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        step_output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self.scaler.update()
        return step_output

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
