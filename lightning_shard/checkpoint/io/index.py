"""``index.json``, the one module that reads and writes it: reading and checking it (the current version and
version 1), and building it for a save or a conversion.

``read_index`` checks the index's tables in time proportional to its size, opening no other file: the current
version's index holds one entry per tensor and one per file (see [Note: rows by rule]), so every rank of a load
reads and checks it in full, then opens only the files that hold its rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shard.checkpoint import format as checkpoint_format
from lightning_shard.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    READABLE_VERSIONS,
    SAVE_ID,
    SEALED_VERSION,
    CheckpointError,
    dtype_from_name,
    dtype_name,
    is_count,
    is_shape,
    refuse_unplain_name,
)
from lightning_shard.checkpoint.format.adapters import ADAPTERS, check_adapters_record
from lightning_shard.checkpoint.format.trainer_state import to_json_tree
from lightning_shard.checkpoint.io.files import CheckpointFiles, FileSeal, read_json_member
from lightning_shard.checkpoint.io.layout import (
    Listed,
    Piece,
    Placement,
    RowSplit,
    StoredTensor,
    Whole,
    shards_holding_rows,
    splits_by_rows,
)
from lightning_shard.checkpoint.io.storage import Location, MemberURL, RemoteDirectory
from lightning_shard.checkpoint.io.writer import sha256_file

LEFT_OUT = "left_out"  # model key -> fingerprint of each model tensor a save left out (see checkpoint.io.selection)
SPLIT_BY_ROWS = "rows"  # a tensor entry's "split": its rows are spread over "shard_files" by the writer's rule
SPLIT_BY_PIECES = "pieces"  # a tensor entry's "split": its "pieces" are listed ([Note: tensor-parallel checkpoints])
TENSOR_PARALLEL_SIZE = "tensor_parallel_size"  # the head's tensor-parallel size of the writers (absent: 1)
PIPELINE = "pipeline"  # the writers' pipeline stages: {"size": P, "module": name, "blocks": [...], "bounds": [...]}
INDEX_SEAL = "index_sha256"  # version 4: the SHA-256 of the rest of the index (see [Note: what a load verifies])
SAVE_ID_KEY = "save_id"  # version 4: the save's id, which each data file's header records too
HEADER_DIGEST = "header_sha256"  # version 4, in a data file's 'files' entry: the SHA-256 of its 8 bytes and header


# [Note: what a load verifies]
# A load reads an index, the trainer state and parts of data files; each byte that decides what it produces is
# covered by a check the load itself runs, at any world size and on any storage (version 4; docs/checkpoint_format.md):
# - index.json is sealed: ``index_sha256`` is the SHA-256 of the rest of it, encoded canonically (sorted keys, no
#   spaces), so every option, key, file entry, the order of ``shard_files`` and the mesh are checked, whatever the
#   formatting. An index claiming an older version while carrying a seal is refused too.
# - the files a load reads whole (trainer_state.json, trainer_state.safetensors) are checked against the SHA-256 the
#   index records for each; they are small.
# - a data file is read in parts (each rank reads its rows), so its SHA-256 cannot be checked by a load. Its header
#   is: the index records the SHA-256 of its first 8 bytes and its JSON header, which holds every tensor's name, dtype,
#   shape and offsets, the CRC-32 of each 64 KiB block of its data and the save's id. So a tensor renamed or moved in
#   the header, a file of another save (even of equal size) and a block of data that changed are each refused when
#   read: the header against the index, then each block against the header's CRC-32 (io/reader.py). Every byte of a
#   data file is in its header or in a block; a rank checks the blocks it reads.
# The checks cost a hash of the index and of each header a rank reads, and of the trainer state: a small part of
# the load (docs/benchmarks.md). A load that fails a check raises before anything in the model, the optimizers or
# the trainer changes (see [Note: a failed load changes nothing]). ``inspect`` runs the same checks on every file.


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def read_index(directory: Location) -> dict[str, Any]:
    """Read and check ``index.json`` (see [Note: checkpoints are untrusted]): its structure, format name and
    version, and every tensor entry; ``"tensors"`` then maps each key to a ``StoredTensor``. No other file is
    opened: a reader checks each file when it first reads from it."""
    if not isinstance(directory, Path):
        refuse_uncommitted(directory)
    elif not directory.is_dir():
        raise CheckpointError(
            f"{directory} is not a lightning_shard checkpoint directory. To load model weights from a single"
            f" .safetensors file use lightning_shard.load_safetensors_into(); resume from a Lightning .ckpt or a"
            f" torch.distributed.checkpoint directory with trainer.fit(ckpt_path=...), or convert it with"
            f" lightning-shard convert."
        )
    path = directory / INDEX_FILE
    index = read_json_member(directory, INDEX_FILE)
    _check_structure(path, index)
    files = checkpoint_files(directory, index)
    if index["version"] == 1:
        index["tensors"] = _version_1_tensors(path, index["tensors"], files)
    else:
        index["tensors"] = _tensors(path, index, files)
    return index


def checkpoint_files(directory: Location, index: dict[str, Any]) -> CheckpointFiles:
    """The files of the checkpoint ``index`` (checked by ``read_index``) describes, as one load sees them: each of the
    size the index records and, in a sealed index, checked against its digests as it is read."""
    sizes = {name: info["size"] for name, info in index["files"].items()}
    version = index["version"]
    seal = None
    if version >= SEALED_VERSION:
        seal = FileSeal(directory / INDEX_FILE, index[SAVE_ID_KEY], index["files"])
    return CheckpointFiles(directory, sizes, checksums_in_headers=version > 1, seal=seal)


def index_seal(index: dict[str, Any]) -> str:
    """The seal of ``index``: the SHA-256 of everything in it but the seal, encoded canonically (see [Note: what a
    load verifies])."""
    body = {key: value for key, value in index.items() if key != INDEX_SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def refuse_uncommitted(directory: RemoteDirectory) -> None:
    """A directory at a URL without ``index.json`` holds no checkpoint: nothing, or the files of a save that did
    not complete (see [Note: committing to object storage]); say which."""
    directory.invalidate()  # another process wrote it: no listing cached before counts
    if directory.exists(INDEX_FILE):
        return
    names = directory.names()
    if names:
        raise CheckpointError(
            f"{directory} holds no {INDEX_FILE}: the save there did not complete (its {len(names)} object(s), e.g."
            f" {names[:3]}, were uploaded but never committed), so it is not a checkpoint and is ignored. Load an"
            " earlier checkpoint; the next successful save to this URL deletes these objects."
        )
    raise CheckpointError(f"There is no checkpoint at {directory}: nothing is stored under this URL.")


def _damaged(path: Path | str, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is damaged: {what}. Use another checkpoint, or save this one again.")


def _check_structure(path: Path | MemberURL, index: Any) -> None:
    """The index's tables have the types its format gives them (docs/checkpoint_format.md); tensor entries are
    checked by ``_tensors`` and ``_version_1_tensors``."""
    if not isinstance(index, dict):
        raise _damaged(path, f"it holds a JSON {type(index).__name__}, not an object")
    if index.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} is not a {FORMAT_NAME} index (format={index.get('format')!r}).")
    version = index.get("version")
    if is_count(version) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {version}; this lightning_shard reads versions"
            f" {', '.join(map(str, READABLE_VERSIONS))}. Upgrade lightning_shard to read it."
        )
    if not is_count(version) or version not in READABLE_VERSIONS:
        raise _damaged(path, f"its format version is {version!r}, which no lightning_shard writes")
    _check_seal(path, index)
    if not isinstance(index.get("files"), dict) or not isinstance(index.get("tensors"), dict):
        raise CheckpointError(f"{path} lacks its 'files' or 'tensors' table.")
    for name, info in index["files"].items():
        refuse_unplain_name(path.parent, name)
        if not (isinstance(info, dict) and is_count(info.get("size")) and isinstance(info.get("sha256"), str)
                and isinstance(info.get(HEADER_DIGEST, ""), str)):
            raise _damaged(path, f"the entry of {name!r} in 'files' needs a byte count 'size' and a string 'sha256'")
    mesh = index.get("mesh")
    if not is_count(index.get("world_size")) or not (
        isinstance(mesh, dict) and is_count(mesh.get("replicas")) and is_count(mesh.get("shard_size"))
    ):
        raise _damaged(path, "'world_size' and 'mesh' ('replicas', 'shard_size') must be counts")
    ties = index.get("ties", {})
    if not isinstance(ties, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ties.items()):
        raise _damaged(path, "'ties' must map tensor names to tensor names")
    _check_optimizers(path, index.get("optimizers", []))
    left_out = index.get(LEFT_OUT, {})
    if not (isinstance(left_out, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in left_out.items())):
        raise _damaged(path, f"'{LEFT_OUT}' must map the model keys a save left out to their fingerprints")
    if ADAPTERS in index:
        check_adapters_record(path, index[ADAPTERS])


def _check_seal(path: Path | MemberURL, index: dict[str, Any]) -> None:
    """A sealed index (version 4) matches its seal and names its save; an older one carries no seal."""
    if index["version"] < SEALED_VERSION:
        if INDEX_SEAL in index or SAVE_ID_KEY in index:
            raise _damaged(path, f"it claims format version {index['version']} but carries a version-4 seal")
        return
    seal = index.get(INDEX_SEAL)
    if not isinstance(seal, str):
        raise _damaged(path, f"its seal ('{INDEX_SEAL}') is missing")
    if seal != index_seal(index):
        raise CheckpointError(
            f"{path} does not match its seal ('{INDEX_SEAL}', the SHA-256 of its contents): it was edited or damaged"
            " after the save, so none of it can be trusted (options, tensors, files, their order). Use another"
            " checkpoint, or save this one again."
        )
    if not (isinstance(index.get(SAVE_ID_KEY), str) and SAVE_ID.fullmatch(index[SAVE_ID_KEY])):
        raise _damaged(path, f"its '{SAVE_ID_KEY}' is not the 12 hex digits a save writes")


def _check_optimizers(path: Path | MemberURL, optimizers: Any) -> None:
    if not isinstance(optimizers, list):
        raise _damaged(path, "'optimizers' must be a list")
    for i, optimizer in enumerate(optimizers):
        groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
        groups_ok = isinstance(groups, list) and all(
            isinstance(g, dict) and isinstance(g.get("options"), dict) and isinstance(g.get("params"), list)
            and all(isinstance(n, str) for n in g["params"]) for g in groups
        )
        values = optimizer.get("values", {}) if isinstance(optimizer, dict) else None
        values_ok = isinstance(values, dict) and all(isinstance(v, dict) for v in values.values())
        if not (groups_ok and values_ok):
            raise _damaged(
                path,
                f"optimizer {i} needs 'param_groups' (each with a 'params' list of names and an 'options' object)"
                " and 'values' objects",
            )
        for entry in ("scalar_param_states", "whole_param_states"):
            states = optimizer.get(entry, {})
            if not (isinstance(states, dict) and all(
                isinstance(v, list) and all(isinstance(n, str) for n in v) for v in states.values()
            )):
                raise _damaged(path, f"optimizer {i}'s {entry!r} must map parameter names to lists of state names")


def _shape_and_dtype(path: Path | MemberURL, key: str, entry: Any) -> tuple[tuple[int, ...], torch.dtype]:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (is_shape(shape) and isinstance(entry.get("dtype"), str)):
        raise CheckpointError(f"{path}: tensor {key!r} has a malformed entry.")
    return tuple(shape), dtype_from_name(entry["dtype"])


def _tensors(path: Path | MemberURL, index: dict[str, Any], files: CheckpointFiles) -> dict[str, StoredTensor]:
    """The current version's tensor entries (see [Note: rows by rule]), checked in O(tensors + files)."""
    mesh = index["mesh"]
    shard_size = mesh["shard_size"]
    tp = index.get(TENSOR_PARALLEL_SIZE, 1)
    if not is_count(tp) or tp < 1:
        raise _damaged(path, f"'{TENSOR_PARALLEL_SIZE}' must be a positive count, not {tp!r}")
    stages = pipeline_size(path, index)
    if shard_size < 1 or mesh["replicas"] < 1 or mesh["replicas"] * shard_size * tp * stages != index["world_size"]:
        raise _damaged(path, f"its mesh {mesh} x {tp} x {stages} does not cover its world size {index['world_size']}")
    shard_files = index.get("shard_files")
    if not (isinstance(shard_files, list) and all(name in index["files"] for name in shard_files)):
        raise _damaged(path, "'shard_files' must list files of its 'files' table")
    if len(set(shard_files)) != len(shard_files) or len(shard_files) > shard_size:
        raise _damaged(path, f"'shard_files' must name at most {shard_size} distinct files, one per shard")
    shared = tuple(shard_files)
    tensors = {}
    for key, entry in index["tensors"].items():
        shape, dtype = _shape_and_dtype(path, key, entry)
        rows = shape[0] if shape else 1
        placement: Placement
        if entry.get("split") == SPLIT_BY_ROWS and "file" not in entry:
            if shards_holding_rows(rows, shard_size) > len(shared):
                raise _damaged(path, (
                    f"tensor {key!r} (shape {list(shape)}) is split over {shards_holding_rows(rows, shard_size)}"
                    f" shards but 'shard_files' names {len(shared)} files"
                ))
            placement = RowSplit(key, rows, shard_size, shared)
        elif "split" not in entry and isinstance(entry.get("key"), str) and isinstance(entry.get("file"), str):
            if entry["file"] not in index["files"]:
                raise CheckpointError(
                    f"{path}: tensor {key!r} refers to the file {entry['file']!r}, which the index does not list."
                )
            placement = Whole(entry["file"], entry["key"], rows)
        elif entry.get("split") == SPLIT_BY_PIECES:
            placement = _listed(path, key, shape, entry.get("pieces"), files)
        else:
            raise CheckpointError(f"{path}: tensor {key!r} has a malformed entry.")
        tensors[key] = StoredTensor(key, shape, dtype, placement, files)
    return tensors


