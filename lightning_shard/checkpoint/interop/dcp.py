"""``torch.distributed.checkpoint`` (DCP) directories, as Lightning's ModelParallelStrategy (FSDP2, ``fully_shard``),
FSDPStrategy with ``state_dict_type="sharded"`` and ``fabric.save`` under them write them: read (``read_dcp``) and
written from a lightning_shard checkpoint (``export_dcp``), so that leaving is as easy as arriving.

A DCP directory holds ``.metadata``, ``__<rank>_<n>.distcp`` data files and, from Lightning, ``meta.pt`` (the
checkpoint dict without model and optimizer). ``.metadata`` is a plain pickle of a few DCP types: it is read with an
unpickler that admits exactly those types and refuses any other name (see [Note: the DCP metadata unpickler]); the
tensor chunks and byte entries in the data files, and ``meta.pt``, are ``torch.save`` blobs read with the restricted
``torch.load`` (see [Note: no pickle runs]). Each tensor is stored as chunks, one per saving rank, with their
offsets; a reader takes the rows it needs from the chunks that hold them, whatever world size wrote them.

``export_dcp`` writes the layout ``ModelParallelStrategy.save_checkpoint`` writes: the model under ``state_dict``
(every key of the LightningModule's ``state_dict()``, tied weights under each of their names), each optimizer under
``optimizer_<i>`` in ``get_optimizer_state_dict``'s form (``state.<parameter>.<state>`` and
``param_groups.<i>.<option>``), and ``meta.pt`` with the rest of Lightning's checkpoint dict (loops, callbacks,
schedulers). DCP's own writer writes it in this one process (``no_dist=True``); each tensor is planned from its
shape alone and read from the checkpoint only when the writer reaches it, so one full tensor is in memory at a time.
Every tensor is one chunk, which DCP reshards to any world size when it loads.
"""

from __future__ import annotations

import bisect
import io
import math
import pickle
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from lightning_shard.checkpoint.format import (
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    CheckpointError,
    dtype_name,
    is_count,
    member_path,
)
from lightning_shard.checkpoint.format.trainer_state import TRAINER_MODEL, TRAINER_PLACEHOLDERS, from_json_tree
from lightning_shard.checkpoint.interop.export import ExportResult, export_source, require_whole_model, staged
from lightning_shard.checkpoint.interop.foreign import ForeignCheckpoint, ForeignOptimizer, ForeignTensor, ParamKeys
from lightning_shard.checkpoint.interop.safe_pickle import load_restricted
from lightning_shard.checkpoint.io.index import iter_index_tensors, model_ties
from lightning_shard.checkpoint.io.layout import StoredTensor
from lightning_shard.checkpoint.io.reader import FileHandles, read_tensor
from lightning_shard.checkpoint.load.directory import load_trainer_state

METADATA_FILE = ".metadata"
LIGHTNING_META_FILE = "meta.pt"  # Lightning's checkpoint dict without model and optimizers (rank 0's torch.save)
MODEL_KEYS = (TRAINER_MODEL, "model")  # ModelParallelStrategy's and FSDPStrategy's key of the model in the DCP tree
MAX_METADATA_BYTES = 1 << 30  # the metadata of any real checkpoint is far smaller

