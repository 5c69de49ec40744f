"""Lightning ``.ckpt`` files: what ``Trainer.save_checkpoint`` writes under DDP, on a single device, with
FSDPStrategy's ``state_dict_type="full"`` or ModelParallelStrategy's ``save_distributed_checkpoint=False``, and what
``fabric.save`` writes under those strategies; read (``read_lightning_ckpt``) and written from a lightning_shard
checkpoint (``export_lightning``, for ``LightningModule.load_from_checkpoint`` and other tools that read one).

The file is opened with the restricted ``torch.load`` (see [Note: no pickle runs]) and ``mmap=True``: every tensor
stays a view of the memory-mapped file, so a rank that reads its rows of a parameter pages in those rows and nothing
else, and no rank ever holds the whole model or optimizer state.

``export_lightning`` writes what ``Trainer.save_checkpoint`` under DDP writes, less the optimizer state: ``state_dict``
(the full model under the LightningModule's names, tied weights under each of their names and stored once),
``epoch``, ``global_step``, ``pytorch-lightning_version``, ``hyper_parameters``, the loops, callbacks and schedulers,
all plain data that ``torch.load(path, weights_only=True)`` reads. Memory stays bounded by the largest tensor: each
full tensor is assembled from its pieces and written to a file of its own in a staging folder beside the output;
``torch.save`` then reads every tensor from its file through a memory map, so the pages it has written can be dropped
again. The staging folder needs as much disk as the model, and is removed afterwards.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError, dtype_name
from lightning_shard.checkpoint.format.trainer_state import TRAINER_MODEL, TRAINER_OPTIMIZERS
from lightning_shard.checkpoint.interop.export import ExportResult, export_source, require_whole_model, staged
from lightning_shard.checkpoint.interop.foreign import ForeignCheckpoint, ForeignOptimizer, ForeignTensor, ParamKeys
from lightning_shard.checkpoint.interop.safe_pickle import load_restricted
from lightning_shard.checkpoint.io.index import iter_index_tensors, model_ties
from lightning_shard.checkpoint.io.reader import FileHandles, read_tensor
from lightning_shard.checkpoint.load.directory import load_trainer_state

LIGHTNING_VERSION = "pytorch-lightning_version"  # in every checkpoint dict a Trainer writes
# Lightning's WeightAveraging writes the averaged weights under "state_dict" and the weights as trained here.
WEIGHT_AVERAGING_CURRENT = "current_model_state"
WEIGHT_AVERAGING_STATE = "averaging_state"


def read_lightning_ckpt(
    path: Path, module_key: str | None = None, optimizer_keys: Sequence[str] = ()
) -> ForeignCheckpoint:
    """The checkpoint in the ``torch.save`` file ``path``. A Trainer checkpoint keeps the model under
    ``"state_dict"`` and the optimizers under ``"optimizer_states"``; a Fabric one under the keys its state dict
    used, which ``module_key`` and ``optimizer_keys`` name (used when the file holds them)."""
    what = f"The Lightning checkpoint file {path}"
    checkpoint = load_restricted(path, what, mmap=True)
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"{what} holds a {type(checkpoint).__name__}, not Lightning's checkpoint dict.")
    values = dict(checkpoint)
    if module_key is not None and module_key in values:
        model_entry = values.pop(module_key)
        optimizer_entries = [values.pop(k) for k in optimizer_keys if k in values]
    elif TRAINER_MODEL in values:
        model_entry = _trained_weights(values, what)
        optimizer_entries = list(values.pop(TRAINER_OPTIMIZERS, None) or [])
    else:
        wanted = f"{module_key!r} or {TRAINER_MODEL!r}" if module_key else repr(TRAINER_MODEL)
        raise CheckpointError(
            f"{what} has no model state dict under {wanted}; its keys are {sorted(map(str, values))}."
        )
    model, ties = _model_tensors(model_entry, what)
    optimizers = [_optimizer(state, f"{what}, optimizer {i}") for i, state in enumerate(optimizer_entries)]
    return ForeignCheckpoint(path, "the Lightning checkpoint file", model, optimizers, values, ties)


def _trained_weights(values: dict[str, Any], what: str) -> Any:
    """The model as trained, taken out of ``values``. A checkpoint written with Lightning's ``WeightAveraging``
    holds the averaged weights under ``"state_dict"`` and the trained ones under ``"current_model_state"``: the
    trained ones resume (the optimizer state belongs to them), and the average is not carried over, with a warning
    (the callback's average starts again from the resumed weights)."""
    if WEIGHT_AVERAGING_CURRENT not in values:
        return values.pop(TRAINER_MODEL)
    values.pop(TRAINER_MODEL)
    values.pop(WEIGHT_AVERAGING_STATE, None)
    warnings.warn(
        f"{what} was written with Lightning's WeightAveraging: the weights as trained (current_model_state) are"
        " loaded, and its averaged weights are not carried over (a WeightAveraging callback starts its average"
        " again from the loaded weights).",
        stacklevel=2,
    )
    return values.pop(WEIGHT_AVERAGING_CURRENT)


def _model_tensors(state_dict: Any, what: str) -> tuple[dict[str, ForeignTensor], dict[str, str]]:
    """The state dict's tensors, and its tied keys: a key whose tensor is the very tensor (same storage, offset,
    shape and strides) of an earlier key is recorded as an alias of that key."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{what}: the model state dict is a {type(state_dict).__name__}, not a dict of tensors.")
    tensors: dict[str, ForeignTensor] = {}
    ties: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise CheckpointError(
                f"{what}: the model state dict holds {key!r} = {type(value).__name__}; only tensors can be loaded"
                " into a sharded model (extra state from get_extra_state() is not supported)."
            )
        identity = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
                    value.dtype)
        if value.numel() and identity in seen:
            ties[key] = seen[identity]
            continue
        seen.setdefault(identity, key)
        tensors[key] = stored(value)
    return tensors, ties


def stored(tensor: Tensor) -> ForeignTensor:
    """A tensor of the memory-mapped file as a ``ForeignTensor``: each read copies only the rows asked for."""
    return ForeignTensor(tuple(tensor.shape), tensor.dtype, lambda start, stop: _rows(tensor, start, stop))


def _rows(tensor: Tensor, start: int, stop: int) -> Tensor:
    if tensor.dim() == 0:
        return tensor.detach().clone() if start < stop else torch.empty(0, dtype=tensor.dtype)
    return tensor.detach()[start:stop].clone()  # pages in these rows only


def _optimizer(state: Any, what: str) -> ForeignOptimizer:
    """An ``optimizer.state_dict()`` (integer keys) or a name-keyed one (``get_optimizer_state_dict``'s full form)."""
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    per_param = state.get("state") if isinstance(state, Mapping) else None
    if not (isinstance(groups, list) and isinstance(per_param, Mapping)
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups)):
        raise CheckpointError(f"{what} is not an optimizer state dict ('state' and 'param_groups' with 'params').")
    keys = [k for g in groups for k in g["params"]] + list(per_param)
    if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        kind = ParamKeys.POSITION
    elif all(isinstance(k, str) for k in keys):
        kind = ParamKeys.NAME
    else:
        raise CheckpointError(f"{what} keys its parameters neither all by position nor all by name: {keys[:8]}.")
    states: dict[int | str, dict[str, Any]] = {}
    for key, values in per_param.items():
        if not isinstance(values, Mapping):
            raise CheckpointError(f"{what}: the state of parameter {key!r} is a {type(values).__name__}, not a dict.")
        states[key] = {str(k): stored(v) if isinstance(v, Tensor) else v for k, v in values.items()}
    return ForeignOptimizer(kind, [dict(g) for g in groups], states)


# --------------------------------------------------------------------------------------------------
# A lightning_shard checkpoint as one Lightning checkpoint file
# --------------------------------------------------------------------------------------------------


def export_lightning(checkpoint_dir: str | Path, output: str | Path, overwrite: bool = False) -> ExportResult:
    """Write the checkpoint at ``checkpoint_dir`` (written by the Trainer, at any world size; a local directory or a
    URL) as one Lightning checkpoint file at ``output``. An existing file is replaced only with ``overwrite``."""
    directory, out, index = export_source(checkpoint_dir, output, overwrite, "export_lightning()", file=True, urls=True)
    state, _ = load_trainer_state(directory, index)
    if LIGHTNING_VERSION not in state:
        raise CheckpointError(
            f"{checkpoint_dir} holds no Trainer state (no {LIGHTNING_VERSION!r}): fabric.save wrote it, and"
            " LightningModule.load_from_checkpoint needs a Trainer's. Export its weights with --format hf or"
            " `lightning-shard consolidate` instead."
        )
    require_whole_model(directory, index)
    with staged(out, file=True) as tmp:
        state_dict, total = _staged_state_dict(index, tmp.parent)
        torch.save({**state, TRAINER_MODEL: state_dict}, tmp)
        tensors = {key: dtype_name(t.dtype) for key, t in state_dict.items()}
        del state_dict
    return ExportResult(out, [out.name], tensors, total, f"{len(tensors)} model tensors ({total / 2**20:.2f} MiB)")


def _staged_state_dict(index: dict[str, Any], staging: Path) -> tuple[dict[str, Tensor], int]:
    """Every model tensor in full, each read into a file of its own under ``staging`` and mapped from there; tied
    aliases share their stored tensor. Returns the state dict and the bytes of the stored tensors."""
    state_dict: dict[str, Tensor] = {}
    total = 0
    with FileHandles() as handles:
        for i, (key, entry) in enumerate(iter_index_tensors(index, MODEL_PREFIX)):
            path = staging / f"{i}.bin"
            tensor = read_tensor(entry, handles).contiguous()
            shape, dtype = tensor.shape, tensor.dtype
            total += tensor.numel() * tensor.element_size()
            if tensor.numel() == 0:
                state_dict[key] = tensor
                continue
            tensor.view(-1).view(torch.uint8).numpy().tofile(path)
            del tensor
            state_dict[key] = torch.from_file(str(path), shared=True, size=shape.numel(), dtype=dtype).view(shape)
    for alias, stored in model_ties(index).items():
        state_dict[alias] = state_dict[stored]
    return state_dict, total
