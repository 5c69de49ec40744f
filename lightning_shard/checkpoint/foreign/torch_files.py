"""Files in ``torch.save``'s format, which are read only with the restricted reader (``safe_pickle``): unpickling one in
full can run arbitrary code.

``is_pickle`` tells such a file from a safetensors one, so that a reader names it for what it is rather than
reporting a damaged safetensors file; ``is_torch_zip`` tells the zip archives the restricted reader takes.
"""

from __future__ import annotations

from pathlib import Path

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


def is_torch_zip(path: Path) -> bool:
    """Whether ``path`` is a file that starts as the zip archive ``torch.save`` writes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError:
        return False
