"""The files of one checkpoint as a load sees them: each opened only when something is read from it, checked first.

See [Note: checkpoints are untrusted] in ``format/__init__.py``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from lightning_shard.checkpoint import format as checkpoint_format
from lightning_shard.checkpoint.format import INDEX_FILE, CheckpointError, member_path, refuse_unplain_name
from lightning_shard.checkpoint.format.safetensors_header import (
    SafetensorsHeader,
    TensorTable,
    header_length,
    parse_header,
    recorded_save_id,
)

if TYPE_CHECKING:
    from lightning_shard.checkpoint.io.storage import Location, MemberURL

_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # where there is none, every name is checked by ``member_path``
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)  # never blocks on a pipe


class CheckpointFiles:
    """The files of one checkpoint directory as one load sees them (see [Note: checkpoints are untrusted]).

    Each file is opened only when something is read from it, checked to be a regular file inside the directory
    of the size the index records (``sizes``; ``None`` for files no index describes, such as a Hugging Face model),
    and its safetensors header is read once and kept for the rest of the load. ``headers_read`` lists the files
    whose headers were read, in order: what this process touched. ``checksums_in_headers``: every safetensors file
    of the checkpoint records checksums (versions 2 to 4); a file that records none is refused. ``seal``: what a
    sealed index (version 4) vouches for, checked as each file is read (see [Note: what a load verifies]).
    """

    def __init__(
        self, directory: Location, sizes: Mapping[str, int] | None, checksums_in_headers: bool = False,
        seal: FileSeal | None = None,
    ) -> None:
        self.directory = directory
        self.sizes = sizes
        self.checksums_in_headers = checksums_in_headers
        self.seal = seal
        self.headers_read: list[str] = []
        self.pieces_checked = 0  # pieces checked against their headers (by ``RowReads``)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._last_table: TensorTable | None = None  # the table of the header read last: the next is often equal
        self._links: set[str] = set()  # local files that are symlinks leading inside the directory

    def open(self, name: str) -> BinaryIO:
        """``name`` opened for reading, unbuffered, once it is known to be a regular file of its recorded size. A
        pipe or a device is refused without blocking on it; a symlink is followed only once it is known to stay
        inside the directory. An object at a URL: each read is one range request for exactly its bytes."""
        if not isinstance(self.directory, Path):
            refuse_unplain_name(self.directory, name)
            return cast(BinaryIO, self._open_remote(name))
        refuse_unplain_name(self.directory, name)
        path = self.directory / name
        fd = self._os_open(name, path)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"Checkpoint file {path} is not a regular file; refusing to read it.")
            self._check_size(name, path, info.st_size)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb", buffering=0)

    def _os_open(self, name: str, path: Path) -> int:
        """``name`` opened read-only; a link only once known to stay inside the directory; a missing file named."""
        if not _NO_FOLLOW and name not in self._links:  # no open refuses a link here: check each name once
            member_path(cast(Path, self.directory), name)
            self._links.add(name)
        try:
            return os.open(path, _READ_FLAGS if name in self._links else _READ_FLAGS | _NO_FOLLOW)
        except FileNotFoundError:
            raise CheckpointError(f"Checkpoint file {path} is missing.") from None
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
        member_path(cast(Path, self.directory), name)  # a symlink: refused unless it stays inside
        self._links.add(name)
        return os.open(path, _READ_FLAGS)

    def _check_size(self, name: str, path: Any, size: int) -> None:
        expected = self.sizes.get(name) if self.sizes is not None else size
        if expected is None:
            raise CheckpointError(
                f"{self.directory / INDEX_FILE} does not list {name} in its 'files' table, yet the checkpoint needs it:"
                " the index is damaged. Use another checkpoint, or save this one again."
            )
        if size != expected:
            raise CheckpointError(
                f"Checkpoint file {path} has {size} bytes but the index records {expected}: it is truncated or was"
                " modified."
            )

    def _open_remote(self, name: str) -> Any:
        url = self.directory / name
        try:
            f: Any = self.directory.open(name)  # type: ignore[union-attr]
        except FileNotFoundError:
            raise CheckpointError(f"Checkpoint file {url} is missing.") from None
        try:
            self._check_size(name, url, int(f.size))
        except BaseException:
            f.close()
            raise
        return f

    def check(self, name: str) -> Path | str:
        """The path of ``name`` once it is known to be a regular file of its recorded size (nothing is read)."""
        self.open(name).close()
        return self.directory / name

    def read_all(self, name: str) -> bytes:
        """The whole of ``name``, checked as ``open`` checks it and, in a sealed checkpoint, against the SHA-256 the
        index records for it (the files a load reads whole: the trainer state)."""
        with self.open(name) as f:
            data = bytes(f.read())
        if self.seal is not None and hashlib.sha256(data).hexdigest() != self.seal.sha256.get(name):
            raise CheckpointError(
                f"Checkpoint file {self.directory / name} does not match the SHA-256 its index"
                f" {self.seal.index_path} (save {self.seal.save_id}) records for it: the file was modified after the"
                " save, or one of the two is a stale file left by another save. Use another checkpoint, or save this"
                " one again."
            )
        return data

    def header(self, name: str) -> SafetensorsHeader:
        """The checked header of ``name``, read the first time it is asked for."""
        header = self._headers.get(name)
        if header is None:
            path = self.directory / name
            with self.open(name) as f:
                size = os.fstat(f.fileno()).st_size if isinstance(self.directory, Path) else int(cast(Any, f).size)
                length = header_length(f.read(8), path, size)
                text = f.read(length)
                while len(text) < length and (more := f.read(length - len(text))):
                    text += more
            if self.seal is not None:
                self.seal.check_header(name, path, text)
            header = parse_header(text, path, size, self._last_table)
            self._headers[name] = header
            self._last_table = header.table
            self.headers_read.append(name)
        return header


class FileSeal:
    """What a sealed index (version 4) records of its files, checked as a load reads them (see [Note: what a load
    verifies] in ``io/index.py``): each file's SHA-256 (``sha256``, checked by ``read_all``), each data file's header
    digest (``headers``: the SHA-256 of its first 8 bytes and its JSON header, which bind every tensor's name, dtype,
    shape and offsets and the CRC-32s of its data) and the id of the save (``save_id``) that every data file's header
    records too."""

    def __init__(self, index_path: Path | MemberURL, save_id: str, files: Mapping[str, Mapping[str, Any]]) -> None:
        self.index_path, self.save_id = index_path, save_id
        self.sha256 = {name: info["sha256"] for name, info in files.items()}
        self.headers = {name: info.get("header_sha256") for name, info in files.items()}

    def check_header(self, name: str, path: Path | MemberURL | str, text: bytes) -> None:
        """Refuse the header ``text`` of ``name`` unless it is the one the index records, saying why it is not."""
        expected = self.headers.get(name)
        if expected is None:
            raise CheckpointError(
                f"{self.index_path} records no header digest for {name}, which the load reads: the index is damaged."
                " Use another checkpoint, or save this one again."
            )
        if hashlib.sha256(len(text).to_bytes(8, "little") + text).hexdigest() == expected:
            return
        save_id = recorded_save_id(text)
        if save_id is not None and save_id != self.save_id:
            raise CheckpointError(
                f"Checkpoint file {path} belongs to another save (save {save_id}) than its index {self.index_path}"
                f" (save {self.save_id}): one of them is a stale file left by an earlier save. Use another checkpoint,"
                " or save this one again."
            )
        raise CheckpointError(
            f"Checkpoint file {path} has a header (its tensors' names, dtypes, shapes, offsets and checksums) that"
            f" differs from the one its index records: the file was modified after the save. Use another"
            " checkpoint, or save this one again."
        )


def read_json_member(directory: Location, name: str) -> Any:
    """The JSON file ``name`` of a checkpoint directory, refusing what is not a regular file inside it (a link out,
    a device, a pipe: nothing that could hang or never end) and anything above ``MAX_JSON_BYTES``."""
    limit = checkpoint_format.MAX_JSON_BYTES  # the one limit, which a save checks too
    path: Path | MemberURL
    if not isinstance(directory, Path):  # an object at a URL (no links, devices or pipes there)
        refuse_unplain_name(directory, name)
        path, data = directory / name, _read_remote_member(directory, name, limit)
    else:
        path = member_path(directory, name)
        if not path.exists():
            raise CheckpointError(f"{path} is missing: {directory} is not a complete checkpoint.")
        if not path.is_file():
            raise CheckpointError(
                f"{path} is not a regular file (a directory, a device or a pipe); refusing to read it."
            )
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} is larger than {limit} bytes, which no checkpoint writes; not read.")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, absurd nesting
        raise CheckpointError(f"{path} is not valid JSON ({type(err).__name__}: {err}).") from None


def _read_remote_member(directory: Any, name: str, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the object ``name`` of a ``RemoteDirectory``."""
    try:
        with directory.open(name) as f:
            return bytes(f.read(min(int(f.size), limit + 1)))
    except FileNotFoundError:
        raise CheckpointError(f"{directory / name} is missing: {directory} is not a complete checkpoint.") from None
