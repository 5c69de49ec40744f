"""The Trainer's checkpoint hooks on checkpoint directories: Lightning's checkpoint dict in, directories out, and
back. ``ShardStrategy``'s overrides call these; the format lives in ``lightning_shard.checkpoint``."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, cast

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.io.storage import Location
from lightning_shard.checkpoint.open import CheckpointSource, open_checkpoint
from lightning_shard.checkpoint.save.commit import is_save_object
from lightning_shard.common.checkpoint import as_trainer_checkpoint
from lightning_shard.engine.sharded_module import ShardedModule

LIGHTNING_VERSION = "pytorch-lightning_version"  # in every checkpoint Trainer.save_checkpoint writes


def read_trainer_checkpoint(path: Location) -> dict[str, Any]:
    """Lightning's checkpoint dict for the checkpoint at ``path`` (a checkpoint directory, Trainer or Fabric written,
    a Lightning ``.ckpt`` or a DCP directory: ``lightning_shard.checkpoint.open``): the trainer state,
    with the model and optimizer entries standing for the checkpoint's tensors (read into the shards later, by
    ``load_model_state`` and ``load_optimizer_states``). Collective; never unpickles."""
    source = agree(lambda: open_checkpoint(path))
    state = as_trainer_checkpoint(source.trainer_state())
    if LIGHTNING_VERSION not in state:  # Lightning's own checks would fail on it with a bare KeyError
        raise CheckpointError(
            f"{path} holds no Trainer state (no {LIGHTNING_VERSION!r}, loops or callbacks): Trainer.save_checkpoint"
            " did not write it, so there is no run to resume. To start from its weights, write them as a"
            " .safetensors file and load it with lightning_shard.load_safetensors_into() (docs/migration.md)."
        )
    state["state_dict"] = source
    if source.optimizer_count:
        state["optimizer_states"] = [source] * source.optimizer_count
    return state


class OptimizerStates(Enum):
    """What a checkpoint dict's ``"optimizer_states"`` holds once the model's load has read them too."""

    READ_WITH_THE_MODEL = "read with the model"


def load_model_state(
    engine: ShardedModule,
    module: nn.Module,
    checkpoint: Mapping[str, Any],
    strict: bool,
    optimizers: Sequence[Optimizer] = (),
) -> None:
    """This rank's rows of every parameter and every buffer, from the checkpoint ``read_trainer_checkpoint`` read.
    With ``optimizers`` (a fit that restores them next), their states are read and loaded in the same pass, each
    shard file opened once for both, as Lightning's ``FSDPStrategy`` loads both in its ``load_checkpoint``;
    ``load_optimizer_states`` then finds them loaded. A checkpoint holding another number of optimizer states is
    refused before anything is read into the model."""
    source = checkpoint["state_dict"]
    if not isinstance(source, CheckpointSource):
        raise TypeError(
            "ShardStrategy loads model state from its checkpoint directories; to load a plain model file use"
            " lightning_shard.load_safetensors_into()."
        )
    together = list(optimizers) if checkpoint.get("optimizer_states") else []
    if together and source.optimizer_count != len(together):
        raise CheckpointError(  # Lightning's words first, for code and log searches written for its strategies
            f"You have configured {len(together)} optimizers but the checkpoint contains {source.optimizer_count}"
            " optimizers to load. Please resume training with the same number of optimizers or edit the checkpoint"
            f" manually to remove states. The checkpoint {source.path} holds {source.optimizer_count} optimizer"
            f" states; the model has {len(together)}: configure_optimizers must return as many, in the order they"
            " were saved. Nothing was loaded."
        )
    result = source.load_model_and_optimizers(engine, module, together, strict)
    if together:
        cast(dict[str, Any], checkpoint)["optimizer_states"] = [OptimizerStates.READ_WITH_THE_MODEL] * len(together)
    if result.missing_keys or result.unexpected_keys:
        rank_zero_warn(
            f"Loaded {source.path} with strict=False: missing keys {result.missing_keys},"
            f" unexpected keys {result.unexpected_keys}."
        )


def load_optimizer_states(
    engine: ShardedModule, optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any], strict: bool
) -> None:
    sources = checkpoint["optimizer_states"]
    if sources and sources[0] is not OptimizerStates.READ_WITH_THE_MODEL:
        sources[0].load_model_and_optimizers(engine, None, optimizers, strict)


def remove_checkpoint_dir(path: Location) -> None:
    """Remove a checkpoint directory (or a file or link left at its place), as ModelCheckpoint's ``save_top_k``
    asks; never follows a link. At a URL: the objects under it that a save wrote (nothing else)."""
    if not isinstance(path, Path):
        path.remove([name for name in path.names() if is_save_object(name)])
    elif path.is_dir() and not path.is_symlink():
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
