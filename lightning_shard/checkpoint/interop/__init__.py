"""Other formats, each read and written in one place: Hugging Face's safetensors layout (``hf``), peft adapters
(``peft``), ``torch.distributed.checkpoint`` directories (``dcp``), Lightning ``.ckpt`` files (``lightning_ckpt``,
whose pickles ``safe_pickle`` reads without running them) and GGUF (``gguf``). What another format's checkpoint holds
is described in one form and loaded into a sharded model by ``foreign``; every export shares one interface and one
result (``export``), and ``EXPORTERS`` names the exporters by the format ``lightning-shard export --format`` takes.
Builds on ``load``, ``io`` and ``format``."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_shard.checkpoint.interop.export import ExportResult

TORCH_DTYPES = ("float32", "bfloat16", "float16")  # what --dtype casts to
GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")  # ... and, for --format gguf, what it writes


@dataclass(frozen=True)
class Exporter:
    """A format ``lightning-shard export`` writes: its function, imported when it is first used, the options of the
    command it takes (as keyword arguments of the same names, besides ``overwrite``), the ``--dtype`` values among
    them, and the options it needs (each with what it is)."""

    function: str  # "module:name"
    options: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    needs: tuple[tuple[str, str], ...] = ()
    scope: str = ""  # for a format that takes no options: what it writes instead

    def __call__(self, checkpoint: str | Path, output: str | Path, **options: Any) -> ExportResult:
        module, _, name = self.function.partition(":")
        return getattr(importlib.import_module(module), name)(checkpoint, output, **options)


EXPORTERS = {
    "hf": Exporter("lightning_shard.checkpoint.interop.hf:export_hf",
                   ("prefix", "dtype", "max_shard_size", "config", "weights", "base"), TORCH_DTYPES),
    "peft": Exporter("lightning_shard.checkpoint.interop.peft:export_peft",
                     ("prefix", "dtype", "weights", "adapter_config", "adapter_name"), TORCH_DTYPES),
    "dcp": Exporter("lightning_shard.checkpoint.interop.dcp:export_dcp", scope="the whole checkpoint as it is"),
    "lightning": Exporter("lightning_shard.checkpoint.interop.lightning_ckpt:export_lightning",
                          scope="the whole model as the Trainer saved it"),
    "gguf": Exporter("lightning_shard.checkpoint.interop.gguf:export_gguf",
                     ("prefix", "dtype", "config", "tokenizer", "weights"), GGUF_DTYPES + TORCH_DTYPES,
                     needs=(("config", "the model's config.json (its metadata)"),)),
}
