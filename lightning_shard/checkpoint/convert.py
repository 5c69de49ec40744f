"""``lightning-shard convert SRC OUT``: a checkpoint of another strategy (a Lightning ``.ckpt`` or a
``torch.distributed.checkpoint`` directory, see ``open.py``) written as a lightning_shard checkpoint directory in
the full layout, which ``ShardStrategy`` resumes from at any world size.

No process group is needed. Memory stays bounded by the largest tensor: each is read (rows from a memory-mapped
``.ckpt``, or assembled from its DCP chunks), streamed into ``model.safetensors`` or ``optimizer.safetensors`` and
dropped before the next. The directory is written and committed as a save writes a full checkpoint (the same files,
index and trainer state, renamed into place: see [Note: atomic checkpoint saves]).

A ``.ckpt`` keys its optimizer state by position (see [Note: position-keyed optimizer state]); naming the
parameters then needs the module that wrote it: ``module`` builds it (on the meta device, so no weights are
allocated) and its ``configure_optimizers()`` gives the parameter groups.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import (
    FORMAT_NAME,
    MODEL_FILE,
    MODEL_PREFIX,
    OPTIMIZER_FILE,
    OPTIMIZER_PREFIX,
    CheckpointError,
    dtype_name,
    new_save_id,
)
from lightning_shard.checkpoint.format.safetensors_header import SAVE_ID_METADATA
from lightning_shard.checkpoint.format.trainer_state import to_json_tree
from lightning_shard.checkpoint.interop.export import ExportResult
from lightning_shard.checkpoint.interop.foreign import (
    ForeignCheckpoint,
    ForeignOptimizer,
    ForeignTensor,
    ParamKeys,
    name_positions,
    per_element_states,
)
from lightning_shard.checkpoint.io.index import (
    FileRecord,
    SavedTensor,
    build_index,
    encode_index,
    index_head,
    optimizer_entry,
)
from lightning_shard.checkpoint.io.storage import local_only
from lightning_shard.checkpoint.io.writer import SafetensorsStreamWriter
from lightning_shard.checkpoint.open import CheckpointKind, detect, read_foreign
from lightning_shard.checkpoint.save.commit import commit, refuse_to_replace_other_data
from lightning_shard.checkpoint.save.directory import write_trainer_state
from lightning_shard.engine.option_choices import StateDictType


def convert(
    source: str | Path,
    output: str | Path,
    module: Callable[..., nn.Module] | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write the foreign checkpoint ``source`` as a lightning_shard checkpoint directory at ``output``.

    ``module`` builds the LightningModule that wrote a ``.ckpt`` (a class is called with the checkpoint's
    ``hyper_parameters``, as ``load_from_checkpoint`` does; any other callable with no arguments); it is needed to
    name the parameters of a position-keyed optimizer state and is built under ``torch.device("meta")``. A
    non-empty existing ``output`` is refused unless ``overwrite``, and even then only a checkpoint directory is
    replaced."""
    src, out = local_only(source, "convert()"), local_only(output, "convert()")
    kind = detect(src)
    if kind is CheckpointKind.SHARD_DIRECTORY:
        raise CheckpointError(f"{src} is already a lightning_shard checkpoint directory; there is nothing to convert.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise CheckpointError(f"Convert destination {out} exists and is not empty; pass overwrite=True (--overwrite).")
    foreign = read_foreign(src, kind)
    names = _optimizer_names(foreign, module)
    if out.exists():
        refuse_to_replace_other_data(out)  # with overwrite: only a checkpoint directory is replaced
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"  # as a save names it: see [Note: atomic ...]
    tmp.mkdir()
    try:
        commit(tmp, out, _write(foreign, names, tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    optimizer_tensors = [v for saved in foreign.optimizers for state in saved.state.values() for v in state.values()
                         if isinstance(v, ForeignTensor)]
    files = [MODEL_FILE, OPTIMIZER_FILE] if optimizer_tensors else [MODEL_FILE]
    total = sum(math.prod(t.shape) * t.dtype.itemsize for t in [*foreign.model.values(), *optimizer_tensors])
    what = f"{kind.value} ({len(foreign.model)} model tensors, {len(foreign.optimizers)} optimizer states)"
    return ExportResult(out, files, {key: dtype_name(t.dtype) for key, t in foreign.model.items()}, total, what)


# --------------------------------------------------------------------------------------------------
# Naming each optimizer's parameters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NamedOptimizer:
    """An optimizer state with its parameters named: key -> name, the groups' names, and which states of 0-dim
    parameters are per element (split by rows like the parameter)."""

    names: dict[Any, str]
    groups: list[list[str]]
    per_element: frozenset[str]


def _optimizer_names(foreign: ForeignCheckpoint, module: Callable[..., nn.Module] | None) -> list[_NamedOptimizer]:
    if not any(o.keys is ParamKeys.POSITION for o in foreign.optimizers):
        return [_by_name(o) for o in foreign.optimizers]
    if module is None:
        raise CheckpointError(
            f"{foreign.where} keys its optimizer state by position, as torch's optimizer.state_dict() does; naming"
            " the parameters needs the LightningModule that wrote it: pass module= (--module package.module:Class)."
            " Or resume from the file directly with trainer.fit(..., ckpt_path=...), which names them through the"
            " live module."
        )
    built, optimizers = _build(module, foreign)
    if len(optimizers) != len(foreign.optimizers):
        raise CheckpointError(
            f"{foreign.where} holds {len(foreign.optimizers)} optimizer states; the module's configure_optimizers()"
            f" returns {len(optimizers)}."
        )
    order = {id(p): n for n, p in built.named_parameters()}
    module_order = [order[id(p)] for p in built.parameters()]
    named = []
    for i, (saved, optimizer) in enumerate(zip(foreign.optimizers, optimizers)):
        groups = [[order[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        if saved.keys is ParamKeys.NAME:
            named.append(_by_name(saved))
            continue
        what = f"Optimizer {i} of {foreign.where}"
        names = name_positions([g["params"] for g in saved.param_groups], groups, module_order, what)
        zero_dim = [n for n, p in built.named_parameters() if p.dim() == 0]
        named.append(_NamedOptimizer(names, groups, frozenset(per_element_states(optimizer) if zero_dim else ())))
    return named


def _by_name(saved: ForeignOptimizer) -> _NamedOptimizer:
    groups = [[str(n) for n in g["params"]] for g in saved.param_groups]
    return _NamedOptimizer({n: n for g in groups for n in g}, groups, frozenset())


def _build(module: Callable[..., nn.Module], foreign: ForeignCheckpoint) -> tuple[nn.Module, list[Optimizer]]:
    """The module on the meta device and the optimizers its ``configure_optimizers()`` returns."""
    hparams = foreign.values.get("hyper_parameters")
    try:
        with torch.device("meta"):
            built = module(**hparams) if isinstance(module, type) and isinstance(hparams, dict) else module()
            configure_model = getattr(built, "configure_model", None)
            if callable(configure_model):
                configure_model()
            optimizers = _optimizers_in(built.configure_optimizers())  # type: ignore[operator]
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: say where it failed
        raise CheckpointError(
            f"Building the module to name {foreign.where}'s optimizer parameters failed ({type(err).__name__}: {err})."
            " The module is built on the meta device and its configure_optimizers() is called without a Trainer."
        ) from None
    return built, optimizers


def _optimizers_in(config: Any) -> list[Optimizer]:
    """The optimizers of whatever ``configure_optimizers()`` returned (an optimizer, a list of them, a dict with
    ``"optimizer"``, a list of such dicts, or ``(optimizers, schedulers)``)."""
    if isinstance(config, Optimizer):
        return [config]
    if isinstance(config, dict) and isinstance(config.get("optimizer"), Optimizer):
        return [config["optimizer"]]
    if isinstance(config, tuple) and len(config) == 2 and isinstance(config[0], (list, tuple)):
        return _optimizers_in(list(config[0]))
    if isinstance(config, (list, tuple)):
        return [o for item in config for o in _optimizers_in(item)]
    raise CheckpointError(f"configure_optimizers() returned {type(config).__name__}, which holds no optimizer.")


# --------------------------------------------------------------------------------------------------
# Writing the directory
# --------------------------------------------------------------------------------------------------


def _write(foreign: ForeignCheckpoint, named: list[_NamedOptimizer], directory: Path) -> bytes:
    """Model, optimizers and trainer state into ``directory``, one tensor in memory at a time, as a full save writes
    them; return the index."""
    save_id = new_save_id()
    model = [(MODEL_PREFIX + key, t) for key, t in foreign.model.items()]
    records = _stream(directory / MODEL_FILE, model, {"ties": json.dumps(foreign.ties), SAVE_ID_METADATA: save_id})
    optimizers, tensors = [], []
    for i, (saved, names) in enumerate(zip(foreign.optimizers, named)):
        meta, stored = _optimizer(i, saved, names, foreign.where)
        optimizers.append(meta)
        tensors += stored
    if tensors:
        records += _stream(directory / OPTIMIZER_FILE, tensors, {SAVE_ID_METADATA: save_id})
    trainer_tensors: dict[str, Tensor] = {}
    records += write_trainer_state(directory, to_json_tree(foreign.values, trainer_tensors), trainer_tensors)
    head = index_head(StateDictType.FULL.value, 1, (1, 1), "FULL_SHARD", save_id,
                      {"ties": foreign.ties, "optimizers": optimizers})
    saved_tensors = [SavedTensor(key, t.shape, t.dtype, split=False) for key, t in model + tensors]
    return encode_index(build_index(head, saved_tensors, records))


def _optimizer(
    i: int, saved: ForeignOptimizer, named: _NamedOptimizer, where: str
) -> tuple[dict[str, Any], list[tuple[str, ForeignTensor]]]:
    """Optimizer ``i``'s index entry (groups by name, plain values, 0-dim parameters' per-element states) and its
    tensors."""
    groups = [(names, {k: v for k, v in group.items() if k != "params"})
              for group, names in zip(saved.param_groups, named.groups)]
    values: dict[str, dict[str, Any]] = {}
    row_states: dict[str, list[str]] = {}
    tensors: list[tuple[str, ForeignTensor]] = []
    for key, state in saved.state.items():
        if key not in named.names:
            raise CheckpointError(f"Optimizer {i} of {where} holds state for {key!r}, which is in none of its groups.")
        name = named.names[key]
        for state_name, value in state.items():
            if isinstance(value, ForeignTensor):
                tensors.append((f"{OPTIMIZER_PREFIX}{i}/{name}/{state_name}", value))
                if state_name in named.per_element and not value.shape:
                    row_states.setdefault(name, []).append(state_name)
            else:
                values.setdefault(name, {})[state_name] = value
    return optimizer_entry(i, groups, values, row_states, {}, f" of {where}"), tensors


def _stream(path: Path, tensors: list[tuple[str, ForeignTensor]], metadata: dict[str, str]) -> list[FileRecord]:
    """Write ``tensors`` into the safetensors file ``path`` one at a time (the model file under the state_dict keys,
    the optimizer file under the index keys, as a full save stores them), each one's CRC-32 in the header."""
    for _, stored in tensors:
        dtype_name(stored.dtype)  # refuses a dtype a checkpoint cannot hold, naming it, before the file is begun
    in_file = {key: key.removeprefix(MODEL_PREFIX) for key, _ in tensors}
    with SafetensorsStreamWriter(path, [(in_file[k], t.dtype, t.shape) for k, t in tensors],
                                 metadata={"format": FORMAT_NAME, **metadata}, checksums=True) as writer:
        for key, stored in tensors:
            writer.write(in_file[key], stored.read_all().reshape(stored.shape))
    return [FileRecord.written(path, None, in_file, header_sha256=writer.header_sha256)]
