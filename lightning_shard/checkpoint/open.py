"""The opener of every checkpoint: what a path holds (``detect``), and the one way to load it:
``open_checkpoint(path)`` returns a ``CheckpointSource`` whatever the format, which gives Lightning's checkpoint dict
and fills a sharded model and its optimizers.

Formats read:

- a lightning_shard checkpoint directory (``index.json``: docs/checkpoint_format.md);
- a Lightning ``.ckpt`` file, the ``torch.save`` archive DDP, single-device training, FSDPStrategy with
  ``state_dict_type="full"`` and ``fabric.save`` under those write (``interop/lightning_ckpt.py``);
- a ``torch.distributed.checkpoint`` directory (``.metadata``), as ModelParallelStrategy (FSDP2) and FSDPStrategy
  with ``state_dict_type="sharded"`` write it (``interop/dcp.py``).

Anything else is refused with a ``CheckpointError`` that says what the path holds. No format is unpickled in full
(see [Note: no pickle runs]).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_shard.checkpoint.format import INDEX_FILE, CheckpointError
from lightning_shard.checkpoint.interop.foreign import ForeignCheckpoint, load_foreign_model, load_foreign_optimizers
from lightning_shard.checkpoint.io.storage import Location, RemoteDirectory, is_url
from lightning_shard.checkpoint.load.directory import (
    LoadResult,
    load_model_and_optimizers,
    load_trainer_state,
)
from lightning_shard.engine.sharded_module import ShardedModule


class CheckpointKind(enum.Enum):
    """The formats ``open_checkpoint`` reads."""

    SHARD_DIRECTORY = "a lightning_shard checkpoint directory"
    LIGHTNING_CKPT = "a Lightning checkpoint file (torch.save)"
    DCP_DIRECTORY = "a torch.distributed.checkpoint directory"


def detect(path: Path) -> CheckpointKind:
    """What ``path`` holds, from its names and first bytes only; ``CheckpointError`` saying what was found when it
    is none of ``CheckpointKind``."""
    from lightning_shard.checkpoint.interop.dcp import METADATA_FILE
    from lightning_shard.checkpoint.interop.safe_pickle import is_torch_zip

    if path.is_dir():
        if (path / INDEX_FILE).exists():
            return CheckpointKind.SHARD_DIRECTORY
        if (path / METADATA_FILE).exists():
            return CheckpointKind.DCP_DIRECTORY
        names = sorted(p.name for p in path.iterdir())[:8]
        raise CheckpointError(  # Lightning's words first, for code and log searches written for its strategies
            f"The path {str(path)!r} does not point to a valid checkpoint: {path} is a directory holding neither"
            f" {INDEX_FILE} (a lightning_shard checkpoint) nor {METADATA_FILE} (a torch.distributed.checkpoint); it"
            f" holds {names or 'nothing'}."
        )
    if not path.exists():
        raise CheckpointError(f"The checkpoint {path} does not exist.")
    if not path.is_file():
        raise CheckpointError(f"The checkpoint {path} is not a regular file or a directory; refusing to read it.")
    if is_torch_zip(path):
        return CheckpointKind.LIGHTNING_CKPT
    hint = (" It looks like a safetensors file: load weights with lightning_shard.load_safetensors_into()."
            if path.suffix == ".safetensors" else
            " It looks like a GGUF model file: start a fit from it with lightning_shard.load_gguf_into()."
            if path.suffix == ".gguf" else "")
    raise CheckpointError(
        f"The path {str(path)!r} does not point to a valid checkpoint: {path} is a file but not a torch.save zip"
        " archive (a Lightning .ckpt), the only single-file checkpoint read"
        f" (files written by torch.save(..., _use_new_zipfile_serialization=False) are not).{hint}"
    )


class CheckpointSource(ABC):
    """A checkpoint opened for loading. Its methods are collective: every rank calls them, in the same order."""

    path: Path
    kind: CheckpointKind

    @abstractmethod
    def trainer_state(self) -> dict[str, Any]:
        """Lightning's checkpoint dict without the model and optimizer state (loops, callbacks, schedulers,
        hyperparameters; a Fabric checkpoint's own values)."""

    @property
    @abstractmethod
    def optimizer_count(self) -> int:
        """How many optimizer states the checkpoint holds."""

    @abstractmethod
    def load_model_and_optimizers(
        self, engine: ShardedModule, module: nn.Module | None, optimizers: Sequence[Optimizer], strict: bool
    ) -> LoadResult:
        """Fill this rank's rows of ``module`` (sharded as ``engine``; ``None``: not the model) and of ``optimizers``
        (all the checkpoint holds, in order, or none)."""