def pipeline_size(path: Path | MemberURL, index: dict[str, Any]) -> int:
    """The writers' pipeline-parallel size (1 without the ``pipeline`` entry), its entry checked."""
    entry = index.get(PIPELINE)
    if entry is None:
        return 1
    blocks, bounds = (entry.get("blocks"), entry.get("bounds")) if isinstance(entry, dict) else (None, None)
    size = entry.get("size") if isinstance(entry, dict) else None
    if not (is_count(size) and size > 1 and isinstance(entry.get("module"), str) and isinstance(blocks, list)
            and all(isinstance(b, str) for b in blocks) and len(set(blocks)) == len(blocks)
            and isinstance(bounds, list) and len(bounds) == size + 1 and all(is_count(b) for b in bounds)
            and all(a < b for a, b in zip(bounds, bounds[1:])) and bounds[0] == 0
            and bounds[-1] == len(blocks)):  # fmt: skip
        raise _damaged(path, f"'{PIPELINE}' must record the stage count and each stage's blocks (at least one each)")
    return int(size)


def _version_1_tensors(
    path: Path | MemberURL, entries: dict[str, Any], files: CheckpointFiles
) -> dict[str, StoredTensor]:
    """Version-1 tensor entries, each listing its pieces: they never overlap or leave a gap, and name listed files.
    (That they reach the last row is checked by ``require_complete``, after a loader compared the shapes with the
    model's.) Checked in O(pieces), without opening a file."""
    tensors = {}
    for key, entry in entries.items():
        shape, dtype = _shape_and_dtype(path, key, entry)
        tensors[key] = StoredTensor(key, shape, dtype, _listed(path, key, shape, entry.get("pieces"), files), files)
    return tensors


