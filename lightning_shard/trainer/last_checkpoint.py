"""``trainer.fit(ckpt_path="last")`` with a ``ModelCheckpoint`` on object storage.

[Note: "last" on object storage]
Lightning finds "last" by listing each ``ModelCheckpoint``'s directory with fsspec and comparing the entries'
modified times. fsspec lists a bucket's entries without their protocol (``bucket/run/last.ckpt``), which Lightning
then looks up on the local file system: it finds nothing, warns "there is no last checkpoint available", trains from
step 0 and writes ``last-v1.ckpt`` beside the good one (and a checkpoint directory on object storage has no modified
time of its own to compare). For a Trainer whose strategy is a ``ShardStrategy``, "last" is first looked for here in
every ``ModelCheckpoint`` whose ``dirpath`` is a URL: the newest ``last.ckpt``/``last-vN.ckpt`` there, by the time its
``index.json`` (written last: the save's commit) was written, under its full URL. Where none is found, Lightning's own
lookup runs as before (local directories, fault-tolerant checkpoints, its warning).
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_shard.checkpoint.format import INDEX_FILE
from lightning_shard.checkpoint.io.storage import is_url


def newest_last_checkpoint(trainer: pl.Trainer, storage_options: dict[str, Any] | None) -> str | None:
    """The URL of the newest committed ``last`` checkpoint in the URL directories of the Trainer's
    ``ModelCheckpoint`` callbacks, or ``None``."""
    import fsspec

    found: list[tuple[Any, str]] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None or not is_url(callback.dirpath):
            continue
        fs, root = fsspec.core.url_to_fs(str(callback.dirpath), **(storage_options or {}))
        last = re.compile(rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-v\d+)?{re.escape(callback.FILE_EXTENSION)}$")
        if not fs.exists(root):
            continue
        for entry in fs.ls(root, detail=False, refresh=True):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            index = f"{entry.rstrip('/')}/{INDEX_FILE}"
            if last.match(name) and fs.exists(index):
                found.append((fs.modified(index), fs.unstrip_protocol(entry.rstrip("/"))))
    return max(found)[1] if found else None


def _parse_ckpt_path(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, *args: Any, **kwargs: Any) -> Any:
    """Lightning's ``_parse_ckpt_path``, with "last" first looked up by a strategy that can (``ShardStrategy``'s
    ``find_last_checkpoint``)."""
    find = getattr(self.trainer.strategy, "find_last_checkpoint", None)
    if ckpt_path == "last" and find is not None:
        found = find(self.trainer)
        if found is not None:
            return found
    return _LIGHTNINGS_PARSE_CKPT_PATH(self, state_fn, ckpt_path, *args, **kwargs)


_LIGHTNINGS_PARSE_CKPT_PATH = _CheckpointConnector._parse_ckpt_path
_CheckpointConnector._parse_ckpt_path = _parse_ckpt_path  # type: ignore[method-assign]  # see the note