# --------------------------------------------------------------------------------------------------
# .metadata
# --------------------------------------------------------------------------------------------------
#
# [Note: the DCP metadata unpickler]
# ``.metadata`` is written with ``pickle.dump`` of a ``Metadata`` object, so loading it with ``pickle.load`` would
# run whatever a crafted file names. ``_MetadataUnpickler.find_class`` admits only the classes DCP puts there (its
# metadata dataclasses, ``_StorageInfo``, ``torch.Size``, dtypes, layouts, the memory-format enum and the
# ``pathlib`` path of ``StorageMeta.checkpoint_id``) and refuses any other module or name before it is imported, so
# nothing else can be called. The objects it builds are then checked field by field (``_check_metadata``): types,
# shapes and offsets, file names inside the directory and byte ranges inside their files.

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ADMITTED = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what ``_ADMITTED`` names, and dtypes (see [Note: the DCP metadata unpickler])."""

    def __init__(self, file: io.BytesIO, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self._path} names {module}.{name}, which is not one of the types torch.distributed.checkpoint writes"
            " into its metadata; refused. The metadata is read without unpickling anything else: a pickle that names"
            " other functions could run any command."
        )


def read_metadata(directory: Path) -> Any:
    """The ``Metadata`` of the DCP directory, read by the restricted unpickler and checked against the files."""
    path = member_path(directory, METADATA_FILE)
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a torch.distributed.checkpoint directory: {path} is missing.")
    with open(path, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_METADATA_BYTES} bytes, which no checkpoint writes.")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file: name it
        raise CheckpointError(f"{path} cannot be read as DCP metadata ({type(err).__name__}: {err}).") from None
    _check_metadata(directory, path, metadata)
    return metadata


def _check_metadata(directory: Path, path: Path, metadata: Any) -> None:
    def damaged(what: str) -> CheckpointError:
        return CheckpointError(f"{path} is damaged: {what}.")

    if not isinstance(metadata, Metadata):
        raise damaged(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise damaged("state_dict_metadata and storage_data must be dicts")
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise damaged(f"the entry {key!r} is a {type(entry).__name__}")
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor_entry(key, entry, damaged)
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise damaged(f"storage_data maps {type(index).__name__} to {type(info).__name__}")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            raise CheckpointError(
                f"{path}: {index.fqn!r} is stored through the stream transforms {list(transforms)}"
                " (DCP's experimental extensions, e.g. compression), which lightning_shard does not read."
            )
        name = info.relative_path
        if name not in sizes:
            file = member_path(directory, name)  # refuses names that lead out of the directory
            if not file.is_file():
                raise CheckpointError(f"{directory}: the data file {name!r} holding {index.fqn!r} is missing.")
            sizes[name] = file.stat().st_size
        if not (is_count(info.offset) and is_count(info.length) and info.offset + info.length <= sizes[name]):
            raise CheckpointError(
                f"{directory / name}: {index.fqn!r} claims bytes [{info.offset}, {info.offset}+{info.length}) but the"
                f" file holds {sizes[name]}: it is truncated or damaged."
            )
    planner = metadata.planner_data
    if planner is not None and not (isinstance(planner, dict) and all(
        isinstance(v, tuple) and all(isinstance(p, (str, int)) for p in v) for v in planner.values()
    )):
        raise damaged("planner_data must map keys to tuples of names and indices")


def _check_tensor_entry(key: str, entry: Any, damaged: Callable[[str], CheckpointError]) -> None:
    """A tensor's size, dtype and chunks are well formed, and its chunks cover it exactly once."""
    size = entry.size
    if not (isinstance(size, torch.Size) and all(is_count(d) for d in size)):
        raise damaged(f"tensor {key!r} has size {size!r}")
    if not isinstance(getattr(entry.properties, "dtype", None), torch.dtype):
        raise damaged(f"tensor {key!r} has no dtype")
    chunks = entry.chunks
    if not isinstance(chunks, list) or not chunks:
        raise damaged(f"tensor {key!r} has no chunks")
    if len(chunks) > MAX_CHUNKS:
        raise damaged(f"tensor {key!r} lists {len(chunks)} chunks, more than the {MAX_CHUNKS} a save can write")
    volume = 0
    for c in chunks:
        ok = isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size) and isinstance(
            c.sizes, torch.Size) and len(c.offsets) == len(c.sizes) == len(size)
        if not ok or any(o + s > d for o, s, d in zip(c.offsets, c.sizes, size)):
            raise damaged(f"tensor {key!r} (size {list(size)}) has a chunk {c!r} outside it")
        volume += math.prod(c.sizes)
    if volume != math.prod(size) or _overlap(chunks):
        raise damaged(f"the chunks of tensor {key!r} (size {list(size)}) do not cover it exactly once")


MAX_CHUNKS = 1 << 20  # chunks of one tensor a DCP index may list (one per saving rank, or per rank pair with TP)
_MAX_IRREGULAR_CHUNKS = 256  # chunks not on a grid, compared pair by pair (32,640 pairs at most)


