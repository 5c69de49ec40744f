"""GGUF, the format llama.cpp, ollama, LM Studio and transformers' GGUF loader run (docs/gguf.md): a GPT-2 or Llama
GGUF file read into a sharded model, each rank reading only its rows (``load_gguf_into``), and a checkpoint's model
written as one GGUF v3 file (``export_gguf``; ``lightning-shard export CKPT OUT.gguf --format gguf``). The
architectures, their names and layouts are in ``architectures``.

A file is parsed by the ``gguf`` package's ``GGUFReader``, run here with bounds on its walk
([Note: a GGUF header is untrusted]), and described as a ``ForeignCheckpoint`` under the model's own keys, each tensor
read a few Hugging Face rows at a time and dequantised, so the loader of the other foreign formats fills the sharded
model with the same checks and the same agreement between ranks. A file is written with ``GGUFWriter``: the metadata
and the tensor table first (planned from the checkpoint's index, no tensor read), then the data one full tensor at a
time, each put in GGUF's layout, cast or quantised, written and dropped, so memory stays bounded by the largest tensor
(and its copy in the output type).
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

from lightning_shard.checkpoint.format import CheckpointError, read_json_object, submodule_prefix
from lightning_shard.checkpoint.interop import GGUF_DTYPES
from lightning_shard.checkpoint.interop.export import (
    ExportResult,
    export_source,
    model_entries,
    require_whole_model,
    skipped_note,
    staged,
)
from lightning_shard.checkpoint.interop.foreign import ForeignCheckpoint, ForeignTensor, load_foreign_model
from lightning_shard.checkpoint.interop.gguf.architectures import (
    GgufArchitecture,
    Layout,
    architecture_of,
    rotary_row_order,
    transposed,
)
from lightning_shard.checkpoint.io.agreement import agree
from lightning_shard.checkpoint.io.averaged import Weights
from lightning_shard.checkpoint.io.layout import StoredTensor
from lightning_shard.checkpoint.io.reader import FileHandles, read_tensor
from lightning_shard.checkpoint.io.storage import Location, local_only
from lightning_shard.checkpoint.load.directory import LoadResult, sharded_engine
from lightning_shard.engine.sharded_module import ShardedModule

GGUF_MAGIC = b"GGUF"
MAX_METADATA_PAIRS = 2**16  # real files hold tens
MAX_TENSORS = 2**20  # the largest published models hold a few thousand
MAX_METADATA_VALUES = 2**21  # array elements in all: a 256k vocabulary with scores, types and merges fits
MAX_BLOCKS = 4096
READ_TYPES = ("F32", "F16", "BF16", "Q8_0")  # the tensor types dequantised here
_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # export_hf's spellings are taken too
_Q8_0_BLOCK = 32  # values per Q8_0 block: a row of another length is written as f16
_NOT_BYTES = np.dtype("float32")  # what add_tensor_info is told a tensor holds: not uint8, so the shape given is kept

# --------------------------------------------------------------------------------------------------
# A GGUF file in
# --------------------------------------------------------------------------------------------------

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
    engine = sharded_engine(module, "load_gguf_into()")
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
            shape = transposed(layout, tuple(int(d) for d in reversed(tensor.shape.tolist())))  # GGUF: inner first
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


# --------------------------------------------------------------------------------------------------
# A checkpoint out as a GGUF file
# --------------------------------------------------------------------------------------------------


def export_gguf(
    checkpoint: str | Path,
    output: str | Path,
    config: str | Path,
    prefix: str = "",
    dtype: str | None = None,
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
    weights: Weights = "current",
) -> ExportResult:
    """Write the model of ``checkpoint`` as the GGUF v3 file ``output``, for llama.cpp and
    ``AutoModelForCausalLM.from_pretrained(directory, gguf_file=...)``.

    ``config`` is the model's Hugging Face ``config.json``: its ``model_type`` picks the architecture (``gpt2`` or
    ``llama``) and its values become the GGUF metadata. ``prefix`` is stripped from the LightningModule's keys as
    for ``export_hf``; the keys left must be the Hugging Face model's. ``dtype``: ``"f32"`` (default, exact),
    ``"f16"``, ``"bf16"`` or ``"q8_0"`` for the 2-D weights; 1-D tensors (norms, biases) stay f32, as llama.cpp writes
    them, and a q8_0 tensor whose rows are not a multiple of 32 values is written f16. ``tokenizer``: a Hugging Face
    tokenizer directory (``tokenizer.json``) whose vocabulary, merges and special tokens go into the
    ``tokenizer.ggml.*`` keys; without one the file says it has no vocabulary (``tokenizer.ggml.model = "none"``).
    An existing ``output`` is replaced only with ``overwrite``."""
    import gguf

    directory, out, index = export_source(checkpoint, output, overwrite, "export_gguf()", file=True)
    kind = _ggml_type(dtype)
    hf_config = read_json_object(Path(config), "Export config file")
    arch = architecture_of(hf_config.get("model_type"), f"The config {config}")
    metadata = arch.metadata(hf_config)
    require_whole_model(directory, index)
    prefix = submodule_prefix(prefix)
    entries, skipped = model_entries(directory, index, prefix, weights)
    names = _gguf_names(arch, entries, metadata["block_count"], directory)
    shapes = {names[key]: transposed(arch.layout(names[key]), entry.shape) for key, entry in entries.items()}
    planned = {names[key]: (entry, _output_type(kind, shapes[names[key]])) for key, entry in entries.items()}
    with staged(out, file=True) as tmp:
        writer = gguf.GGUFWriter(tmp, arch.name)
        try:
            _add_metadata(writer, arch, metadata, kind, hf_config)
            if tokenizer:
                _add_tokenizer(writer, arch, tokenizer, metadata["vocab_size"])
            else:
                writer.add_tokenizer_model("none")  # llama.cpp's word for a file without a vocabulary
            for name, (entry, ggml) in planned.items():
                writer.add_tensor_info(name, shapes[name], _NOT_BYTES, _nbytes(entry.shape, ggml), ggml)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            with FileHandles() as handles:
                for name, (entry, ggml) in planned.items():  # in the order of the tensor table
                    full = _in_gguf_layout(arch, name, read_tensor(entry, handles), metadata)
                    writer.write_tensor_data(_encoded(full, ggml))
                    del full
        finally:
            writer.close()
    return ExportResult(out, [out.name], {n: g.name for n, (_, g) in planned.items()},
                        sum(_nbytes(entry.shape, ggml) for entry, ggml in planned.values()),
                        f"{len(planned)} {arch.name} tensors", skipped, notes=skipped_note(skipped, prefix))


def _gguf_names(
    arch: GgufArchitecture, entries: dict[str, StoredTensor], blocks: int, directory: Location
) -> dict[str, str]:
    """The GGUF name of every exported key; a key GGUF has no name for is refused, naming it."""
    name_of = arch.name_map(blocks)
    names = {key: name_of(key) for key in entries}
    unnamed = [key for key, name in names.items() if name is None]
    if unnamed:
        raise CheckpointError(
            f"{directory}: {len(unnamed)} tensors have no GGUF {arch.name} name ({', '.join(unnamed[:8])}): the keys"
            f" after the prefix must be a Hugging Face {arch.model_type} model's (is --prefix right?)."
        )
    return names  # type: ignore[return-value]


def _ggml_type(dtype: str | None) -> Any:
    from gguf import GGMLQuantizationType as Q

    name = _ALIASES.get(dtype, dtype) if dtype is not None else "f32"
    if name not in GGUF_DTYPES:
        raise ValueError(f"Unknown GGUF export dtype {dtype!r}; choose one of {', '.join(GGUF_DTYPES)}.")
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[name]


def _output_type(kind: Any, shape: tuple[int, ...]) -> Any:
    """The GGML type a tensor of ``shape`` (as GGUF stores it: its rows are the last dimension) is written in, for the
    export type ``kind`` (see ``export_gguf``)."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) < 2:
        return Q.F32
    if kind is Q.Q8_0 and shape[-1] % _Q8_0_BLOCK:
        return Q.F16
    return kind


