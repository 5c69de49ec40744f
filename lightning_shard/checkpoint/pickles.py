"""Files in ``torch.save``'s format, which are never loaded: unpickling a file can run arbitrary code.

A reader that expects safetensors calls ``refuse_pickle`` first, so that such a file is named for what it is
(a pickle, refused by design) rather than reported as a damaged safetensors file.
"""

from __future__ import annotations

from pathlib import Path

from lightning_shard.checkpoint.format import CheckpointError

# torch.save writes a zip archive (since torch 1.6) holding a pickle; older files, and _use_new_zipfile_serialization
# =False, are a bare pickle, whose first byte is the PROTO opcode. A safetensors file starts with its header's length,
# a little-endian u64 that these bytes would make absurdly large.
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = b"\x80"


def is_pickle(path: Path) -> bool:
    """Whether the file at ``path`` starts as ``torch.save``'s output does (a zip archive or a pickle)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(_ZIP_MAGIC) or head[:1] == _PICKLE_PROTO


def refuse_pickle(path: Path) -> None:
    """Raise ``CheckpointError`` if ``path`` is a file in ``torch.save``'s format, saying why and how to convert it."""
    if path.is_file() and is_pickle(path):
        raise CheckpointError(
            f"{path} is a pickle (the torch.save format of .pt, .bin and Lightning .ckpt files), not safetensors."
            " lightning_shard never loads pickles, because unpickling a file can run arbitrary code. Convert it once,"
            " in a process you trust: torch.load it and write its tensors with"
            " safetensors.torch.save_file(state_dict, 'model.safetensors'), or save the model with fabric.save()"
            " (a checkpoint directory); then load that (see docs/migration.md, 'Bringing weights from an"
            " FSDPStrategy checkpoint')."
        )