def _listed(path: Path | MemberURL, key: str, shape: tuple[int, ...], raw: Any, files: CheckpointFiles) -> Listed:
    """A tensor's listed pieces (version 1, or a tensor-parallel save's): checked as ``_version_1_tensors`` says."""
    listed = files.sizes or {}
    if not (isinstance(raw, list) and raw):
        raise CheckpointError(f"{path}: tensor {key!r} has a malformed entry.")
    rows = shape[0] if shape else 1
    pieces = sorted((_version_1_piece(path, key, piece) for piece in raw), key=lambda piece: piece.lo)
    covered = 0
    for piece in pieces:
        if piece.lo != covered or piece.hi > rows:
            problem = "leaves a gap before it" if piece.lo > covered else "overlaps the previous piece"
            if piece.hi > rows:
                problem = f"lies beyond the tensor's {rows} rows"
            raise CheckpointError(
                f"{path}: tensor {key!r} (shape {list(shape)}): the piece in {piece.file!r} holding rows"
                f" [{piece.lo}, {piece.hi}) {problem}."
            )
        refuse_unplain_name(path.parent, piece.file)
        if piece.file not in listed:
            raise CheckpointError(
                f"{path}: tensor {key!r} refers to the file {piece.file!r}, which the index does not list."
            )
        covered = piece.hi
    return Listed(tuple(pieces))