def _nbytes(shape: tuple[int, ...], ggml: Any) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[ggml]
    return math.prod(shape) // block * size


def _in_gguf_layout(arch: GgufArchitecture, name: str, tensor: torch.Tensor, metadata: dict[str, Any]) -> torch.Tensor:
    """``tensor`` (a full Hugging Face tensor) as GGUF stores the weight ``name``, in float32."""
    tensor = tensor.float()
    layout = arch.layout(name)
    if layout is Layout.TRANSPOSED:
        return tensor.t().contiguous()
    if layout is Layout.ROTARY_ROWS:
        heads = arch.rotary_heads(name, metadata)
        return tensor[rotary_row_order(tensor.shape[0], heads)].contiguous()
    return tensor.contiguous()


def _encoded(tensor: torch.Tensor, ggml: Any) -> Any:
    """The bytes (or values) of a float32 tensor in the GGML type ``ggml``, as a numpy array."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if ggml is Q.F32:
        return tensor.numpy()
    if ggml is Q.F16:
        return tensor.to(torch.float16).numpy()
    if ggml is Q.BF16:
        return tensor.to(torch.bfloat16).view(torch.uint16).numpy().view("uint8")
    return quantize(tensor.numpy(), ggml)


def _add_metadata(writer: Any, arch: GgufArchitecture, metadata: dict[str, Any], kind: Any, config: dict[str, Any]
                  ) -> None:
    from gguf import GGML_QUANT_VERSION, LlamaFileType
    from gguf import GGMLQuantizationType as Q

    for key, value in metadata.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch.name}.{key}", value)
        else:
            writer.add_uint32(f"{arch.name}.{key}", value)
    file_type = {Q.F32: LlamaFileType.ALL_F32, Q.F16: LlamaFileType.MOSTLY_F16, Q.BF16: LlamaFileType.MOSTLY_BF16,
                 Q.Q8_0: LlamaFileType.MOSTLY_Q8_0}[kind]
    writer.add_file_type(int(file_type))
    if kind is Q.Q8_0:
        writer.add_quantization_version(GGML_QUANT_VERSION)
    name = config.get("_name_or_path")
    if isinstance(name, str) and name:
        writer.add_name(Path(name).name)


def _add_tokenizer(writer: Any, arch: GgufArchitecture, tokenizer: str | Path, rows: int) -> None:
    """Write the ``tokenizer.ggml.*`` keys of the Hugging Face tokenizer directory ``tokenizer`` (read with the
    ``gguf`` package's vocabulary readers); a vocabulary shorter than the embedding's ``rows`` is padded with unused
    tokens, as llama.cpp's converter pads it."""
    from gguf import TokenType
    from gguf.vocab import BpeVocab, LlamaHfVocab, SpecialVocab

    path = Path(tokenizer)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"The tokenizer directory {path} has no tokenizer.json.")
    tokenizer_json = read_json_object(path / "tokenizer.json", "The tokenizer file")
    model = tokenizer_json.get("model")
    byte_fallback = isinstance(model, dict) and model.get("byte_fallback", False)
    try:
        vocab = LlamaHfVocab(path) if byte_fallback else BpeVocab(path)
        tokens, scores, types = zip(*vocab.all_tokens())
    except (OSError, ValueError, KeyError, TypeError, FileNotFoundError) as err:
        raise CheckpointError(f"Cannot read the tokenizer in {path} ({type(err).__name__}: {err}).") from None
    if len(tokens) > rows:
        raise CheckpointError(f"The tokenizer in {path} has {len(tokens)} tokens; the model's embedding {rows} rows.")
    padding = rows - len(tokens)
    tokens += tuple(f"[PAD{i}]".encode() for i in range(len(tokens), rows))
    scores += (-1000.0,) * padding
    types += (TokenType.UNUSED,) * padding
    writer.add_tokenizer_model(vocab.tokenizer_model)
    if vocab.tokenizer_model == "gpt2":
        writer.add_tokenizer_pre("gpt-2" if arch.name == "gpt2" else "default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores(list(scores))
    writer.add_token_types(list(types))
    SpecialVocab(path, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=rows).add_to_gguf(writer, quiet=True)