def _overlap(chunks: Sequence[Any]) -> bool:
    """Whether two (non-empty) chunks overlap, in ``n log n`` plus the cells of the grid their boundaries draw.

    The boundaries of all chunks cut each dimension into intervals; the intervals make a grid, and each chunk covers
    a block of whole cells. The chunks overlap exactly when some cell is covered twice. DCP's chunks are a grid
    already (a split per dimension: FSDP's rows, or rows and columns with tensor parallelism), so the grid has about
    as many cells as there are chunks. Chunks whose grid has more than ``4 n + 64`` cells are compared pair by pair
    when there are at most 256 of them, and refused as a damaged index otherwise, rather than walked (the chunks'
    volumes already add up to the tensor's, which the caller checked)."""
    chunks = [c for c in chunks if math.prod(c.sizes)]
    if len(chunks) < 2:
        return False
    dims = len(chunks[0].offsets)
    cuts = [sorted({c.offsets[d] for c in chunks} | {c.offsets[d] + c.sizes[d] for c in chunks}) for d in range(dims)]
    cells = math.prod(len(cut) - 1 for cut in cuts)
    if cells > 4 * len(chunks) + 64:  # not a grid: pairwise, for the few chunks an irregular split can honestly have
        if len(chunks) > _MAX_IRREGULAR_CHUNKS:
            return True
        return any(
            all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes))
            for i, a in enumerate(chunks) for b in chunks[i + 1 :]
        )
    covered = np.zeros([len(cut) - 1 for cut in cuts], dtype=np.uint8)
    for c in chunks:
        block = tuple(slice(bisect.bisect_left(cut, o), bisect.bisect_left(cut, o + s))
                      for cut, o, s in zip(cuts, c.offsets, c.sizes))
        if covered[block].any():
            return True
        covered[block] = 1
    return False


# --------------------------------------------------------------------------------------------------
# The directory as a foreign checkpoint
# --------------------------------------------------------------------------------------------------