def _version_1_piece(path: Path | MemberURL, key: str, piece: Any) -> Piece:
    rows = piece.get("rows") if isinstance(piece, dict) else None
    well_formed = (
        is_shape(rows) and len(rows) == 2 and rows[0] <= rows[1]
        and isinstance(piece.get("key"), str) and isinstance(piece.get("file"), str)
        and ("crc32" not in piece or is_count(piece["crc32"]))
    )
    if not well_formed or rows is None:
        raise CheckpointError(f"{path}: tensor {key!r} has a malformed piece {piece!r}.")
    return Piece(piece["file"], piece["key"], rows[0], rows[1], piece.get("crc32"))


def iter_index_tensors(index: dict[str, Any], prefix: str) -> Iterator[tuple[str, StoredTensor]]:
    """The index's tensors whose keys start with ``prefix``, keyed without it."""
    for key, entry in index["tensors"].items():
        if key.startswith(prefix):
            yield key[len(prefix) :], entry


def model_only_index(tensors: dict[str, StoredTensor]) -> dict[str, Any]:
    """An index of nothing but model tensors (of plain safetensors files, by state_dict key), as a load reads it."""
    return {"tensors": {MODEL_PREFIX + key: entry for key, entry in tensors.items()}}


def model_ties(index: dict[str, Any]) -> dict[str, str]:
    """Tied model weights: each alias mapped to the name it is stored under (both without the model prefix)."""
    return {k.removeprefix(MODEL_PREFIX): v.removeprefix(MODEL_PREFIX) for k, v in index.get("ties", {}).items()}


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------
#
# [Note: pipeline-parallel checkpoints]
# Under pipeline parallelism each stage holds its own modules only, so a save under it lists every piece, as a
# tensor-parallel save does (see [Note: tensor-parallel checkpoints]): every rank of replica 0 writes its rows of its
# stage's parameters and optimizer state, and the first rank of each stage that stage's buffers and scalar state.
# Rank 0 builds the index from its own stage's tensors and the part the first rank of every later stage sends with
# its file records (the tensors' keys, global shapes and dtypes, its ties and optimizer metadata), merged as the
# unsplit model's (``merge_stage_fields``): each optimizer's groups list the parameters of every stage, in stage
# order, which is the model's order. A weight tied across stages is written by its first stage, under the name the
# unsplit model gives it. The index records the split (``"pipeline"``: the stage count, the pipelined module and each
# stage's blocks) and the writers' world size covers ``replicas x shard_size x tensor_parallel_size x pipeline
# stages``. A load at any pipeline size (1 included) reads the rows it needs from the listed pieces, each checked as
# every read is.