class ShardDirectory(CheckpointSource):
    """A lightning_shard checkpoint directory (see docs/checkpoint_format.md)."""

    kind = CheckpointKind.SHARD_DIRECTORY

    def __init__(self, path: Location) -> None:
        self.path = path  # type: ignore[assignment]
        self._state, self.index = load_trainer_state(path)

    def trainer_state(self) -> dict[str, Any]:
        return dict(self._state)

    @property
    def optimizer_count(self) -> int:
        return len(self.index.get("optimizers", []))

    def load_model_and_optimizers(
        self, engine: ShardedModule, module: nn.Module | None, optimizers: Sequence[Optimizer], strict: bool
    ) -> LoadResult:
        """Both in one read: each shard file opened once for the model's rows and the optimizers'."""
        return load_model_and_optimizers(engine, module, optimizers or None, self.path, self.index, strict)


class ForeignSource(CheckpointSource):
    """A checkpoint written by another strategy: a Lightning ``.ckpt`` or a DCP directory."""

    def __init__(self, kind: CheckpointKind, checkpoint: ForeignCheckpoint) -> None:
        self.path, self.kind, self.checkpoint = checkpoint.path, kind, checkpoint

    def trainer_state(self) -> dict[str, Any]:
        return dict(self.checkpoint.values)

    @property
    def optimizer_count(self) -> int:
        return len(self.checkpoint.optimizers)

    def load_model_and_optimizers(
        self, engine: ShardedModule, module: nn.Module | None, optimizers: Sequence[Optimizer], strict: bool
    ) -> LoadResult:
        result = LoadResult([], []) if module is None else load_foreign_model(engine, module, self.checkpoint, strict)
        if optimizers:
            load_foreign_optimizers(engine, optimizers, self.checkpoint, strict)
        return result


def open_checkpoint(
    path: str | Path | RemoteDirectory, module_key: str | None = None, optimizer_keys: Sequence[str] = ()
) -> CheckpointSource:
    """Open the checkpoint at ``path``, whatever its format (see the module docstring). ``module_key`` and
    ``optimizer_keys`` name where a checkpoint written by ``fabric.save`` under another strategy keeps the module
    and the optimizers (the keys of the state dict it saved); a Trainer's checkpoint needs neither. Reads metadata
    only: tensors are read when the model and optimizers are loaded. Not collective: run it under ``agree``.
    A ``RemoteDirectory`` (a URL, ``storage.location``) is read as a lightning_shard checkpoint directory; other
    formats are read from local paths only."""
    if isinstance(path, RemoteDirectory):
        return ShardDirectory(path)
    if is_url(path):
        raise CheckpointError(
            f"open_checkpoint({str(path)!r}): a URL is opened through lightning_shard.checkpoint.io.storage.location(),"
            " which takes its storage_options."
        )
    path = Path(path)
    kind = detect(path)
    if kind is CheckpointKind.SHARD_DIRECTORY:
        return ShardDirectory(path)
    return ForeignSource(kind, read_foreign(path, kind, module_key, optimizer_keys))


def read_foreign(
    path: Path, kind: CheckpointKind, module_key: str | None = None, optimizer_keys: Sequence[str] = ()
) -> ForeignCheckpoint:
    """The foreign checkpoint at ``path`` (``kind`` as ``detect`` gave it)."""
    if kind is CheckpointKind.LIGHTNING_CKPT:
        from lightning_shard.checkpoint.interop.lightning_ckpt import read_lightning_ckpt

        return read_lightning_ckpt(path, module_key, optimizer_keys)
    if kind is CheckpointKind.DCP_DIRECTORY:
        from lightning_shard.checkpoint.interop.dcp import read_dcp

        return read_dcp(path, module_key, optimizer_keys)
    raise CheckpointError(f"{path} is {kind.value}, not a foreign checkpoint.")
