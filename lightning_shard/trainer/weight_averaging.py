"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``, a user's subclass) on a sharded model.

[Note: weight averaging on shards]
Lightning's callback builds its ``AveragedModel`` in ``setup(stage="fit")`` as a deep copy of the
whole LightningModule (after calling ``configure_model`` itself), before the strategy shards the
model, then updates it from ``pl_module.parameters()``, which after sharding are this rank's rows:
the copy would be full-sized and the update would fail. Averaging is elementwise, so each rank can
average its own rows with no communication. ``adopt_weight_averaging`` (in ``setup_environment``,
before the callbacks' ``setup``) replaces the callback's ``setup`` with one that builds nothing;
once the model is sharded, ``build_averaged_models`` gives the callback an ``AveragedModel`` over a
small module whose parameters are copies of this rank's shards (in ``pl_module.parameters()``
order) and whose buffers are copies of ``pl_module.buffers()``. The callback's own
``update_parameters``, ``_swap_models`` (validation on the averaged weights) and
``_copy_average_to_current`` (at the end of fit) then work on shards unchanged. Its checkpoint
hooks are replaced too: the average is saved sharded beside the model (see [Note: averaged weights
in a checkpoint]) with ``n_averaged`` in the trainer state, and read back at any world size.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from lightning_shard.checkpoint.averaged_load import has_average, load_averaged
from lightning_shard.checkpoint.io.averaged import AVERAGED_MODEL_KEY, AveragedTensors
from lightning_shard.checkpoint.open import CheckpointSource

AVERAGING_STATE_KEY = "averaging_state"  # the trainer state's entry for the AveragedModel's own state


class _ShardShadow(nn.Module):
    """This rank's rows of every parameter and its buffers, in the LightningModule's order: what the
    ``AveragedModel`` copies and averages (see [Note: weight averaging on shards]). It holds views of the live
    shards, not copies: the ``AveragedModel`` deep-copies it, and that copy is the only one kept."""

    def __init__(self, params: Iterable[Tensor], buffers: Iterable[Tensor]) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(p.detach(), requires_grad=False) for p in params)
        for i, b in enumerate(buffers):
            self.register_buffer(f"buffer_{i}", b.detach())


def weight_averaging_callbacks(callbacks: Iterable[Any]) -> list[WeightAveraging]:
    return [c for c in callbacks if isinstance(c, WeightAveraging)]


def adopt_weight_averaging(callbacks: Iterable[Any]) -> None:
    """Before the callbacks' ``setup``: let each ``WeightAveraging`` callback build nothing there (the strategy
    builds its average over the shards after sharding) and save and load its average in sharded checkpoints."""
    for callback in weight_averaging_callbacks(callbacks):
        callback.setup = types.MethodType(_setup, callback)  # type: ignore[method-assign]
        callback.on_save_checkpoint = types.MethodType(_on_save_checkpoint, callback)  # type: ignore[method-assign]
        callback.on_load_checkpoint = types.MethodType(_on_load_checkpoint, callback)  # type: ignore[method-assign]


def build_averaged_models(callbacks: Iterable[Any], module: nn.Module) -> None:
    """After sharding: give each ``WeightAveraging`` callback an ``AveragedModel`` of this rank's shards."""
    for callback in weight_averaging_callbacks(callbacks):
        params, buffers = list(module.parameters()), list(module.buffers())
        device = callback._device or (params[0].device if params else torch.device("cpu"))
        shadow = _ShardShadow(params, buffers)
        callback._average_model = AveragedModel(
            shadow, device=device, use_buffers=callback._use_buffers, **callback._kwargs
        )


def _setup(self: WeightAveraging, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
    """Deliberately nothing: the average is built over the shards once the model is sharded."""


def averaged_tensors(callback: WeightAveraging, pl_module: nn.Module) -> AveragedTensors:
    """This rank's averaged tensors under the model's parameter and buffer names."""
    assert callback._average_model is not None
    shadow = callback._average_model.module
    tensors = {name: avg.data for (name, _), avg in zip(pl_module.named_parameters(), shadow.parameters())}
    tensors.update({name: avg.data for (name, _), avg in zip(pl_module.named_buffers(), shadow.buffers())})
    return AveragedTensors(tensors)


def _on_save_checkpoint(
    self: WeightAveraging, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
) -> None:
    """The model stays the current weights; the average goes beside it, sharded, and ``n_averaged`` into the
    trainer state (see [Note: averaged weights in a checkpoint])."""
    if self._average_model is None:
        return  # outside fit: nothing is averaged (the model holds the average once fit has ended)
    checkpoint[AVERAGED_MODEL_KEY] = averaged_tensors(self, pl_module)
    checkpoint[AVERAGING_STATE_KEY] = {"n_averaged": int(self._average_model.n_averaged.item())}


def _on_load_checkpoint(
    self: WeightAveraging, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
) -> None:
    """Resume the average this rank holds from the checkpoint's averaged weights, whatever world size wrote them;
    from a checkpoint without them, start the average from the loaded weights (as Lightning does)."""
    if self._average_model is None:
        rank_zero_warn(
            "The WeightAveraging callback restores its average only when fit resumes; outside fit the checkpoint's"
            " current weights are loaded."
        )
        return
    source = checkpoint.get("state_dict")
    state = checkpoint.get(AVERAGING_STATE_KEY)
    if isinstance(source, CheckpointSource) and has_average(source) and isinstance(state, dict):
        load_averaged(source, trainer.strategy.engine, averaged_tensors(self, pl_module))  # type: ignore[attr-defined]
        self._average_model.n_averaged.fill_(int(state["n_averaged"]))
        return
    rank_zero_warn(
        "The checkpoint holds no averaged weights (it was not saved with weight averaging): the average starts"
        " from the loaded weights."
    )
    average = list(self._average_model.module.parameters()) + list(self._average_model.module.buffers())
    for avg, current in zip(average, list(pl_module.parameters()) + list(pl_module.buffers())):
        avg.data.copy_(current.data)