class _Storage:
    """Reads DCP items: a tensor's rows from the chunks that hold them, a byte entry's value."""

    def __init__(self, directory: Path, metadata: Any) -> None:
        self.directory = directory
        self.entries = metadata.state_dict_metadata
        self.where = {(i.fqn, tuple(i.offset) if i.offset is not None else None): s
                      for i, s in metadata.storage_data.items()}

    def _blob(self, key: str, offset: tuple[int, ...] | None) -> bytes:
        info = self.where.get((key, offset))
        if info is None:
            raise CheckpointError(f"{self.directory / METADATA_FILE}: no storage is recorded for {key!r} at {offset}.")
        with open(member_path(self.directory, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise CheckpointError(f"{self.directory / info.relative_path} ends inside {key!r}: it is truncated.")
        return data

    def value(self, key: str) -> Any:
        """The object of the byte entry ``key`` (a ``torch.save`` blob)."""
        return load_restricted(self._blob(key, None), f"The entry {key!r} of the DCP directory {self.directory}")

    def tensor(self, key: str) -> ForeignTensor:
        entry = self.entries[key]
        return ForeignTensor(tuple(entry.size), entry.properties.dtype, lambda a, b: self._rows(key, a, b))

    def _rows(self, key: str, start: int, stop: int) -> Tensor:
        entry = self.entries[key]
        size, dtype = tuple(entry.size), entry.properties.dtype
        if not size:
            return self._chunk(key, entry.chunks[0], dtype) if start < stop else torch.empty(0, dtype=dtype)
        out = torch.empty((stop - start, *size[1:]), dtype=dtype)
        for chunk in entry.chunks:
            lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
            a, b = max(lo, start), min(hi, stop)
            if a >= b:
                continue
            data = self._chunk(key, chunk, dtype)
            region = out[(slice(a - start, b - start), *(slice(o, o + s) for o, s in zip(chunk.offsets[1:],
                                                                                         chunk.sizes[1:])))]
            region.copy_(data[a - lo : b - lo])
            del data  # one chunk in memory at a time
        return out

    def _chunk(self, key: str, chunk: Any, dtype: torch.dtype) -> Tensor:
        what = f"The chunk at {list(chunk.offsets)} of {key!r} in the DCP directory {self.directory}"
        data = load_restricted(self._blob(key, tuple(chunk.offsets)), what)
        if not isinstance(data, Tensor) or tuple(data.shape) != tuple(chunk.sizes) or data.dtype != dtype:
            found = f"shape {list(data.shape)}, {data.dtype}" if isinstance(data, Tensor) else type(data).__name__
            raise CheckpointError(f"{what} holds {found}, not shape {list(chunk.sizes)}, {dtype}: it is damaged.")
        return data


def read_dcp(directory: Path, module_key: str | None = None, optimizer_keys: Sequence[str] = ()) -> ForeignCheckpoint:
    """The checkpoint in the DCP directory. The model is the tree under ``module_key`` when the directory holds it,
    else under ``"state_dict"`` (ModelParallelStrategy) or ``"model"`` (FSDPStrategy); the optimizers under
    ``optimizer_keys`` when it holds them, else under ``"optimizer_0"``, ``"optimizer_1"``, ... (the Trainer's)."""
    metadata = read_metadata(directory)
    storage = _Storage(directory, metadata)
    planner = metadata.planner_data or {}
    paths = {key: tuple(planner.get(key, (key,))) for key in metadata.state_dict_metadata}
    tops = list(dict.fromkeys(p[0] for p in paths.values()))
    model_key = next((k for k in (module_key, *MODEL_KEYS) if k is not None and k in tops), None)
    if model_key is None:
        raise CheckpointError(
            f"The DCP directory {directory} holds no model under {[k for k in (module_key, *MODEL_KEYS) if k]};"
            f" its entries are {tops}."
        )
    opt_keys = [k for k in optimizer_keys if k in tops] or sorted(
        (k for k in tops if isinstance(k, str) and k.startswith("optimizer_") and k[10:].isdigit()),
        key=lambda k: int(k[10:]),
    )
    unknown = [k for k in tops if k != model_key and k not in opt_keys]
    if unknown:
        raise CheckpointError(
            f"The DCP directory {directory} holds {unknown} beside the model ({model_key!r}) and the optimizers"
            f" {opt_keys}; lightning_shard cannot tell what they are."
        )
    model = _model_of(storage, paths, model_key)
    optimizers = [_optimizer_of(storage, paths, k) for k in opt_keys]
    values = _lightning_meta(directory)
    return ForeignCheckpoint(directory, "the DCP directory", model, optimizers, values)


def _model_of(storage: _Storage, paths: dict[str, tuple[Any, ...]], top: str) -> dict[str, ForeignTensor]:
    model = {}
    for key, path in paths.items():
        if path[0] != top:
            continue
        if len(path) != 2 or key not in storage.entries or _is_bytes(storage.entries[key]):
            raise CheckpointError(
                f"The DCP directory {storage.directory}: the model entry {'.'.join(map(str, path))!r} is not a tensor"
                " of the module's state_dict (extra state from get_extra_state() is not supported)."
            )
        model[str(path[1])] = storage.tensor(key)
    return model


def _optimizer_of(storage: _Storage, paths: dict[str, tuple[Any, ...]], top: str) -> ForeignOptimizer:
    """The name-keyed optimizer state under ``top`` (``get_optimizer_state_dict``'s layout, flattened by DCP into
    ``<top>.state.<name>.<state>`` and ``<top>.param_groups.<i>.<option>``)."""
    state: dict[int | str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    for key, path in paths.items():
        if path[0] != top:
            continue
        entry = storage.entries[key]
        if len(path) == 4 and path[1] == "state":
            state.setdefault(str(path[2]), {})[str(path[3])] = (
                storage.value(key) if _is_bytes(entry) else storage.tensor(key)
            )
        elif len(path) == 4 and path[1] == "param_groups" and isinstance(path[2], int) and _is_bytes(entry):
            groups.setdefault(path[2], {})[str(path[3])] = storage.value(key)
        else:
            raise CheckpointError(
                f"The DCP directory {storage.directory}: {key!r} is not part of an optimizer state dict"
                " (<optimizer>.state.<parameter>.<state> or <optimizer>.param_groups.<i>.<option>)."
            )
    ordered = [groups[i] for i in sorted(groups)]
    if sorted(groups) != list(range(len(groups))) or not all(
        isinstance(g.get("params"), list) and all(isinstance(n, str) for n in g["params"]) for g in ordered
    ):
        raise CheckpointError(
            f"The DCP directory {storage.directory}: the parameter groups of {top!r} are incomplete (each needs"
            " 'params', the names of its parameters)."
        )
    return ForeignOptimizer(ParamKeys.NAME, ordered, state)


def _is_bytes(entry: Any) -> bool:
    return isinstance(entry, BytesStorageMetadata)


def _lightning_meta(directory: Path) -> dict[str, Any]:
    """``meta.pt``, Lightning's checkpoint dict without model and optimizers; ``{}`` when the directory has none."""
    path = directory / LIGHTNING_META_FILE
    if not path.exists():
        return {}
    member_path(directory, LIGHTNING_META_FILE)  # refuses a link out of the directory
    values = load_restricted(path, f"The Lightning metadata file {path}")
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} holds a {type(values).__name__}, not Lightning's checkpoint dict.")
    return values


# --------------------------------------------------------------------------------------------------
# A lightning_shard checkpoint as a DCP directory
# --------------------------------------------------------------------------------------------------


def export_dcp(checkpoint: str | Path, output_dir: str | Path, overwrite: bool = False) -> ExportResult:
    """Write the checkpoint directory ``checkpoint`` as a DCP directory at ``output_dir`` (see the module docstring).
    A non-empty existing ``output_dir`` is refused unless ``overwrite``."""
    directory, out, index = export_source(checkpoint, output_dir, overwrite, "export_dcp()")
    require_whole_model(directory, index)
    values, _ = load_trainer_state(directory, index)
    handles, readers = FileHandles(), dict[int, Callable[[], Tensor]]()
    model = {key: _placeholder(entry, handles, readers) for key, entry in iter_index_tensors(index, MODEL_PREFIX)}
    for alias, stored in model_ties(index).items():  # a tied weight under each of its names, as state_dict() has it
        model[alias] = model[stored]
    state: dict[str, Any] = {TRAINER_MODEL: model}
    for i, meta in enumerate(index.get("optimizers", [])):
        state[f"optimizer_{i}"] = _optimizer_state(index, i, meta, handles, readers)
    for key in TRAINER_PLACEHOLDERS:
        values.pop(key, None)
    with staged(out) as tmp:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1)
        with handles, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True says so
            dcp.save(state, storage_writer=writer, planner=_ReadingPlanner(readers), no_dist=True)
        torch.save(values, tmp / LIGHTNING_META_FILE)
        meta_types = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(tmp / LIGHTNING_META_FILE))
    exported = [e for k, e in index["tensors"].items() if k.startswith((MODEL_PREFIX, OPTIMIZER_PREFIX))]
    notes = [f"{LIGHTNING_META_FILE} holds {', '.join(meta_types)}, which torch.load(weights_only=True) refuses by"
             " default: allow them with torch.serialization.add_safe_globals([...]) before resuming."]
    return ExportResult(out, sorted(p.name for p in out.iterdir()), {k: dtype_name(t.dtype) for k, t in model.items()},
                        sum(math.prod(e.shape) * e.dtype.itemsize for e in exported),
                        f"{len(model)} model tensors and {len(state) - 1} optimizer states",
                        notes=notes if meta_types else [])