@dataclass(frozen=True)
class SavedTensor:
    """A tensor a save stores: split by rows over the shards (parameters and optimizer state shaped like them, in a
    sharded save), or whole in one file."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: bool

    @classmethod
    def of(cls, key: str, shape: tuple[int, ...], dtype: torch.dtype, shard_size: int | None) -> SavedTensor:
        """A tensor the shards hold by rows, stored as a save by ``shard_size`` shards stores it (``None``: a full
        save, which splits nothing): split by rows, but those stored whole (see [Note: small tensors stored
        whole])."""
        return cls(key, shape, dtype, shard_size is not None and splits_by_rows(shape, dtype, shard_size))

    def to_json(self) -> list[Any]:
        """As the first rank of a pipeline stage sends it rank 0: ``[key, shape, dtype name, split]``."""
        return [self.key, list(self.shape), dtype_name(self.dtype), self.split]

    @classmethod
    def from_json(cls, entry: list[Any]) -> SavedTensor:
        key, shape, dtype, split = entry
        return cls(key, tuple(shape), dtype_from_name(dtype), split)


@dataclass(frozen=True)
class FileRecord:
    """What one rank reports of a file it wrote: its size and digest, the shard whose rows it holds (``None`` for a
    file of a full save), and the tensors it holds whole (index key -> key in the file)."""

    name: str
    size: int
    sha256: str
    shard: int | None
    whole: dict[str, str] = field(default_factory=dict)
    pieces: dict[str, list[int]] = field(default_factory=dict)  # index key -> [first row, last row + 1] it holds
    header_sha256: str | None = None  # of a data file (one a load reads in parts): see [Note: what a load verifies]

    @classmethod
    def written(
        cls, path: Path, shard: int | None = None, whole: dict[str, str] | None = None,
        pieces: dict[str, list[int]] | None = None, header_sha256: str | None = None,
    ) -> FileRecord:
        """The record of the file just written at ``path``."""
        return cls(path.name, path.stat().st_size, sha256_file(path), shard, whole or {}, pieces or {}, header_sha256)


def index_head(
    state_dict_type: str,
    world_size: int,
    mesh: tuple[int, int],
    sharding_strategy: str,
    save_id: str,
    fields: dict[str, Any],
    tensor_parallel_size: int = 1,
    pipeline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything of an index but its files, tensors and seal (see docs/checkpoint_format.md). ``fields`` follow from
    the model and optimizers: ``ties`` (alias -> stored name, both state_dict keys), ``optimizers``
    (``optimizer_entry``'s) and, where a save has them, ``left_out`` and ``adapters``."""
    head = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        SAVE_ID_KEY: save_id,
        "state_dict_type": state_dict_type,
        "world_size": world_size,
        "mesh": {"replicas": mesh[0], "shard_size": mesh[1]},
        "sharding_strategy": sharding_strategy,
        "ties": {MODEL_PREFIX + k: MODEL_PREFIX + v for k, v in fields["ties"].items()},
        "optimizers": fields["optimizers"],
    }
    if tensor_parallel_size > 1:
        head[TENSOR_PARALLEL_SIZE] = tensor_parallel_size
    if pipeline is not None:
        head[PIPELINE] = pipeline
    head.update({k: v for k, v in fields.items() if k in (LEFT_OUT, ADAPTERS)})
    return head


