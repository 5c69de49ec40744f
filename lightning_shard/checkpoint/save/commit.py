"""Committing a save: the index written last, the temporary directory swapped in (or, on object storage, the index
uploaded last), and what a killed save left behind put back or cleaned up (see [Note: atomic checkpoint saves] in
``save/directory.py``, [Note: committing to object storage] in ``io/storage.py``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from lightning_shard.checkpoint.format import (
    INDEX_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SAVE_ID,
    TRAINER_STATE_JSON,
    TRAINER_STATE_TENSORS,
    CheckpointError,
)
from lightning_shard.checkpoint.io.averaged import AVERAGE_FILE
from lightning_shard.checkpoint.io.index import FileRecord
from lightning_shard.checkpoint.io.storage import RemoteDirectory


def commit(tmp: Path, path: Path, index: bytes) -> None:
    """Rank 0: the index into the temporary directory, then swap it in (see [Note: atomic checkpoint saves])."""
    (tmp / INDEX_FILE).write_bytes(index)
    old = None
    if path.exists() or path.is_symlink():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    remove_stale_temporaries(path.parent)


def commit_remote(tmp: Path, remote: RemoteDirectory, trainer_state: list[FileRecord], index: bytes) -> None:
    """Rank 0, once every rank's data files are uploaded: the trainer state, then ``index.json`` in one PUT (the
    commit), then the objects the new index does not name are deleted (see [Note: committing to object storage])."""
    for record in trainer_state:
        remote.put_file(tmp / record.name, record.name)
    remote.write_bytes(INDEX_FILE, index)
    keep = set(json.loads(index)["files"]) | {INDEX_FILE}
    remote.invalidate()
    remote.remove([name for name in remote.names() if name not in keep and is_save_object(name)])


def is_save_object(name: str) -> bool:
    """Whether ``name`` is an object a save writes (and so one a later save may delete): the index, a shard or
    model/optimizer/averaged-weights file, the trainer state, each possibly under a save id."""
    head, _, rest = name.partition(".")
    base = rest if SAVE_ID.fullmatch(head) else name
    return base in _SAVED_NAMES or _SHARD_FILE.fullmatch(base) is not None


_SAVED_NAMES = (INDEX_FILE, TRAINER_STATE_JSON, TRAINER_STATE_TENSORS, MODEL_FILE, OPTIMIZER_FILE, AVERAGE_FILE)
_SHARD_FILE = re.compile(r"shard-\d{5,}-of-\d{5,}\.safetensors")


def refuse_foreign_objects(remote: RemoteDirectory) -> None:
    """Raise unless the URL holds nothing, or only what saves write (a checkpoint, the leftovers of a save that did
    not complete): a save deletes what its index does not name, so it never saves over anything else."""
    remote.invalidate()
    other = [name for name in remote.names() if not is_save_object(name)]
    if other:
        raise CheckpointError(
            f"Refusing to save a checkpoint at {remote}: it holds objects no checkpoint save writes ({other[:5]}),"
            " which a save there would delete. Choose another URL, or remove them."
        )


def refuse_to_replace_other_data(path: Path) -> None:
    """Raise unless ``path`` is free, an empty directory or a checkpoint directory (which a save replaces): a save
    never deletes a file or a directory holding anything else (see [Note: atomic checkpoint saves])."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and ((path / INDEX_FILE).is_file() or not any(path.iterdir())):
        return  # a checkpoint, or an empty directory (made ready for the save): nothing else is lost
    what = "a file" if path.is_file() else "a directory that is not a checkpoint (no index.json)"
    if path.is_symlink() and not path.exists():
        what = "a broken symlink"
    raise CheckpointError(
        f"Refusing to save a checkpoint at {path}: it is {what}, which the save would replace. Remove it or"
        " choose another path; an existing checkpoint directory is replaced atomically."
    )


_STALE = re.compile(r"^\.(.+)\.(tmp|old)-[0-9a-f]{12}$")  # the hidden names saves give their temporary directories


def remove_stale_temporaries(parent: Path) -> list[str]:
    """Clean up what a killed save left in ``parent`` (only hidden directories named as saves name them; never a
    link, never anything else): a ``.<name>.old-<id>`` whose ``<name>`` is missing is the previous checkpoint of a
    save killed between its renames, and is put back under ``<name>``; the other ``.<name>.tmp-<id>`` and
    ``.<name>.old-<id>`` directories are removed. Called by rank 0 after a successful save, when no other save of
    this job is in progress; returns the names removed."""
    removed = []
    stale = [(entry, match) for entry in sorted(parent.iterdir()) if (match := _STALE.match(entry.name))]
    for entry, match in sorted(stale, key=lambda item: item[1].group(2)):  # "old" first: restore before removing
        if not entry.is_dir() or entry.is_symlink():
            continue
        target = parent / match.group(1)
        if match.group(2) == "old" and not (target.exists() or target.is_symlink()):
            os.replace(entry, target)
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed
