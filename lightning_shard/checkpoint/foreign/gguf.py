"""A GGUF file in: starting a fit from a GPT-2 or Llama GGUF model file, each rank reading only its rows
(``load_gguf_into``; docs/gguf.md).

The file is parsed by the ``gguf`` package's ``GGUFReader``, which memory-maps it and walks its header, trusting
every count and length it finds. It is run here with bounds on that walk (see [Note: a GGUF header is untrusted]);
the tensors it describes are checked against the file before any of their data is touched. What the file holds is
then described as a ``ForeignCheckpoint`` under the model's own keys, each tensor read a few Hugging Face rows at a
time out of GGUF's layout ([Note: GGUF layouts]) and dequantised, so the loader of the other foreign formats
(``foreign_load``) fills the sharded model with the same checks and the same agreement between ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lightning_shard.checkpoint.foreign.foreign import ForeignCheckpoint, ForeignTensor
from lightning_shard.checkpoint.format import CheckpointError, submodule_prefix
from lightning_shard.checkpoint.format.gguf import GgufArchitecture, Layout, architecture_of, rotary_row_order
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.io.storage import local_only
from lightning_shard.checkpoint.load.load import LoadResult
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of

GGUF_MAGIC = b"GGUF"
MAX_METADATA_PAIRS = 2**16  # real files hold tens
MAX_TENSORS = 2**20  # the largest published models hold a few thousand
MAX_METADATA_VALUES = 2**21  # array elements in all: a 256k vocabulary with scores, types and merges fits
MAX_BLOCKS = 4096
READ_TYPES = ("F32", "F16", "BF16", "Q8_0")  # the tensor types dequantised here

# [Note: a GGUF header is untrusted]
# ``GGUFReader`` reads every count, length and offset of a file's header and follows it: a string or an array as long
# as the file says, as many metadata pairs and tensors as it says, each tensor's data where its offset says. A
# truncated or hostile file would make it read past the end (it silently reads less), loop over billions of array
# elements or tensors, or hand out a tensor whose data lies beyond the file. Its reads all go through one method
# (``_get``) and its walk through four (the pairs, an array, the tensor table, the tensors), so the reader is run with
# those bounded: a read beyond the file, more pairs, tensors or array elements than any real file holds (or than the
# rest of the file could hold), a nested array, and a tensor whose type is unknown, whose shape is not 1 to 4 positive
# dimensions, whose data is not inside the data section or overlaps another's, are all refused before anything is
# allocated for them, each naming the file. The work is then bounded by the file's size and these counts.


@dataclass(frozen=True)
class GgufFile:
    """A checked GGUF file: its architecture, its scalar metadata (arrays left out), and its tensors by name."""

    path: Path
    architecture: Any  # general.architecture, checked when used
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # gguf.ReaderTensor, data a memory map of the file


def is_gguf(path: Path) -> bool:
    """Whether ``path`` starts as a GGUF file does."""
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf(path: Path) -> GgufFile:
    """``path`` parsed by the ``gguf`` package with the bounds of [Note: a GGUF header is untrusted]; a file that is
    no GGUF, or not one this package reads, is refused with a ``CheckpointError`` naming it."""
    if not path.is_file():
        raise CheckpointError(f"The GGUF file {path} does not exist.")
    if not is_gguf(path):
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r}).")
    try:
        reader = _bounded_reader()(path)
        if reader.byte_order != "I":
            raise CheckpointError(f"{path} is a GGUF file of the other byte order, which is not read here.")
        metadata = {name: field.contents() for name, field in reader.fields.items()
                    if field.types and field.types[0].name != "ARRAY"}
    except CheckpointError:
        raise
    except (ValueError, KeyError, IndexError, OverflowError, RecursionError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}).") from None
    unread = [f"{t.name} ({t.tensor_type.name})" for t in reader.tensors if t.tensor_type.name not in READ_TYPES]
    if unread:
        raise CheckpointError(
            f"{path} holds tensors of a type not read here: {', '.join(unread[:8])}; the types read are"
            f" {', '.join(READ_TYPES)}. Convert the file to one of them (llama.cpp's llama-quantize) first."
        )
    architecture = metadata.get("general.architecture")
    return GgufFile(path, architecture, metadata, {t.name: t for t in reader.tensors})


def load_gguf_into(module: nn.Module, path: str | Path, prefix: str = "", strict: bool = True) -> LoadResult:
    """Load a GPT-2 or Llama GGUF file into a model that ``ShardStrategy`` (or ``shard_model``) has sharded: each rank
    reads only its rows of each tensor, dequantised (F16, BF16, Q8_0) and cast to the parameter's dtype. Collective:
    every rank must call it, e.g. in ``on_fit_start`` or after ``fabric.setup_module``.

    ``prefix`` names the submodule holding the Hugging Face model (``"model."`` when the LightningModule holds it as
    ``self.model``), whose keys map to the file's GGUF names. A file of another architecture than the model's, a
    tensor the model needs that the file lacks (or, with ``strict``, one the model has no place for), and a tensor of
    another shape are refused before anything is read, naming the GGUF tensor, the model's key and the file. Returns
    the missing and unexpected keys."""
    engine = sharded_module_of(module)
    if engine is None:
        raise CheckpointError(
            "load_gguf_into() needs the model ShardStrategy has sharded (the LightningModule after the Trainer set"
            " it up, e.g. from on_fit_start, or after fabric.setup_module); this module is not sharded."
        )
    from lightning_shard.checkpoint.foreign.foreign_load import load_foreign_model

    where = local_only(path, "load_gguf_into()")
    source = agree(lambda: gguf_checkpoint(read_gguf(where), engine, module, submodule_prefix(prefix), strict))
    return load_foreign_model(engine, module, source, strict=strict)


def gguf_checkpoint(
    file: GgufFile, engine: ShardedModule, module: nn.Module, prefix: str, strict: bool
) -> ForeignCheckpoint:
    """The tensors of ``file`` under the keys of ``module`` (the Hugging Face model under ``prefix``), checked
    against the model's names and shapes."""
    where = f"The GGUF file {file.path}"
    arch = architecture_of(file.architecture, where)
    net = module.get_submodule(prefix.rstrip(".")) if prefix else module
    model_type = getattr(getattr(net, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type != arch.model_type:
        raise CheckpointError(
            f"{where} holds a {arch.name} model; the model under the prefix {prefix!r} is a {model_type}."
        )
    metadata = _architecture_metadata(file, arch)
    layers = getattr(getattr(net, "config", None), "num_hidden_layers", 0)
    name_of = arch.name_map(max(metadata["block_count"], layers if isinstance(layers, int) else 0))
    shapes = {p.fqn: tuple(p.full_shape) for p in engine.sharded_params()}
    aliases = {f: p.fqns for p in engine.sharded_params() for f in p.fqns}
    keys = [k for k in module.state_dict() if k.startswith(prefix)]
    named = {key: name_of(key[len(prefix):]) for key in keys}
    model: dict[str, ForeignTensor] = {}
    missing, problems = [], []
    for key, name in named.items():
        if name is not None and name in file.tensors:
            tensor = file.tensors[name]
            layout = arch.layout(name)
            shape = _hf_shape(tensor, layout)
            want = shapes.get(next((f for f in aliases.get(key, (key,)) if f in shapes), key))
            if want is not None and tuple(want) != shape:
                problems.append(f"tensor {name!r} holds {list(shape)} for the model's {key!r}, which is {list(want)}")
            model[key] = ForeignTensor(shape, _torch_dtype(tensor), _row_reader(arch, name, tensor, layout, metadata))
        elif not any(alias != key and named.get(alias) in file.tensors for alias in aliases.get(key, ())):
            missing.append(f"{name!r} (the model's {key!r})" if name else f"the model's {key!r} (no GGUF name)")
    if problems:
        raise CheckpointError(f"{where} does not match the model's shapes: " + "; ".join(problems) + ".")
    if missing:
        raise CheckpointError(f"{where} has no tensor {', '.join(missing[:8])}; it is not this model's file.")
    unexpected = sorted(set(file.tensors) - {n for n in named.values() if n})
    if unexpected and strict:
        raise CheckpointError(
            f"{where} holds tensors the model has no place for: {', '.join(unexpected[:8])}. Pass strict=False to"
            " load the tensors that match."
        )
    return ForeignCheckpoint(file.path, "the GGUF file", model, [], {})


def _architecture_metadata(file: GgufFile, arch: GgufArchitecture) -> dict[str, Any]:
    """The ``<arch>.*`` keys a load uses, checked to be whole numbers in range."""
    found = {k[len(arch.name) + 1:]: v for k, v in file.metadata.items() if k.startswith(arch.name + ".")}
    found.setdefault("attention.head_count_kv", found.get("attention.head_count"))
    for key in ("block_count", "attention.head_count", "attention.head_count_kv"):
        value = found.get(key)
        if not isinstance(value, int) or not 1 <= value <= MAX_BLOCKS:
            raise CheckpointError(f"The GGUF file {file.path}: {arch.name}.{key} is {value!r}, not a count of 1 to"
                                  f" {MAX_BLOCKS}.")
    return found


def _hf_shape(tensor: Any, layout: Layout) -> tuple[int, ...]:
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the innermost dimension first
    return (shape[1], shape[0]) if layout is Layout.TRANSPOSED and len(shape) == 2 else shape


def _torch_dtype(tensor: Any) -> torch.dtype:
    return {"F16": torch.float16, "BF16": torch.bfloat16}.get(tensor.tensor_type.name, torch.float32)


def _row_reader(
    arch: GgufArchitecture, name: str, tensor: Any, layout: Layout, metadata: dict[str, Any]
) -> Callable[[int, int], Tensor]:
    """Reads Hugging Face rows ``[start, stop)`` of ``tensor`` as float32: only the GGUF rows, or the GGUF columns
    (whole blocks of them), that hold them (see [Note: GGUF layouts])."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    data, kind = tensor.data, tensor.tensor_type
    block, size = GGML_QUANT_SIZES[kind]
    packed = data.dtype == np.uint8  # BF16 and Q8_0 come as bytes, rows of whole blocks

    def values(raw: Any) -> Tensor:
        return torch.from_numpy(np.array(dequantize(np.ascontiguousarray(raw), kind), dtype=np.float32))

    if layout is Layout.TRANSPOSED and data.ndim == 2:
        def columns(start: int, stop: int) -> Tensor:
            if not packed:
                return values(data[:, start:stop]).t()
            first, last = start // block, math.ceil(stop / block)
            got = values(data[:, first * size:last * size])
            return got[:, start - first * block:stop - first * block].t()
        return columns
    if layout is Layout.ROTARY_ROWS:
        back = torch.argsort(rotary_row_order(int(data.shape[0]), arch.rotary_heads(name, metadata))).numpy()
        return lambda start, stop: values(data[back[start:stop]])
    return lambda start, stop: values(data[start:stop])


@functools.cache
def _bounded_reader() -> type:
    """``gguf.GGUFReader`` with the bounds of [Note: a GGUF header is untrusted]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

    scalar_sizes = {t: np.dtype(n).itemsize for t, n in GGUFReader.gguf_scalar_to_np.items()}

    class BoundedGGUFReader(GGUFReader):  # type: ignore[misc]
        _values = 0

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if offset < 0 or count < 0 or end > len(self.data):
                raise CheckpointError(f"{self._where}: a read of bytes {offset} to {end} goes past the end of the file"
                                      f" ({len(self.data)} bytes): it is truncated or damaged.")
            return super()._get(offset, dtype, count, override_order)

        def _build_fields(self, offs: int, count: int) -> int:
            if int(count) > min(MAX_METADATA_PAIRS, (len(self.data) - offs) // 13):
                raise CheckpointError(f"{self._where} claims {int(count)} metadata pairs; the file holds at most"
                                      f" {min(MAX_METADATA_PAIRS, (len(self.data) - offs) // 13)}.")
            return int(super()._build_fields(offs, count))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type == GGUFValueType.ARRAY:
                item_type = int(self._get(orig_offs, np.uint32)[0])
                count = int(self._get(orig_offs + 4, np.uint64)[0])
                if item_type == GGUFValueType.ARRAY:
                    raise CheckpointError(f"{self._where} holds an array of arrays, which no model file does.")
                least = scalar_sizes.get(GGUFValueType(item_type), 8) if item_type in _VALUE_TYPES else 8
                self._values += count
                if self._values > MAX_METADATA_VALUES or orig_offs + 12 + count * least > len(self.data):
                    raise CheckpointError(f"{self._where} claims an array of {count} values, beyond the file or the"
                                          f" {MAX_METADATA_VALUES} metadata values any model file holds.")
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensor_info(self, offs: int, count: int) -> Any:
            if int(count) > min(MAX_TENSORS, (len(self.data) - offs) // 24):
                raise CheckpointError(f"{self._where} claims {int(count)} tensors; the file holds at most"
                                      f" {min(MAX_TENSORS, (len(self.data) - offs) // 24)}.")
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            spans = []
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                shape = [int(d) for d in dims]
                if int(raw_type[0]) not in _TENSOR_TYPES:
                    raise CheckpointError(f"{self._where}: tensor {name!r} has the unknown type {int(raw_type[0])}.")
                kind = GGMLQuantizationType(int(raw_type[0]))
                block, size = GGML_QUANT_SIZES[kind]
                if not 1 <= len(shape) <= 4 or min(shape) < 1 or shape[0] % block:
                    raise CheckpointError(f"{self._where}: tensor {name!r} has the shape {shape[::-1]}, which is not"
                                          f" 1 to 4 positive dimensions of whole {kind.name} blocks.")
                start = int(start_offs) + int(offset[0])
                end = start + math.prod(shape) // block * size
                if end > len(self.data):
                    raise CheckpointError(f"{self._where}: the data of tensor {name!r} (bytes {start} to {end}) goes"
                                          f" past the end of the file ({len(self.data)} bytes).")
                spans.append((start, end, name))
            spans.sort()
            for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
                if start < end:
                    raise CheckpointError(f"{self._where}: the data of tensors {first!r} and {second!r} overlap.")
            super()._build_tensors(start_offs, fields)

        def __init__(self, path: Path) -> None:
            self._where = str(path)
            super().__init__(path)

    _VALUE_TYPES = {int(t) for t in GGUFValueType}
    _TENSOR_TYPES = {int(t) for t in GGMLQuantizationType}
    return BoundedGGUFReader