def optimizer_entry(
    i: int,
    groups: Sequence[tuple[list[str], dict[str, Any]]],
    values: dict[str, dict[str, Any]],
    row_states: dict[str, list[str]],
    whole_states: dict[str, list[str]],
    where: str = "",
) -> dict[str, Any]:
    """Optimizer ``i``'s entry in the index (of the checkpoint ``where`` names, for a conversion): its groups (the
    names of their parameters and their options), the plain values of its state by parameter name, and which states
    of a parameter are split by rows like a 0-dim one (``row_states``) or stored whole in another shape
    (``whole_states``: Adafactor's row and column statistics); see docs/checkpoint_format.md."""
    entries = []
    for names, options in groups:
        option_tensors: dict[str, Tensor] = {}
        encoded = to_json_tree(options, option_tensors, f"optimizer {i}")
        if option_tensors:
            raise CheckpointError(
                f"Optimizer {i}{where} has tensor-valued options ({', '.join(sorted(option_tensors))}): a checkpoint"
                " stores options as plain values. Pass them as Python numbers (e.g. lr=1e-3, not"
                " lr=torch.tensor(1e-3))."
            )
        entries.append({"params": names, "options": encoded})
    entry: dict[str, Any] = {"param_groups": entries, "values": {
        fqn: {key: to_json_tree(value, {}, f"{OPTIMIZER_PREFIX}{i}/{fqn}/{key}") for key, value in state.items()}
        for fqn, state in values.items()
    }}
    if row_states:
        entry["scalar_param_states"] = row_states
    if whole_states:
        entry["whole_param_states"] = whole_states
    return entry