def _placeholder(entry: StoredTensor, handles: FileHandles, readers: dict[int, Callable[[], Tensor]]) -> Tensor:
    """A meta tensor of the entry's shape and dtype, which the planner replaces with the data when it is written."""
    placeholder = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
    readers[id(placeholder)] = lambda: read_tensor(entry, handles)
    return placeholder


def _optimizer_state(
    index: dict[str, Any], i: int, meta: dict[str, Any], handles: FileHandles,
    readers: dict[int, Callable[[], Tensor]],
) -> dict[str, Any]:
    """Optimizer ``i`` as ``get_optimizer_state_dict`` gives it: per-parameter state by name, and the groups."""
    state: dict[str, dict[str, Any]] = {}
    for key, entry in iter_index_tensors(index, f"{OPTIMIZER_PREFIX}{i}/"):
        name, state_name = key.rsplit("/", 1)
        state.setdefault(name, {})[state_name] = _placeholder(entry, handles, readers)
    for name, values in meta.get("values", {}).items():
        for state_name, value in values.items():
            state.setdefault(name, {})[state_name] = from_json_tree(value, {})
    groups = [{**from_json_tree(g["options"], {}), "params": list(g["params"])} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


class _ReadingPlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a tensor's data is read from the checkpoint only when the writer asks
    for it: the state dict it plans from holds meta tensors."""

    def __init__(self, readers: dict[int, Callable[[], Tensor]]) -> None:
        super().__init__()
        self._readers = readers

    def transform_object(self, write_item: Any, object: Any) -> Any:  # noqa: A002 - DCP's parameter name
        reader = self._readers.get(id(object))
        if reader is not None:
            return reader()
        return super().transform_object(write_item, object)
