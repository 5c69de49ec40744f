"""``lightning-shard export CKPT OUT --format dcp``: a lightning_shard checkpoint directory written as the
``torch.distributed.checkpoint`` directory Lightning's ``ModelParallelStrategy`` resumes from, so that leaving is as
easy as arriving.

The layout is the one ``ModelParallelStrategy.save_checkpoint`` writes: the model under ``state_dict`` (every key of
the LightningModule's ``state_dict()``, tied weights under each of their names), each optimizer under
``optimizer_<i>`` in ``get_optimizer_state_dict``'s form (``state.<parameter>.<state>`` and
``param_groups.<i>.<option>``), and ``meta.pt`` with the rest of Lightning's checkpoint dict (loops, callbacks,
schedulers). DCP's own writer writes it in this one process (``no_dist=True``); each tensor is planned from its
shape alone and read from the checkpoint only when the writer reaches it, so one full tensor is in memory at a time.
Every tensor is one chunk, which DCP reshards to any world size when it loads.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import DefaultSavePlanner

from lightning_shard.checkpoint.format import MODEL_PREFIX, OPTIMIZER_PREFIX, CheckpointError
from lightning_shard.checkpoint.format.trainer_state import from_json_tree
from lightning_shard.checkpoint.io.index import LEFT_OUT, iter_index_tensors
from lightning_shard.checkpoint.io.layout import StoredTensor, require_complete
from lightning_shard.checkpoint.io.reader import FileHandles, read_tensor
from lightning_shard.checkpoint.io.storage import local_only
from lightning_shard.checkpoint.load.load import load_trainer_state
from lightning_shard.checkpoint.state import TRAINER_PLACEHOLDERS
from lightning_shard.checkpoint.tools.export import move_into_place, temporary_directory_beside

MODEL_KEY = "state_dict"  # ModelParallelStrategy's key of the model; optimizers are "optimizer_<i>"
META_FILE = "meta.pt"


@dataclass(frozen=True)
class DcpExportResult:
    """What ``export_dcp`` wrote."""

    output_dir: Path
    tensors: int  # model tensors (tied weights under each name)
    optimizers: int
    meta_types: list[str] = field(default_factory=list)  # types in meta.pt that torch.load(weights_only=True) refuses


def export_dcp(checkpoint: str | Path, output_dir: str | Path, overwrite: bool = False) -> DcpExportResult:
    """Write the checkpoint directory ``checkpoint`` as a DCP directory at ``output_dir`` (see the module docstring).
    A non-empty existing ``output_dir`` is refused unless ``overwrite``."""
    directory, out = local_only(checkpoint, "export_dcp()"), local_only(output_dir, "export_dcp()")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"Export destination {out} exists and is not empty; pass overwrite=True (--overwrite).")
    values, index = load_trainer_state(directory)
    if index.get(LEFT_OUT):
        raise CheckpointError(
            f"{directory} holds only part of the model (saved with save_trainable_only=True or a filter), which"
            " another strategy cannot resume from. Export a checkpoint saved with every weight."
        )
    require_complete(directory, index["tensors"])
    handles = FileHandles()
    readers: dict[int, Callable[[], Tensor]] = {}
    state: dict[str, Any] = {MODEL_KEY: _model(index, handles, readers)}
    for i, meta in enumerate(index.get("optimizers", [])):
        state[f"optimizer_{i}"] = _optimizer(index, i, meta, handles, readers)
    for key in TRAINER_PLACEHOLDERS:
        values.pop(key, None)
    tmp = temporary_directory_beside(out)
    try:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1)
        with handles, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True says so
            dcp.save(state, storage_writer=writer, planner=_ReadingPlanner(readers), no_dist=True)
        torch.save(values, tmp / META_FILE)
        meta_types = torch.serialization.get_unsafe_globals_in_checkpoint(tmp / META_FILE)
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return DcpExportResult(out, len(state[MODEL_KEY]), len(index.get("optimizers", [])), sorted(meta_types))


def _placeholder(entry: StoredTensor, handles: FileHandles, readers: dict[int, Callable[[], Tensor]]) -> Tensor:
    """A meta tensor of the entry's shape and dtype, which the planner replaces with the data when it is written."""
    placeholder = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    readers[id(placeholder)] = lambda: read_tensor(entry, handles)
    return placeholder


def _model(index: dict[str, Any], handles: FileHandles, readers: dict[int, Callable[[], Tensor]]) -> dict[str, Tensor]:
    model = {key: _placeholder(entry, handles, readers) for key, entry in iter_index_tensors(index, MODEL_PREFIX)}
    for alias, stored in index.get("ties", {}).items():  # a tied weight under each of its names, as state_dict() has it
        model[alias.removeprefix(MODEL_PREFIX)] = model[stored.removeprefix(MODEL_PREFIX)]
    return model


def _optimizer(
    index: dict[str, Any], i: int, meta: dict[str, Any], handles: FileHandles,
    readers: dict[int, Callable[[], Tensor]],
) -> dict[str, Any]:
    """Optimizer ``i`` as ``get_optimizer_state_dict`` gives it: per-parameter state by name, and the groups."""
    state: dict[str, dict[str, Any]] = {}
    for key, entry in iter_index_tensors(index, f"{OPTIMIZER_PREFIX}{i}/"):
        name, state_name = key.rsplit("/", 1)
        state.setdefault(name, {})[state_name] = _placeholder(entry, handles, readers)
    for name, values in meta.get("values", {}).items():
        for state_name, value in values.items():
            state.setdefault(name, {})[state_name] = from_json_tree(value, {})
    groups = [{**from_json_tree(g["options"], {}), "params": list(g["params"])} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


class _ReadingPlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a tensor's data is read from the checkpoint only when the writer asks
    for it: the state dict it plans from holds meta tensors."""

    def __init__(self, readers: dict[int, Callable[[], Tensor]]) -> None:
        super().__init__()
        self._readers = readers

    def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002 - DCP's parameter name
        reader = self._readers.get(id(object))
        if reader is not None:
            return reader()
        return super().transform_object(write_item, object)
