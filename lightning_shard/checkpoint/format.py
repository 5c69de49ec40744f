"""The checkpoint format's primitives: names, dtypes, the one size limit for JSON members, safe paths inside a
checkpoint directory, and safetensors headers, read once each and checked against the files' real sizes.

See docs/checkpoint_format.md for the specification. In short::

    CKPT_DIR/
      index.json                  format, version, world size and mesh, files (size, sha256), tensors
      trainer_state.json          Lightning's checkpoint without model/optimizer tensors, as JSON
      trainer_state.safetensors   tensors found in that state (e.g. a metric or scaler value)
      shard-00000-of-00002.safetensors   rank 0's rows of every parameter and optimizer-state tensor
      ...                         ("full" checkpoints: model.safetensors and optimizer.safetensors)

The index gives each tensor's global shape and dtype and where it is stored: split by rows over the shard
files by the writer's rule, or whole in one file (``layout.py``). Each safetensors file records the CRC-32 of
every tensor it holds in its own header. ``index.py`` reads and writes ``index.json``; ``reader.py`` reads rows.
"""

from __future__ import annotations

import binascii
import errno
import json
import os
import re
import stat
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, NoReturn, TypeGuard, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_shard.checkpoint.storage import Location, MemberURL

FORMAT_NAME = "lightning-shard-checkpoint"
FORMAT_VERSION = 2  # what a save writes
READABLE_VERSIONS = (1, 2)  # version 1 listed every piece of every tensor in the index (docs/checkpoint_format.md)
INDEX_FILE = "index.json"
TRAINER_STATE_JSON = "trainer_state.json"
TRAINER_STATE_TENSORS = "trainer_state.safetensors"
MODEL_PREFIX = "model/"  # index keys of model tensors: "model/" + LightningModule state_dict key
OPTIMIZER_PREFIX = "optimizer/"  # "optimizer/{i}/{parameter name}/{state name}"
CRC32_METADATA = "crc32"  # a header's "__metadata__" entry: each tensor's CRC-32, 8 hex digits, in data order
RUNNING_CRC32_METADATA = "crc32_running"  # ... and at each tensor's end, the CRC-32 of the data section up to there
SMALL_PIECE_BYTES = 64  # a shard file holds pieces this small first in each part (see [Note: small pieces together])

# The one limit on a checkpoint's JSON members (index.json, trainer_state.json): a load refuses a larger one, and a
# save refuses to write one, before anything is committed. An index of the current version grows with tensors + files
# (a 70B model saved by 4,096 ranks: about 1 MiB); the limit stays this high because version-1 indexes, which listed
# every piece of every tensor, still load.
MAX_JSON_BYTES = 256 * 2**20

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in _SAFETENSORS_DTYPES}
_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_TORCH_BY_SAFETENSORS = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint cannot be saved or loaded; the message names the file or the keys at fault. Both a
    ``RuntimeError`` and a ``ValueError``: code written for Lightning's ``FSDPStrategy`` catches a path that is no
    checkpoint as ``ValueError`` and a checkpoint that does not fit as ``RuntimeError``."""


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def member_named(names: Iterable[str], base: str) -> str:
    """The file of a checkpoint that plays the part of ``base`` (``trainer_state.json``...): ``base`` itself, or
    ``<save-id>.<base>`` in a checkpoint on object storage (see [Note: committing to object storage]); ``base`` when
    the index names neither (a load then reports it missing)."""
    names = list(names)
    if base in names:
        return base
    found = [n for n in names if n.endswith("." + base) and SAVE_ID.fullmatch(n[: -len(base) - 1])]
    return found[0] if len(found) == 1 else base


SAVE_ID = re.compile(r"[0-9a-f]{12}")  # the id a save to object storage gives its files: "<save-id>.<name>"


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"Tensors of dtype {dtype} cannot be stored in a checkpoint.")
    return _DTYPE_NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES_BY_NAME:
        raise CheckpointError(f"Unknown dtype {name!r} in the checkpoint index.")
    return _DTYPES_BY_NAME[name]


def safetensors_dtype_code(dtype: torch.dtype) -> str:
    """The safetensors header's name for ``dtype`` (``"F32"``)."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"Tensors of dtype {dtype} cannot be stored in a checkpoint.")
    return _SAFETENSORS_DTYPES[dtype]


