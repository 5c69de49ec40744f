"""The Trainer's model summary under ShardStrategy: parameters counted in full, as on one device.

Lightning's summary counts ``p.numel()`` of every parameter the model lists, which under ShardStrategy are this
rank's rows: on two ranks the table would report half the model. ``ShardModelSummary`` counts each sharded
parameter by its full shape instead, and adds a "Params per Device" column with what this rank holds (as
Lightning's DeepSpeed ZeRO-3 summary does). ``use_full_counts`` points the Trainer's ``ModelSummary`` and
``RichModelSummary`` callbacks at it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import (
    NOT_APPLICABLE,
    ModelSummary,
    get_human_readable_count,
)
from torch import nn
from typing_extensions import override

from lightning_shard.engine.sharded_module import ShardedModule

if TYPE_CHECKING:
    import lightning.pytorch as pl

_PARAMS, _PER_DEVICE = "Params", "Params per Device"


class ShardModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` of a model sharded by ``engine``: "Params", the totals and the estimated size
    count every parameter in full; "Params per Device" counts this rank's rows (padding excluded)."""

    def __init__(self, model: pl.LightningModule, engine: ShardedModule, max_depth: int = 1) -> None:
        # Either face may be on the module (the unsharded one while a unit is gathered): both count in full.
        self._full_numel: dict[int, int] = {}
        self._held_numel: dict[int, int] = {}
        for p in engine.sharded_params():
            for face in (p.sharded, p.unsharded):
                self._full_numel[id(face)] = p.numel
                self._held_numel[id(face)] = p.local_rows * p.row_numel
        super().__init__(model, max_depth)

    def _count(self, params: Iterable[nn.Parameter], numels: dict[int, int]) -> int:
        return sum(numels.get(id(p), p.numel()) for p in params)

    @property
    @override
    def param_nums(self) -> list[int]:
        return [self._count(layer._module.parameters(), self._full_numel) for layer in self._layer_summary.values()]

    @property
    def params_per_device(self) -> list[int]:
        """This rank's part of each layer's parameters."""
        return [self._count(layer._module.parameters(), self._held_numel) for layer in self._layer_summary.values()]

    @property
    @override
    def total_parameters(self) -> int:
        return self._count(self._model.parameters(), self._full_numel)

    @property
    @override
    def trainable_parameters(self) -> int:
        return self._count((p for p in self._model.parameters() if p.requires_grad), self._full_numel)

    @override
    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        per_device = [get_human_readable_count(n) for n in self.params_per_device]
        rows = len(dict(arrays)[_PARAMS])
        per_device += [NOT_APPLICABLE] * (rows - len(per_device))  # the row of parameters no layer lists
        at = [name for name, _ in arrays].index(_PARAMS) + 1
        return [*arrays[:at], (_PER_DEVICE, per_device), *arrays[at:]]


def use_full_counts(callbacks: Iterable[Any]) -> None:
    """Make the Trainer's model summary callbacks (``ModelSummary``, ``RichModelSummary``) summarise with
    ``ShardModelSummary`` while their Trainer runs ShardStrategy (they fall back to Lightning's own otherwise). A
    subclass that chooses its own summary (overrides ``_summary``) is left as it is."""
    for callback in callbacks:
        if not isinstance(callback, ModelSummaryCallback):
            continue
        own_choice = type(callback)._summary is not ModelSummaryCallback._summary
        if not own_choice and "_summary" not in vars(callback):
            callback._summary = _full_count_summary.__get__(callback)  # type: ignore[method-assign]


def _full_count_summary(callback: ModelSummaryCallback, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
    engine = getattr(trainer.strategy, "_engine", None)
    if not isinstance(engine, ShardedModule):
        return type(callback)._summary(callback, trainer, pl_module)
    return ShardModelSummary(pl_module, engine, max_depth=callback._max_depth)
