"""``save_checkpoint`` / ``load_checkpoint``: a sharded module, its optimizers and plain values, as one checkpoint
directory, from plain PyTorch (the Lightning front ends use the same files through their own hooks).

The directory is the format of ``docs/checkpoint_format.md``: every rank writes its rows of each parameter and
of each per-parameter optimizer tensor (``layout="sharded"``), or rank 0 streams full tensors (``"full"``);
either loads at any world size, each rank reading only its rows. Plain values (numbers, strings, lists, dicts,
tensors) go into the trainer state, never pickled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.format.trainer_state import TRAINER_OPTIMIZERS, TRAINER_PLACEHOLDERS
from lightning_shard.checkpoint.io.agreement import agree, broadcast_str
from lightning_shard.checkpoint.io.selection import MODEL_SELECTION_KEY, ModelSelection
from lightning_shard.checkpoint.io.storage import Location, RemoteDirectory, location
from lightning_shard.checkpoint.load.directory import LoadResult, sharded_engine
from lightning_shard.checkpoint.open import open_checkpoint
from lightning_shard.checkpoint.save.directory import save_checkpoint_dir
from lightning_shard.engine.option_choices import StateDictType

if TYPE_CHECKING:
    from lightning_shard.checkpoint.save.background import BackgroundSaver


def save_checkpoint(
    path: str | Path | RemoteDirectory,
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    values: Mapping[str, Any] | None = None,
    layout: StateDictType | str = "sharded",
    saver: BackgroundSaver | None = None,
    storage_options: dict[str, Any] | None = None,
    selection: ModelSelection | None = None,
) -> None:
    """Write ``module`` (sharded by ``lightning_shard``), the state of ``optimizers`` (built on its shards) and
    ``values`` as a checkpoint directory at ``path``, atomically. Collective: every rank must call it.

    ``selection`` (e.g. ``ModelSelection(SavedParameters.TRAINABLE)``) leaves part of the model out; the
    checkpoint then records what it left out and a load checks it (see [Note: weights a checkpoint leaves out]).

    With a ``saver`` the files are written in the background: this returns once each rank has copied its rows
    aside, and ``saver.wait()`` (or the next save) waits for the directory (see [Note: background saves]).

    ``path`` may be a URL of any protocol fsspec knows (``s3://bucket/run/ck``); ``storage_options`` go to its file
    system (see [Note: committing to object storage])."""
    engine = sharded_engine(module, "save_checkpoint()", TypeError)
    rest = dict(values or {})
    reserved = [k for k in rest if k in TRAINER_PLACEHOLDERS]
    if reserved:
        raise ValueError(f"save_checkpoint: the value names {reserved} are reserved by the checkpoint format.")
    if optimizers:
        rest[TRAINER_OPTIMIZERS] = []  # tells the writer to store optimizer state
    if selection is not None:
        rest[MODEL_SELECTION_KEY] = selection
    target = _target(path, storage_options)
    args = (engine, module, list(optimizers), rest, target, StateDictType.parse(layout))
    if saver is not None:
        saver.save(*args)
    else:
        save_checkpoint_dir(*args)


def load_checkpoint(
    path: str | Path | RemoteDirectory,
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    strict: bool = True,
    *,
    module_key: str | None = None,
    optimizer_keys: Sequence[str] = (),
    storage_options: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], LoadResult]:
    """Fill ``module`` and ``optimizers`` in place from the checkpoint at ``path``; return its plain values and the
    model's missing and unexpected keys. ``path`` is a checkpoint directory (written at any world size, by either
    front end or by ``save_checkpoint``), a Lightning ``.ckpt`` file or a ``torch.distributed.checkpoint`` directory
    (``lightning_shard.checkpoint.open``; ``module_key`` and ``optimizer_keys`` name where a
    ``fabric.save`` of another strategy keeps the module and optimizers). ``optimizers`` must be all the checkpoint
    holds, in order, or none. A URL (``s3://...``, with ``storage_options`` for its file system) is read as a
    checkpoint directory, each rank reading only its byte ranges. Collective."""
    target = _target(path, storage_options)
    engine = sharded_engine(module, "load_checkpoint()", TypeError)
    source = agree(lambda: open_checkpoint(target, module_key, optimizer_keys))
    values = source.trainer_state()
    for key in TRAINER_PLACEHOLDERS:
        values.pop(key, None)
    stored = source.optimizer_count
    if optimizers and len(optimizers) != stored:
        raise CheckpointError(
            f"{target} stores the state of {stored} optimizer(s) and {len(optimizers)} were given to load it"
            " into: pass all of them, in the order they were saved, or none."
        )
    return values, source.load_model_and_optimizers(engine, module, optimizers or [], strict)


def _target(path: str | os.PathLike[str] | RemoteDirectory, storage_options: dict[str, Any] | None) -> Location:
    """Where ``path`` (rank 0's, for every rank) lives; a ``RemoteDirectory`` already is such a place, with its own
    file system options (others given beside it are refused: they would not be used)."""
    if isinstance(path, RemoteDirectory):
        if storage_options:
            raise TypeError(
                f"storage_options were given with {path}, a RemoteDirectory whose file system already has its own"
                " options. Pass the URL as a string with these storage_options, or the RemoteDirectory alone."
            )
        return path
    return location(broadcast_str(os.fspath(path)), storage_options)  # the same on every rank, errors too
