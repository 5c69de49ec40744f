"""Load a LightningModule from a checkpoint directory in one process, for inference.

``load_from_checkpoint`` mirrors ``LightningModule.load_from_checkpoint`` (which cannot read a directory): no
Trainer, no process group. The module is rebuilt from the hyperparameters ``save_hyperparameters()`` stored,
``configure_model()`` runs, and the trained weights are copied in one full tensor at a time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
import torch

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.io.averaged import Weights, weights_prefix
from lightning_shard.checkpoint.io.index import iter_index_tensors, model_ties
from lightning_shard.checkpoint.io.reader import read_tensor
from lightning_shard.checkpoint.io.storage import local_only
from lightning_shard.checkpoint.load.directory import load_trainer_state
from lightning_shard.engine.transformers_buffers import fill_buffers_transformers_initialises

ModuleT = TypeVar("ModuleT", bound=L.LightningModule)
MapLocation = str | torch.device | dict[str, str] | Callable[[Any, str], Any] | None


def load_from_checkpoint(
    module_class: type[ModuleT],
    checkpoint: str | Path,
    map_location: MapLocation = None,
    strict: bool = True,
    weights: Weights = "current",
    **kwargs: Any,
) -> ModuleT:
    """Build ``module_class`` from the checkpoint's saved hyperparameters (``kwargs`` override them), run its
    ``configure_model()`` and its ``on_load_checkpoint(checkpoint)`` hook, load the trained weights, and return it
    in eval mode. The hook sees the checkpoint's trainer state (``hyper_parameters``, ``epoch``, ``global_step``,
    callbacks' and loops' state) without ``"state_dict"``: the weights are read from the directory afterwards.

    ``map_location``: the device the module ends on, as in Lightning: ``None`` (CPU), a device or its name, a
    ``{"from": "to"}`` dict (its entry for ``"cpu"``, where the tensors are read), or a ``torch.load``-style
    callable ``(storage, location) -> storage`` (asked where a CPU storage goes).
    ``strict``: a module key missing from the checkpoint, or a checkpoint key the module lacks, raises. Parameters
    that ``configure_model()`` leaves on the meta device are materialised with ``to_empty`` and filled from
    the checkpoint; one the checkpoint does not hold is an error whatever ``strict`` says.
    ``weights``: ``"current"`` (the model as trained) or ``"averaged"`` (the average a ``WeightAveraging`` callback
    kept during the fit; refused when the checkpoint holds none).
    """
    directory = local_only(checkpoint, "load_from_checkpoint()")
    state, index = load_trainer_state(directory)
    device = _device(map_location)
    hparams = dict(state.get("hyper_parameters") or {})
    init_kwargs = {**_accepted(module_class, hparams), **kwargs}
    module = module_class(**init_kwargs)
    module.configure_model()
    module.on_load_checkpoint(state)  # as Lightning does, before the weights (state has no "state_dict")
    meta = {k for k, t in module.state_dict(keep_vars=True).items() if t.is_meta}
    unsaved, initialised = _buffers_initialised(module, device)  # the non-persistent meta buffers; those given values
    if meta:
        _to_empty_keeping_ties(module, device)
        for key, value in initialised.items():  # to_empty emptied them again
            owner, _, name = key.rpartition(".")
            module.get_submodule(owner)._buffers[name] = value
    stored = dict(iter_index_tensors(index, weights_prefix(index, weights, directory)))
    ties = model_ties(index)
    available = set(stored) | set(ties)
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in available]
    unexpected = [k for k in available if k not in own]
    uninitialised = sorted([k for k in meta if k not in available] + [k for k in unsaved if k not in initialised])
    if uninitialised:
        raise CheckpointError(
            f"configure_model() left these on the meta device and {directory} does not hold them, so they would"
            f" stay uninitialised: {', '.join(uninitialised)}."
        )
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading the checkpoint {directory} into {module_class.__name__}:"
            f" missing keys: {missing}; unexpected keys: {unexpected}. Pass strict=False to load the rest."
        )
    with torch.no_grad():
        for key, target in own.items():
            if key not in available:
                continue
            value = read_tensor(stored[ties.get(key, key)])
            if tuple(target.shape) != tuple(value.shape):
                raise RuntimeError(
                    f"{key}: the checkpoint holds shape {list(value.shape)}, {module_class.__name__} has"
                    f" {list(target.shape)}."
                )
            target.copy_(value)
            del value
    module.to(device)
    return module.eval()


def _buffers_initialised(module: torch.nn.Module, device: torch.device) -> tuple[set[str], dict[str, torch.Tensor]]:
    """The names of ``module``'s meta buffers that no checkpoint holds (non-persistent: a rotary ``inv_freq``), and
    every meta buffer that the ``transformers`` model holding it gives values to (on ``device``, by name, each under
    every name it has), as set-up does (see [Note: buffers transformers initialises])."""
    was_meta = {k for k, b in module.named_buffers(remove_duplicate=False) if b.is_meta}
    unsaved = was_meta - module.state_dict(keep_vars=True).keys()
    fill_buffers_transformers_initialises(module, device)
    given = {k: b for k, b in module.named_buffers(remove_duplicate=False) if k in was_meta and not b.is_meta}
    return unsaved, given


def _to_empty_keeping_ties(module: torch.nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)``, with every parameter that several modules share (tied embeddings and
    LM head) still one parameter afterwards: ``to_empty`` makes a new parameter per module that holds it."""
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((owner, name))
    module.to_empty(device=device)
    for (first, first_name), *others in holders.values():
        for owner, name in others:
            owner._parameters[name] = first._parameters[first_name]


def _device(map_location: MapLocation) -> torch.device:
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, dict):
        return torch.device(map_location.get("cpu", "cpu"))
    if callable(map_location):  # torch.load's form: where would a CPU storage go?
        moved = map_location(torch.empty(0).untyped_storage(), "cpu")
        return torch.device("cpu") if moved is None else moved.device
    return torch.device(map_location)


def _accepted(module_class: type, hparams: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters ``module_class`` takes (all of them when it takes ``**kwargs``), as Lightning does."""
    params = inspect.signature(module_class).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return hparams
    return {k: v for k, v in hparams.items() if k in params}