def merge_stage_fields(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """The index fields of two pipeline stages' parts as one model's: ties, left-out weights and each adapter's
    tensors together, each optimizer's groups listing both stages' parameters (a tied weight once, by the name the
    first stage gave it)."""
    merged = {**first, "ties": {**first["ties"], **later["ties"]}}
    if LEFT_OUT in later:
        merged[LEFT_OUT] = {**first.get(LEFT_OUT, {}), **later[LEFT_OUT]}
    if ADAPTERS in later:  # each adapter's tensors on every stage
        record = first.get(ADAPTERS) or {**later[ADAPTERS], "adapters": {}}
        adapters = {name: {**entry, "tensors": {**entry["tensors"]}} for name, entry in record["adapters"].items()}
        for name, entry in later[ADAPTERS]["adapters"].items():
            adapters.setdefault(name, {**entry, "tensors": {}})["tensors"].update(entry["tensors"])
        merged[ADAPTERS] = {**record, "adapters": adapters}
    optimizers = []
    for a, b in zip(first["optimizers"], later["optimizers"], strict=True):
        seen = {name for group in a["param_groups"] for name in group["params"]} | set(merged["ties"])
        groups = [{**ga, "params": ga["params"] + [n for n in gb["params"] if n not in seen]}
                  for ga, gb in zip(a["param_groups"], b["param_groups"], strict=True)]  # fmt: skip
        optimizer = {**a, "param_groups": groups, "values": {**b["values"], **a["values"]}}
        for entry in ("scalar_param_states", "whole_param_states"):
            if entry in a or entry in b:
                optimizer[entry] = {**b.get(entry, {}), **a.get(entry, {})}
        optimizers.append(optimizer)
    merged["optimizers"] = optimizers
    return merged


def build_index(head: dict[str, Any], tensors: Sequence[SavedTensor], records: Sequence[FileRecord]) -> dict[str, Any]:
    """The index of a save: ``head`` (``index_head``'s), the files of ``records`` and an entry per tensor. ``records``
    are the files the ranks wrote, in any order."""
    records = sorted(records, key=lambda r: (r.shard is None, r.shard or 0, r.name))
    shards = [r.shard for r in records if r.shard is not None]
    if shards != list(range(len(shards))):
        raise CheckpointError(f"Internal error: the shard files of this save are those of shards {shards}.")
    holder = {key: (r.name, in_file) for r in records for key, in_file in r.whole.items()}
    listed: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        for key, rows in r.pieces.items():
            listed.setdefault(key, []).append({"file": r.name, "key": key, "rows": rows})
    entries: dict[str, dict[str, Any]] = {}
    for t in tensors:
        entry: dict[str, Any] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
        if t.key in listed:  # pieces a tensor-parallel save's files list (whatever the split rule would do)
            entry["split"], entry["pieces"] = SPLIT_BY_PIECES, sorted(listed[t.key], key=lambda p: p["rows"][0])
        elif t.split:
            entry["split"] = SPLIT_BY_ROWS
        elif t.key in holder:
            entry["file"], entry["key"] = holder[t.key]
        else:
            raise CheckpointError(f"Internal error: no file of this save holds {t.key!r}.")
        entries[t.key] = entry
    return {
        **head,
        "files": {r.name: _file_entry(r) for r in records},
        "shard_files": [r.name for r in records if r.shard is not None],
        "tensors": entries,
    }


def _file_entry(record: FileRecord) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": record.size, "sha256": record.sha256}
    if record.header_sha256 is not None:
        entry[HEADER_DIGEST] = record.header_sha256
    return entry


def encode_index(index: dict[str, Any]) -> bytes:
    """``index`` as the bytes of ``index.json``, sealed (see [Note: what a load verifies]); refused
    (``CheckpointError``) above ``MAX_JSON_BYTES``, the limit ``read_json_member`` applies on load (the one constant,
    read at each call)."""
    index = {key: value for key, value in index.items() if key != INDEX_SEAL}
    index[INDEX_SEAL] = index_seal(index)
    data = json.dumps(index, indent=1).encode()
    limit = checkpoint_format.MAX_JSON_BYTES
    if len(data) > limit:
        raise CheckpointError(
            f"The checkpoint's index would take {len(data)} bytes ({len(index['tensors'])} tensors,"
            f" {len(index['files'])} files), above the {limit} bytes a load reads; nothing was saved. Save"
            " fewer, larger tensors, or with state_dict_type='full' (two files)."
        )
    return data