def crc32(tensor: Tensor) -> int:
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data.data) & 0xFFFFFFFF


def is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_shape(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)


def check_loadable(
    key: str, stored_shape: Any, stored_dtype: torch.dtype, shape: Any, dtype: torch.dtype
) -> str | None:
    """Why the checkpoint tensor ``key`` cannot be loaded into a tensor of ``shape`` and ``dtype``, or ``None``.

    Shapes must be equal; dtypes must be equal or both floating point (a deliberate cast, e.g. bf16 weights into
    a float32 model)."""
    if tuple(stored_shape) != tuple(shape):
        return f"{key}: checkpoint {tuple(stored_shape)}, model {tuple(shape)}"
    if stored_dtype != dtype and not (stored_dtype.is_floating_point and dtype.is_floating_point):
        return f"{key}: checkpoint dtype {dtype_name(stored_dtype)}, model dtype {dtype}"
    return None


def submodule_prefix(prefix: str) -> str:
    """A state_dict key prefix naming a submodule, ending with ``"."``: ``"model"`` and ``"model."`` both mean the
    keys of ``self.model`` (never ``model_ema.*``, which a bare string prefix would also match)."""
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


# --------------------------------------------------------------------------------------------------
# Files of a checkpoint directory: untrusted input
# --------------------------------------------------------------------------------------------------
#
# [Note: checkpoints are untrusted]
# Before any tensor data is read, what a reader is about to read is checked against the directory and the
# safetensors headers: every file is a plain name inside the directory (no "..", no separators, no symlink out of
# it) and a regular file of the size the index records, every header fits in its file and every tensor's bytes lie
# inside it, and each piece of a tensor the reader needs agrees with its file's header (key, dtype, rows). The
# index's own tables are checked whole when it is read, in time proportional to its size (tensors + files for the
# current version). So a shape in the index can never claim more bytes than the files hold, and nothing is
# allocated from a number that was not checked against a real file size. A reader checks, and opens, only the
# files that hold what it reads.

MAX_HEADER_BYTES = 100 * 2**20  # a safetensors header is JSON describing the tensors; 100 MiB is far beyond any model


def is_plain_name(name: Any) -> TypeGuard[str]:
    """A file name with no directory part: not empty, no ``..``, no separator (so not absolute either)."""
    return (
        isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
        and "\0" not in name
    )


def is_remote(directory: Location) -> bool:
    """Whether ``directory`` is a ``RemoteDirectory`` (a URL) rather than a local ``Path``."""
    return not isinstance(directory, Path)


def refuse_unplain_name(directory: Location, name: Any) -> None:
    if not is_plain_name(name):
        raise CheckpointError(
            f"The checkpoint in {directory} refers to the file {name!r}, which is not a plain file name inside the"
            f" directory; refusing to open it."
        )


def member_path(directory: Path, name: Any) -> Path:
    """``directory / name``, refusing any ``name`` that is not a plain file name inside ``directory`` (``..``, an
    absolute path, a path separator) or that is a symlink leading out of it. Nothing is opened."""
    refuse_unplain_name(directory, name)
    path = directory / name
    if path.is_symlink() and not path.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(
            f"Checkpoint file {path} is a symlink that leads out of {directory} (to {path.resolve()});"
            f" refusing to open it."
        )
    return path


def read_json_member(directory: Location, name: str) -> Any:
    """The JSON file ``name`` of a checkpoint directory, refusing what is not a regular file inside it (a link out,
    a device, a pipe: nothing that could hang or never end) and anything above ``MAX_JSON_BYTES``."""
    limit = MAX_JSON_BYTES
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


