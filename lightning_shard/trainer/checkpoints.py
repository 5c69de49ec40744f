"""The Trainer's checkpoint hooks on checkpoint directories: Lightning's checkpoint dict in, directories out, and
back. ``ShardStrategy``'s overrides call these; the format lives in ``lightning_shard.checkpoint``."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.agreement import agree
from lightning_shard.checkpoint.load import ShardedCheckpointSource, load_model, load_optimizers, load_trainer_state
from lightning_shard.common.checkpoint import as_trainer_checkpoint
from lightning_shard.engine.sharded_module import ShardedModule


def read_trainer_checkpoint(directory: Path) -> dict[str, Any]:
    """Lightning's checkpoint dict for ``directory``: the trainer state, with the model and optimizer entries standing
    for the directory's tensors (read into the shards later, by ``load_model_state`` and ``load_optimizer_states``).
    Reads what Fabric wrote too. Collective; never unpickles."""
    state, index = agree(lambda: load_trainer_state(directory))
    state = as_trainer_checkpoint(state)
    source = ShardedCheckpointSource(directory, index)
    state["state_dict"] = source
    if index.get("optimizers"):
        state["optimizer_states"] = [source] * len(index["optimizers"])
    return state


def load_model_state(engine: ShardedModule, module: nn.Module, checkpoint: Mapping[str, Any], strict: bool) -> None:
    """This rank's rows of every parameter and every buffer, from the directory ``read_trainer_checkpoint`` read."""
    source = checkpoint["state_dict"]
    if not isinstance(source, ShardedCheckpointSource):
        raise TypeError(
            "ShardStrategy loads model state from its checkpoint directories; to load a plain model file use"
            " lightning_shard.load_safetensors_into()."
        )
    result = load_model(engine, module, source.directory, source.index, strict=strict)
    if result.missing_keys or result.unexpected_keys:
        rank_zero_warn(
            f"Loaded {source.directory} with strict=False: missing keys {result.missing_keys},"
            f" unexpected keys {result.unexpected_keys}."
        )


def load_optimizer_states(
    engine: ShardedModule, optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any], strict: bool
) -> None:
    sources = checkpoint["optimizer_states"]
    if sources:
        load_optimizers(engine, optimizers, sources[0].directory, sources[0].index, strict=strict)


def remove_checkpoint_dir(path: Path) -> None:
    """Remove a checkpoint directory (or a file or link left at its place), as ModelCheckpoint's ``save_top_k``
    asks; never follows a link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def saves_in_background(io: CheckpointIO | None) -> bool:
    """Whether the Trainer's CheckpointIO plugin asks for background saves (Lightning's ``AsyncCheckpointIO`` around
    the default IO). Checkpoints are written by every rank, not through a CheckpointIO plugin, so any other plugin,
    which would be ignored, is refused."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    if io is None or type(io) is TorchCheckpointIO:
        return False
    if type(io) is AsyncCheckpointIO and type(io.checkpoint_io or TorchCheckpointIO()) is TorchCheckpointIO:
        return True
    raise TypeError(
        f"ShardStrategy writes checkpoints itself (safetensors and JSON from every rank); the CheckpointIO"
        f" plugin {type(io).__name__} would not be used. Remove it from the Trainer's plugins (AsyncCheckpointIO()"
        f" around the default IO is supported: it saves in the background)."
    )
