"""The one interface of every export of a checkpoint directory (``export_hf``, ``export_peft``, ``export_dcp``,
``export_lightning``, ``export_gguf``, ``consolidate``): what each refuses before it writes anything
(``export_source``, ``require_whole_model``), the model tensors it exports (``model_entries``), its output written
beside the target and moved into place once complete (``staged``), so that a failed export leaves nothing behind, and
what it wrote (``ExportResult``). ``lightning-shard export`` finds the exporters by format in ``EXPORTERS``
(``interop/__init__.py``).

No process group is needed, and memory stays bounded by the largest tensor: each is assembled from its pieces (or
read in blocks of rows), written and dropped before the next is read.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.interop import TORCH_DTYPES
from lightning_shard.checkpoint.io.averaged import Weights, weights_prefix
from lightning_shard.checkpoint.io.file_modes import give_default_modes
from lightning_shard.checkpoint.io.index import LEFT_OUT, iter_index_tensors, read_index
from lightning_shard.checkpoint.io.layout import StoredTensor, require_complete
from lightning_shard.checkpoint.io.reader import FileHandles, read_rows
from lightning_shard.checkpoint.io.storage import Location, local_only, location
from lightning_shard.checkpoint.io.writer import SafetensorsStreamWriter

_BLOCK_BYTES = 16 * 2**20  # rows are read and written in blocks of at most this size


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    output: Path  # the file or directory written
    files: list[str]  # the files holding its tensors: their paths in ``output`` (a directory), or ``output``'s name
    tensors: dict[str, str]  # each tensor written, under its name there -> its type there (a dtype's name; GGUF's)
    total_size: int  # bytes of tensor data written
    description: str  # what was written, as ``lightning-shard export`` reports it ("28 gpt2 tensors")
    skipped: list[str] = field(default_factory=list)  # model keys without the prefix: not exported
    dropped_ties: dict[str, str] = field(default_factory=dict)  # tied names written once: alias -> the name written
    notes: list[str] = field(default_factory=list)  # what a user of the output needs to know


GgufExport = LightningExport = ExportResult  # the names earlier releases gave the GGUF and Lightning exports' results


def export_source(
    checkpoint: str | Path, output: str | Path, overwrite: bool, what: str, file: bool = False, urls: bool = False
) -> tuple[Location, Path, dict[str, Any]]:
    """The checkpoint, the output and the checked index of the export ``what`` (``"export_hf()"``), once nothing
    stands in its way: both local paths (with ``urls``, the checkpoint may be a URL); an existing output only with
    ``overwrite`` (a directory export's also when empty), a directory where a ``file`` goes never, and no output
    inside the checkpoint, whose files it could replace."""
    directory = location(checkpoint) if urls else local_only(checkpoint, what)
    out = local_only(output, what)
    if file and out.is_dir():
        raise CheckpointError(f"The output of {what}, {out}, is a directory: give a file name.")
    if out.exists() and not overwrite and (file or not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists: pass overwrite=True (--overwrite) to replace it." if file else
                              f"Export destination {out} exists and is not empty; pass overwrite=True (--overwrite).")
    index = read_index(directory)
    if isinstance(directory, Path) and out.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(
            f"The output of {what}, {out}, would be written inside the checkpoint {directory}, whose files it could"
            " replace: write it elsewhere."
        )
    return directory, out, index


def require_whole_model(directory: Location, index: dict[str, Any]) -> None:
    """Refuse a checkpoint that left model weights out (see [Note: weights a checkpoint leaves out]): it is not a
    whole model to export."""
    if index.get(LEFT_OUT):
        raise CheckpointError(
            f"{directory} holds only part of the model (saved with save_trainable_only=True or a filter; the"
            f" {len(index[LEFT_OUT])} weights it left out are not in it), so it is not a whole model to export."
            " Export its adapters with --format peft (--adapter-config when it records none), or export a"
            " checkpoint saved with every weight."
        )
    require_complete(directory, index["tensors"])


def model_entries(
    directory: Location, index: dict[str, Any], prefix: str, weights: Weights
) -> tuple[dict[str, StoredTensor], list[str]]:
    """The model tensors of ``weights`` whose keys start with ``prefix`` (a submodule's), keyed without it, and the
    keys without it (not exported)."""
    entries, skipped = {}, []
    for key, entry in iter_index_tensors(index, weights_prefix(index, weights, directory)):
        if key.startswith(prefix):
            entries[key[len(prefix) :]] = entry
        else:
            skipped.append(key)
    if not entries:
        raise CheckpointError(f"No model key of {directory} starts with the export prefix {prefix!r}.")
    return entries, skipped


def skipped_note(skipped: list[str], prefix: str) -> list[str]:
    """What the command says of the model keys an export left out."""
    return [f"{len(skipped)} keys without the prefix {prefix!r} were left out: {', '.join(skipped)}"] if skipped else []


@contextmanager
def staged(out: Path, file: bool = False) -> Iterator[Path]:
    """Where to write ``out``: a new hidden directory beside it (for a ``file``, a path of its name in one). Once the
    block has run, what it wrote is given the modes the umask gives and moved into place, replacing ``out``; when it
    fails, nothing is left behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    written = staging / out.name if file else staging
    try:
        yield written
        give_default_modes(written)
        if file or not out.exists():
            written.replace(out)
        else:  # the old directory moved aside first, then removed
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.replace(old)
            try:
                written.replace(out)
            except BaseException:
                old.replace(out)
                raise
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_json(path: Path, data: Any) -> None:
    """``data`` as the JSON file ``path``, as Hugging Face's tools write theirs."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def torch_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype an export casts floating-point tensors to (``None``: none)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"Unknown export dtype {dtype!r}; choose one of {', '.join(TORCH_DTYPES)}.")
    return getattr(torch, dtype)


def cast_dtypes(entries: dict[str, StoredTensor], dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """The dtype each of ``entries`` is exported in: ``dtype`` (when given) for floating-point ones."""
    return {k: dtype if dtype is not None and e.dtype.is_floating_point else e.dtype for k, e in entries.items()}


def total_size(entries: dict[str, StoredTensor], dtypes: dict[str, torch.dtype]) -> int:
    return sum(math.prod(e.shape) * dtypes[k].itemsize for k, e in entries.items())


def write_tensors_file(
    path: Path, entries: dict[str, StoredTensor], dtypes: dict[str, torch.dtype], handles: FileHandles
) -> None:
    """Write the checkpoint tensors ``entries`` (under the keys given) as the safetensors file ``path``, each in
    ``dtypes[key]``, streamed in blocks of rows."""
    with SafetensorsStreamWriter(path, [(k, dtypes[k], e.shape) for k, e in entries.items()],
                                 metadata={"format": "pt"}) as writer:
        for key, entry in entries.items():
            writer.write(key, (rows.to(dtypes[key]) for rows in _row_blocks(entry, handles)))


def _row_blocks(entry: StoredTensor, handles: FileHandles) -> Iterator[torch.Tensor]:
    """The rows of a tensor in row order, in blocks of about ``_BLOCK_BYTES`` (one row at least), every byte checked
    against its file's checksums as it is read (see [Note: every byte that lands is checked]); a mismatch raises
    before the tensor's last bytes are written, so the export fails and leaves nothing behind. A piece of a version
    1-2 file is checked whole, so it is read whole, in one block."""
    if not entry.shape:
        yield read_rows(entry, 0, 1, handles)
        return
    step = max(1, _BLOCK_BYTES // max(1, math.prod(entry.row_shape) * entry.dtype.itemsize))
    for piece in entry.pieces():  # in row order, covering every row once (docs/checkpoint_format.md)
        rows = step if entry.files.header(piece.file).blocks is not None else piece.hi - piece.lo
        for start in range(piece.lo, piece.hi, rows):
            yield read_rows(entry, start, min(piece.hi, start + rows), handles)