def _remote_size(f: Any) -> int:
    """The size of an fsspec file, known from the request that opened it."""
    return int(f.size)


def _read_remote_member(directory: Any, name: str, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the object ``name`` of a ``RemoteDirectory``."""
    try:
        with directory.open(name) as f:
            return bytes(f.read(min(int(f.size), limit + 1)))
    except FileNotFoundError:
        raise CheckpointError(f"{directory / name} is missing: {directory} is not a complete checkpoint.") from None


class HeaderEntry(NamedTuple):
    """One tensor of a safetensors header, checked against its file: its bytes are ``[begin, end)`` of the data
    section, exactly ``prod(shape) * itemsize`` of them."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, eq=False)
class TensorTable:
    """The checked tensor table of a safetensors header (name -> ``HeaderEntry``), and its names in the order of
    their data. Files with equal tables share one: the shard files of a large world mostly hold the same shapes, and a
    header equal to one already checked, but for its checksums, is neither parsed nor checked again."""

    entries: dict[str, HeaderEntry]
    in_order: tuple[str, ...]
    raw: dict[str, Any] = field(repr=False)  # the JSON it was checked from: a later file's table is compared with it
    data_bytes: int
    text: bytes = field(repr=False)  # the header's bytes, checksums included
    crc_digits: ChecksumDigits | None  # where in ``text`` the checksums' hex digits lie; None: not where the writer
    # puts them (then an equal header is parsed again)

    def same_but_checksums(self, text: bytes, data_bytes: int) -> bool:
        """Whether a header of ``text`` (for ``data_bytes`` of data) is this one but for the checksums' hex digits:
        then it parses to this table (the digits are counted by ``Checksums``, checked to be hex when used)."""
        if data_bytes != self.data_bytes or len(text) != len(self.text) or self.crc_digits is None:
            return False
        for at, fixed in self._fixed_parts:  # compared in place, in C
            if not text.startswith(fixed, at):
                return False
        return True

    @cached_property
    def _fixed_parts(self) -> list[tuple[int, bytes]]:
        """The parts of ``text`` around the checksums' digits, each with where it starts."""
        parts, at = [], 0
        for p, q in cast(ChecksumDigits, self.crc_digits).spans():
            parts.append((at, self.text[at:p]))
            at = q
        return [*parts, (at, self.text[at:])]

    @cached_property
    def positions(self) -> dict[str, int]:
        """Each tensor's position in ``in_order``."""
        return {key: i for i, key in enumerate(self.in_order)}

    @cached_property
    def position_ending_at(self) -> dict[int, int]:
        """For each offset of the data section where a tensor ends, the position (in ``in_order``) of one that does:
        where a running CRC-32 is recorded."""
        return {self.entries[key].end: i for i, key in enumerate(self.in_order)}


class ChecksumDigits(NamedTuple):
    """Where in a header's bytes the hex digits of its checksums lie (JSON strings' contents), each ``None`` when the
    header records no such checksums."""

    tensors: tuple[int, int] | None  # the ``"crc32"`` metadata
    running: tuple[int, int] | None  # the ``"crc32_running"`` metadata

    def spans(self) -> list[tuple[int, int]]:
        return [span for span in self if span is not None]

    def of(self, text: bytes) -> tuple[bytes | None, bytes | None]:
        """The digits of both in ``text`` (a header laid out as the one these places were found in)."""
        tensors, running = self
        return (text[tensors[0] : tensors[1]] if tensors else None,
                text[running[0] : running[1]] if running else None)


class Checksums(Mapping[str, int]):
    """The CRC-32s a header records, one per tensor of its table (tensor key -> CRC-32; ``at`` by position in data
    order). A load reads the headers of hundreds of files but looks up few of their checksums one by one, so they
    are kept as the hex digits the header holds (their count checked) and turned into 4-byte words only when asked
    for (``words``), where a digit that is not hex is refused; a reader of many files joins their ``digits`` and
    converts them at once."""

    __slots__ = ("_digits", "_words", "_table", "_path", "_key")

    def __init__(self, digits: str | bytes | None, table: TensorTable, path: Path | str, key: str) -> None:
        if digits is not None and (not isinstance(digits, (str, bytes)) or len(digits) != 8 * len(table.in_order)):
            _damaged_digits(path, key, table)
        self._digits = digits  # None: none recorded
        self._words: bytes | None = None if digits is not None else b""
        self._table, self._path, self._key = table, path, key

    @property
    def digits(self) -> bytes:
        """The hex digits, 8 per tensor in data order, as the header holds them (empty when none is recorded)."""
        if self._digits is None:
            return b""
        if isinstance(self._digits, bytes):
            return self._digits
        try:
            return self._digits.encode("ascii")
        except UnicodeEncodeError:
            _damaged_digits(self._path, self._key, self._table)

    @property
    def words(self) -> bytes:
        """The CRC-32s as 4-byte big-endian words, in the order of the table's data; empty when none is recorded."""
        if self._words is None:
            try:
                self._words = binascii.unhexlify(self.digits)
            except ValueError:  # not hex digits only
                _damaged_digits(self._path, self._key, self._table)
        return self._words

    def at(self, position: int) -> int:
        return int.from_bytes(self.words[4 * position : 4 * position + 4], "big")

    def __getitem__(self, key: str) -> int:
        if self._digits is None:
            raise KeyError(key)
        return self.at(self._table.positions[key])

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        position = self._table.positions.get(key) if self._digits is not None else None
        return self.at(position) if position is not None else default

    def __len__(self) -> int:
        return len(self._table.in_order) if self._digits is not None else 0

    def __iter__(self) -> Iterator[str]:
        return iter(self._table.in_order if self._digits is not None else ())


def _damaged_digits(path: Path | str, key: str, table: TensorTable) -> NoReturn:
    raise CheckpointError(
        f"Checkpoint file {path}: the header's {key!r} metadata is not 8 hex digits for each of its"
        f" {len(table.in_order)} tensors: it is damaged."
    )


class SafetensorsHeader(NamedTuple):
    """A safetensors file's tensor table, where its data section starts, the CRC-32 of each tensor its metadata
    records (none in files this package did not write), and the running CRC-32 of its data section at each tensor's
    end, in data order (``None`` in files written before it was recorded; see [Note: one checksum a file read] in
    ``reader.py``)."""

    data_start: int
    table: TensorTable
    crc32: Checksums
    running_crc32: Checksums | None = None

    @property
    def entries(self) -> dict[str, HeaderEntry]:
        return self.table.entries


def read_safetensors_header(path: Path, size: int) -> SafetensorsHeader:
    """The header of the safetensors file ``path`` of ``size`` bytes, checked against ``size``: the header fits in
    the file, and every tensor's bytes lie inside its data section."""
    with open(path, "rb") as f:
        return read_header(f, path, size)


def read_header(f: BinaryIO, path: Path | str, size: int, like: TensorTable | None = None) -> SafetensorsHeader:
    """``read_safetensors_header`` on a file open at its start. A table equal to ``like`` (the same JSON and data
    size: checked) is not checked again but shared."""
    head = f.read(8)
    text = f.read(_header_length(head, path, size))
    return parse_header(text, path, size, like)


def _header_length(head: bytes, path: Path | str, size: int) -> int:
    """The header length the first 8 bytes of a file of ``size`` bytes give, checked to fit in it."""
    if len(head) < 8:
        raise CheckpointError(f"Checkpoint file {path} has {size} bytes, too few for a safetensors header.")
    (length,) = struct.unpack("<Q", head[:8])
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(
            f"Checkpoint file {path} claims a {length}-byte header but holds {size} bytes in all: it is damaged."
        )
    return int(length)


def parse_header(text: bytes, path: Path | str, size: int, like: TensorTable | None = None) -> SafetensorsHeader:
    """The checked header whose JSON is ``text``, of a file of ``size`` bytes (see ``read_header``)."""
    length, data_bytes = len(text), size - 8 - len(text)
    if like is not None and like.crc_digits is not None and like.same_but_checksums(text, data_bytes):
        digits, running = like.crc_digits.of(text)  # no JSON to parse: the digits alone
        return SafetensorsHeader(8 + length, like, _checksums(path, digits, like), _running(path, running, like))
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"Checkpoint file {path} has a header that is not valid JSON ({err}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"Checkpoint file {path} has a header that is not a table of tensors.")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(f"Checkpoint file {path} has a header whose '__metadata__' is not a table of strings.")
    digits, running = (metadata or {}).get(CRC32_METADATA), (metadata or {}).get(RUNNING_CRC32_METADATA)
    same = like is not None and like.data_bytes == data_bytes and like.raw == header  # compared in C
    table = like if same and like is not None else _checked_table(path, header, data_bytes, text, digits, running)
    return SafetensorsHeader(8 + length, table, _checksums(path, digits, table), _running(path, running, table))


def _checked_table(
    path: Path | str, header: dict[str, Any], data_bytes: int, text: bytes, digits: Any, running: Any
) -> TensorTable:
    entries = {}
    for key, info in header.items():  # one entry per tensor, thousands per load: a tight loop, no call per entry
        try:
            dtype, shape, (begin, end) = _TORCH_BY_SAFETENSORS[info["dtype"]], info["shape"], info["data_offsets"]
            numel = 1
            for d in shape:
                if type(d) is not int or d < 0:
                    raise TypeError(d)
                numel *= d
            if type(begin) is not int or type(end) is not int:
                raise TypeError(begin)
        except (KeyError, TypeError, ValueError):
            malformed = f"Checkpoint file {path}: tensor {key!r} has a malformed header entry {info!r}."
            raise CheckpointError(malformed) from None
        if not 0 <= begin <= end <= data_bytes or end - begin != numel * dtype.itemsize:
            raise CheckpointError(
                f"Checkpoint file {path}: tensor {key!r} of shape {shape} ({info['dtype']}) claims bytes"
                f" [{begin}, {end}) but the file holds {data_bytes} bytes of tensor data."
            )
        entries[key] = HeaderEntry(dtype, tuple(shape), begin, end)
    in_order = tuple(sorted(entries, key=lambda key: (entries[key].begin, entries[key].end)))
    return TensorTable(entries, in_order, header, data_bytes, text, _digits_spans(text, digits, running))


def _digits_spans(text: bytes, digits: Any, running: Any) -> ChecksumDigits | None:
    """Where the checksums' digits lie in the header ``text``: this package's writer puts them first, compactly, the
    tensors' then the running ones. ``None`` when the header records checksums elsewhere."""
    if digits is None and running is None:
        return ChecksumDigits(None, None)
    marker = f'{{"__metadata__":{{"{CRC32_METADATA}":"'.encode()
    if not isinstance(digits, str) or not text.startswith(marker):
        return None
    p = len(marker)
    q = p + len(digits)
    if text[p:q] != digits.encode() or text[q : q + 1] != b'"':
        return None
    if running is None:
        return ChecksumDigits((p, q), None)
    between = f'","{RUNNING_CRC32_METADATA}":"'.encode()
    r = q + len(between)
    if not isinstance(running, str) or text[q:r] != between:
        return None
    e = r + len(running)
    return ChecksumDigits((p, q), (r, e)) if text[r:e] == running.encode() and text[e : e + 1] == b'"' else None


def _checksums(path: Path | str, digits: Any, table: TensorTable) -> Checksums:
    """The CRC-32s a header's metadata records: 8 hex digits per tensor, in the order of their data."""
    return Checksums(digits, table, path, CRC32_METADATA)


def _running(path: Path | str, digits: Any, table: TensorTable) -> Checksums | None:
    """The running CRC-32s a header's metadata records: 8 hex digits per tensor, in the order of their data."""
    return Checksums(digits, table, path, RUNNING_CRC32_METADATA) if digits is not None else None


class CheckpointFiles:
    """The files of one checkpoint directory as one load sees them (see [Note: checkpoints are untrusted]).

    Each file is opened only when something is read from it, checked to be a regular file inside the directory
    of the size the index records (``sizes``; ``None`` for files no index describes, such as a Hugging Face model),
    and its safetensors header is read once and kept for the rest of the load. ``headers_read`` lists the files
    whose headers were read, in order: what this process touched.
    """

    def __init__(
        self, directory: Location, sizes: Mapping[str, int] | None, checksums_in_headers: bool = False
    ) -> None:
        self.directory = directory
        self.sizes = sizes
        self.checksums_in_headers = checksums_in_headers  # every tensor's CRC-32 is in its header (version 2)
        self.headers_read: list[str] = []
        self.pieces_checked = 0  # pieces checked against their headers (by ``RowReads``)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._last_table: TensorTable | None = None  # the table of the header read last: the next is often equal
        self._checked: set[str] = set()  # local files whose names were checked plain
        self._links: set[str] = set()  # local files that are symlinks leading inside the directory
        self._dir_fd: int | None = None  # the directory, held open by ``held_open``

    def open(self, name: str) -> BinaryIO:
        """``name`` opened for reading, once it is known to be a regular file of its recorded size. A pipe or a
        device is refused without blocking on it. An object at a URL is opened unbuffered: each read is one range
        request for exactly its bytes."""
        if not isinstance(self.directory, Path):
            refuse_unplain_name(self.directory, name)
            return cast(BinaryIO, self._open_remote(name))
        return os.fdopen(self.open_local(name)[0], "rb")

    def open_local(self, name: str, path: str | None = None) -> tuple[int, int]:
        """A file of this local directory opened for reading as a raw descriptor (the caller closes it), checked as
        ``open`` checks it, and its size. A symlink is followed only once it is known to stay inside the directory
        (``member_path``); a plain file is opened without that ``lstat``, as a link is refused by the open itself.
        Inside ``held_open()``, names are opened relative to the directory's own descriptor (no path walk)."""
        if name not in self._checked:
            if _NO_FOLLOW:
                refuse_unplain_name(self.directory, name)
            else:  # no open refuses a link here: check each name once
                member_path(cast(Path, self.directory), name)
                self._links.add(name)
            self._checked.add(name)
        if path is None:
            path = self._local_path(name)
        try:
            fd = self._os_open(name, path)
        except OSError as err:
            if err.errno != errno.ELOOP or name in self._links:
                raise
            member_path(cast(Path, self.directory), name)  # a symlink: refused unless it stays inside
            self._links.add(name)
            return self.open_local(name)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"Checkpoint file {path} is not a regular file; refusing to read it.")
            expected = self.sizes.get(name) if self.sizes is not None else info.st_size
            if expected is None:
                raise CheckpointError(f"Internal error: {name} is not a file of the checkpoint in {self.directory}.")
            if info.st_size != expected:
                raise CheckpointError(
                    f"Checkpoint file {path} has {info.st_size} bytes but the index records {expected}: it is"
                    f" truncated or was modified."
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, info.st_size

    def reopen(self, name: str) -> int:
        """A local file whose header this load has read (so checked, as ``open_local`` checks) opened again for
        reading, as a raw descriptor: a short read still says if it shrank since, its checksums if it changed."""
        if name not in self._headers:
            raise ValueError(f"Internal error: {name} is reopened before its header was read.")
        return self._os_open(name, self._local_path(name))

    def _os_open(self, name: str, path: str) -> int:
        """``name`` opened read-only, relative to the held directory if any; a link only once known to stay inside
        (else ``ELOOP``); a missing file named as such."""
        flags = _READ_FLAGS if name in self._links else _READ_FLAGS | _NO_FOLLOW
        try:
            return os.open(name, flags, dir_fd=self._dir_fd) if self._dir_fd is not None else os.open(path, flags)
        except FileNotFoundError:
            raise CheckpointError(f"Checkpoint file {path} is missing.") from None

    @contextmanager
    def held_open(self) -> Iterator[None]:
        """Within it, a local directory is held open, its files opened by name relative to it: reading hundreds of
        files, each open skips walking the directory's path (half of its cost)."""
        if self._dir_fd is not None or not isinstance(self.directory, Path) or os.open not in os.supports_dir_fd:
            yield
            return
        self._dir_fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            yield
        finally:
            os.close(self._dir_fd)
            self._dir_fd = None

    def _open_remote(self, name: str) -> Any:
        url = self.directory / name
        try:
            f: Any = self.directory.open(name)  # type: ignore[union-attr]
        except FileNotFoundError:
            raise CheckpointError(f"Checkpoint file {url} is missing.") from None
        expected = self.sizes.get(name) if self.sizes is not None else f.size
        if expected is None or f.size != expected:
            f.close()
            if expected is None:
                raise CheckpointError(f"Internal error: {name} is not a file of the checkpoint in {self.directory}.")
            raise CheckpointError(
                f"Checkpoint file {url} has {f.size} bytes but the index records {expected}: it is truncated or was"
                " modified."
            )
        return f

    def check(self, name: str) -> Path | str:
        """The path of ``name`` once it is known to be a regular file of its recorded size (nothing is read)."""
        self.open(name).close()
        return self.directory / name

    def read_all(self, name: str) -> bytes:
        """The whole of ``name``, checked as ``open`` checks it."""
        with self.open(name) as f:
            return bytes(f.read())

    def header(self, name: str) -> SafetensorsHeader:
        """The checked header of ``name``, read the first time it is asked for."""
        header = self._headers.get(name)
        if header is None:
            if isinstance(self.directory, Path) and hasattr(os, "pread"):
                header = self._local_header(name)
            else:
                with self.open(name) as f:
                    size = os.fstat(f.fileno()).st_size if isinstance(self.directory, Path) else _remote_size(f)
                    header = read_header(f, self.directory / name, size, self._last_table)
            self._headers[name] = header
            self._last_table = header.table
            self.headers_read.append(name)
        return header

    def _local_header(self, name: str) -> SafetensorsHeader:
        """The header of a local file, read in one call where it is as long as the last one read (files of one
        save mostly are)."""
        path = self._local_path(name)
        fd, size = self.open_local(name, path)
        try:
            like = self._last_table
            head = os.pread(fd, min(size, 8 + (len(like.text) if like is not None else _HEADER_GUESS)), 0)
            length = _header_length(head, path, size)
            text = head[8 : 8 + length]
            while len(text) < length:
                more = os.pread(fd, length - len(text), 8 + len(text))
                if not more:
                    break
                text += more
        finally:
            os.close(fd)
        return parse_header(text, path, size, like)

    def _local_path(self, name: str) -> str:
        """The path of a file of this local directory, for messages and opens outside ``held_open``."""
        return f"{self.directory}{os.sep}{name}"


_HEADER_GUESS = 64 * 2**10  # bytes read at once for a header of unknown length
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # where there is none, every name is checked by ``member_path``
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)  # never blocks on a pipe


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A small local JSON file that must hold an object (a ``config.json``, an ``adapter_config.json``); ``what``
    names it in the ``CheckpointError`` a missing, unreadable or non-object file raises."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{what} {path} is not readable JSON ({err}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object; a {path.name} is one.")
    return data
