"""Where a checkpoint's bytes live: a local directory, or any URL that fsspec knows (``s3://``, ``gs://``,
``az://``, ``hdfs://``, ``memory://``...). The format code asks this module for a ``CheckpointLocation`` and never
knows which one it got.

[Note: committing to object storage]
A local save writes a temporary directory and renames it into place (atomic). Object stores have no rename of a
directory, so a save to a URL commits by the order of its writes instead: every rank uploads its own data files
first, each under a name that carries this save's id (``<save-id>.<file>``), so nothing of the checkpoint already
at the URL is overwritten; only when every rank's uploads are complete does one rank write ``index.json``, the
commit marker, in one PUT (atomic on every object store: a reader sees the old index or the new one, never half).
Until then the URL holds the previous checkpoint, whole and loadable, plus objects no index names. A reader
ignores a directory without its index and says so; the next successful save deletes the objects its index does not
name (the previous checkpoint's files after the commit, and the leftovers of a save that died partway).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lightning_shard.checkpoint.format import CheckpointError

_LOCAL_PROTOCOLS = ("file", "local")


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a location through a protocol (``scheme://...``) other than the local file system."""
    text = os.fspath(path)
    if "://" not in text:
        return False
    protocol = text.split("://", 1)[0]
    return protocol.lower() not in _LOCAL_PROTOCOLS


def local_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a local path (``file://`` stripped). Raises ``ValueError`` for a URL of another protocol."""
    text = os.fspath(path)
    if is_url(text):
        raise ValueError(f"{text!r} is a URL, not a local path.")
    if "://" in text:
        text = text.split("://", 1)[1]
    return Path(text)


def location(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Location:
    """Where the checkpoint ``path`` lives: a ``RemoteDirectory`` for a URL (its fsspec file system created now, so a
    missing package is reported before anything is written), else the local ``Path``. ``storage_options`` go to the
    fsspec file system; a local path refuses them (there is nothing to pass them to)."""
    if is_url(path):
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(
                f"storage_options must be a dict of fsspec options for {os.fspath(path)!r}, got"
                f" {type(storage_options).__name__}."
            )
        return RemoteDirectory(os.fspath(path), storage_options)
    if storage_options:
        raise TypeError(
            f"storage_options were given for the local path {os.fspath(path)!r}: they apply only to URLs"
            " (s3://, gs://, az://...). Remove them, or save to a URL."
        )
    return local_path(path)


def checked_storage_options(storage_options: Any) -> dict[str, Any] | None:
    """A strategy's ``storage_options``: ``None`` or a dict of fsspec options, used for every checkpoint URL it saves,
    loads or removes (a ``save_checkpoint(..., storage_options=...)`` call gives its own)."""
    if storage_options is not None and not isinstance(storage_options, dict):
        kind = type(storage_options).__name__
        raise TypeError(f"storage_options must be a dict of fsspec options or None, got {kind}.")
    return storage_options


def local_only(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a local path for ``what``, which reads or writes local files only: a URL is refused with a
    ``CheckpointError`` naming it (never taken for a local path such as ``s3:/bucket/...``)."""
    if is_url(path):
        raise CheckpointError(
            f"{what} works on local paths, and {os.fspath(path)!r} is a URL. Copy the checkpoint to a local"
            " directory first (`lightning-shard consolidate URL OUT` reads URLs), or load it through a strategy."
        )
    return local_path(path)


def filesystem_for(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec file system for ``url`` and the path inside it.

    A protocol fsspec knows but whose package is not installed raises ``CheckpointError`` naming what to install
    (``s3://`` needs ``s3fs``, ``gs://`` ``gcsfs``, ``az://`` ``adlfs``); an unknown protocol names itself. Nothing
    is written, and the URL is never taken for a local path.
    """
    import fsspec
    from fsspec.core import split_protocol

    protocol, inner = split_protocol(url)
    assert protocol is not None, url
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as err:
        raise CheckpointError(
            f"Cannot reach {url!r}: the {protocol}:// protocol needs a package that is not installed ({err}). Install"
            f" it (for example `pip install s3fs` for s3://, `gcsfs` for gs://, `adlfs` for az://) and run again."
        ) from None
    except ValueError:
        raise CheckpointError(
            f"Cannot reach {url!r}: no fsspec implementation knows the protocol {protocol!r}. Check the URL, or"
            f" install the package that provides it."
        ) from None
    fs = cls(**(storage_options or {}))  # storage_options go to the file system as given
    return fs, cls._strip_protocol(url).rstrip("/") if hasattr(cls, "_strip_protocol") else inner.rstrip("/")


@dataclass
class RemoteDirectory:
    """A checkpoint directory at a URL: named objects under one prefix, read in byte ranges."""

    url: str
    storage_options: dict[str, Any] | None = None
    fs: Any = field(init=False, repr=False)
    root: str = field(init=False)

    def __post_init__(self) -> None:
        self.fs, self.root = filesystem_for(self.url, self.storage_options)

    def __str__(self) -> str:
        return self.url.rstrip("/")

    def __truediv__(self, name: str) -> MemberURL:
        """The URL of ``name`` in this directory (for messages)."""
        return MemberURL(self, name)

    def member(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.member(name)))

    def names(self) -> list[str]:
        """The objects directly under this directory (``[]`` when there is none)."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        prefix = self.root.rstrip("/") + "/"
        return sorted(e.rstrip("/")[len(prefix) :] for e in entries if e.rstrip("/").startswith(prefix))

    def read_bytes(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self.member(name)))

    def open(self, name: str) -> BinaryIO:
        """``name`` opened for reading: seeks are free, each read fetches only the bytes it asks for."""
        return self.fs.open(self.member(name), "rb", cache_type="none")

    def put_file(self, local: Path, name: str) -> None:
        """Upload the local file ``local`` as ``name`` (multipart for large files, by the fsspec implementation)."""
        self.fs.put_file(str(local), self.member(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` in one request (the commit marker: one PUT, atomic on an object store)."""
        self.fs.pipe_file(self.member(name), data)

    def remove(self, names: list[str]) -> None:
        if names:
            self.fs.rm([self.member(n) for n in names])

    def invalidate(self) -> None:
        """Forget listings the file system cached (another process may have written since)."""
        self.fs.invalidate_cache(self.root)


class MemberURL(str):
    """The URL of one object of a ``RemoteDirectory``: a string, with ``parent`` and ``name`` as a ``Path`` has."""

    parent: RemoteDirectory
    name: str

    def __new__(cls, parent: RemoteDirectory, name: str) -> MemberURL:
        url = super().__new__(cls, f"{str(parent)}/{name}")
        url.parent, url.name = parent, name
        return url


Location = Path | RemoteDirectory  # where a checkpoint lives: see ``location``
