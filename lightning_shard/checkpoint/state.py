"""``save_checkpoint`` / ``load_checkpoint``: a sharded module, its optimizers and plain values, as one checkpoint
directory, from plain PyTorch (the Lightning front ends use the same files through their own hooks).

The directory is the format of ``docs/checkpoint_format.md``: every rank writes its rows of each parameter and
of each per-parameter optimizer tensor (``layout="sharded"``), or rank 0 streams full tensors (``"full"``);
either loads at any world size, each rank reading only its rows. Plain values (numbers, strings, lists, dicts,
tensors) go into the trainer state, never pickled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.agreement import agree, broadcast_str
from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.load import LoadResult, load_model, load_optimizers, load_trainer_state
from lightning_shard.checkpoint.save import StateDictType, save_checkpoint_dir
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of

if TYPE_CHECKING:
    from lightning_shard.checkpoint.background import BackgroundSaver

TRAINER_PLACEHOLDERS = ("state_dict", "optimizer_states")  # keys of Lightning's checkpoint dict the writer fills


def save_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    values: Mapping[str, Any] | None = None,
    layout: StateDictType | str = "sharded",
    saver: BackgroundSaver | None = None,
) -> None:
    """Write ``module`` (sharded by ``lightning_shard``), the state of ``optimizers`` (built on its shards) and
    ``values`` as a checkpoint directory at ``path``, atomically. Collective: every rank must call it.

    With a ``saver`` the files are written in the background: this returns once each rank has copied its rows
    aside, and ``saver.wait()`` (or the next save) waits for the directory (see [Note: background saves])."""
    engine = _engine(module, "save_checkpoint")
    rest = dict(values or {})
    reserved = [k for k in rest if k in TRAINER_PLACEHOLDERS]
    if reserved:
        raise ValueError(f"save_checkpoint: the value names {reserved} are reserved by the checkpoint format.")
    if optimizers:
        rest["optimizer_states"] = []  # tells the writer to store optimizer state
    target = Path(broadcast_str(str(path)))
    args = (engine, module, list(optimizers), rest, target, StateDictType.parse(layout))
    if saver is not None:
        saver.save(*args)
    else:
        save_checkpoint_dir(*args)


def load_checkpoint(
    path: str | Path, module: nn.Module, optimizers: Sequence[Optimizer] = (), strict: bool = True
) -> tuple[dict[str, Any], LoadResult]:
    """Fill ``module`` and ``optimizers`` in place from the checkpoint directory at ``path`` (written at any world
    size, by either front end or by ``save_checkpoint``); return its plain values and the model's missing and
    unexpected keys. ``optimizers`` must be all the checkpoint holds, in order, or none. Collective."""
    engine = _engine(module, "load_checkpoint")
    directory = Path(broadcast_str(str(path)))
    values, index = agree(lambda: load_trainer_state(directory))
    for key in TRAINER_PLACEHOLDERS:
        values.pop(key, None)
    stored = len(index.get("optimizers", []))
    if optimizers and len(optimizers) != stored:
        raise CheckpointError(
            f"{directory} stores the state of {stored} optimizer(s) and {len(optimizers)} were given to load it"
            " into: pass all of them, in the order they were saved, or none."
        )
    result = load_model(engine, module, directory, index, strict=strict)
    if optimizers:
        load_optimizers(engine, optimizers, directory, index, strict=strict)
    return values, result


def _engine(module: nn.Module, caller: str) -> ShardedModule:
    engine = sharded_module_of(module)
    if engine is None:
        raise TypeError(f"{caller}() needs a module sharded by lightning_shard; this {type(module).__name__} is not.")
    return engine
