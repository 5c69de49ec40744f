"""Export a checkpoint directory as one Lightning checkpoint file (``lightning-shard export CKPT OUT.ckpt --format
lightning``), for ``LightningModule.load_from_checkpoint`` and other tools that read a DDP-style ``.ckpt``.

The file holds what ``Trainer.save_checkpoint`` under DDP writes, less the optimizer state: ``state_dict`` (the
full model under the LightningModule's names, tied weights under each of their names and stored once),
``epoch``, ``global_step``, ``pytorch-lightning_version``, ``hyper_parameters``, the loops, callbacks and schedulers,
all plain data that ``torch.load(path, weights_only=True)`` reads.

Memory stays bounded by the largest tensor, as with ``consolidate``: each full tensor is assembled from its pieces and
written to a file of its own in a staging folder beside the output; ``torch.save`` then reads every tensor from its
file through a memory map, so the pages it has written can be dropped again. The staging folder needs as much disk
as the model, and is removed afterwards.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError
from lightning_shard.checkpoint.io.file_modes import give_default_modes
from lightning_shard.checkpoint.io.index import LEFT_OUT, iter_index_tensors, model_ties
from lightning_shard.checkpoint.io.layout import require_complete
from lightning_shard.checkpoint.io.reader import FileHandles, read_tensor
from lightning_shard.checkpoint.load.load import load_trainer_state
from lightning_shard.checkpoint.tools.consolidate import checkpoint_location
from lightning_shard.checkpoint.tools.export import temporary_directory_beside

LIGHTNING_VERSION = "pytorch-lightning_version"


@dataclass(frozen=True)
class LightningExport:
    """What ``export_lightning`` wrote: the file, the number of model tensors, and their bytes."""

    output: Path
    tensors: int
    total_size: int


def export_lightning(checkpoint_dir: str | Path, output: str | Path, overwrite: bool = False) -> LightningExport:
    """Write the checkpoint at ``checkpoint_dir`` (written by the Trainer, at any world size; a local directory or a
    URL) as one Lightning checkpoint file at ``output``. An existing file is replaced only with ``overwrite``."""
    directory, output = checkpoint_location(checkpoint_dir), Path(output)
    if output.is_dir():
        raise CheckpointError(f"The Lightning checkpoint's path {output} is a directory: give a file name (OUT.ckpt).")
    if output.exists() and not overwrite:
        raise CheckpointError(f"{output} exists: pass overwrite=True (--overwrite) to replace it.")
    state, index = load_trainer_state(directory)
    if LIGHTNING_VERSION not in state:
        raise CheckpointError(
            f"{checkpoint_dir} holds no Trainer state (no {LIGHTNING_VERSION!r}): fabric.save wrote it, and"
            " LightningModule.load_from_checkpoint needs a Trainer's. Export its weights with --format hf or"
            " `lightning-shard consolidate` instead."
        )
    if index.get(LEFT_OUT):
        raise CheckpointError(
            f"{checkpoint_dir} was saved without {len(index[LEFT_OUT])} model weights (save_trainable_only or a"
            " filter), so it cannot become a whole Lightning checkpoint: load it into the model with its base weights"
            " and save that, or export the adapters with --format peft."
        )
    require_complete(directory, index["tensors"])
    staging = temporary_directory_beside(output)
    try:
        state_dict, total = _staged_state_dict(index, staging)
        count = len(state_dict)
        checkpoint = {**state, "state_dict": state_dict}
        tmp = staging / output.name
        torch.save(checkpoint, tmp)
        del checkpoint, state_dict
        give_default_modes(tmp)
        tmp.replace(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return LightningExport(output, count, total)


def _staged_state_dict(index: dict[str, Any], staging: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Every model tensor in full, each read into a file of its own under ``staging`` and mapped from there; tied
    aliases share their stored tensor. Returns the state dict and the bytes of the stored tensors."""
    state_dict: dict[str, torch.Tensor] = {}
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
