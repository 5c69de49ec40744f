"""Export a checkpoint's model as one GGUF v3 file (``lightning-shard export CKPT OUT.gguf --format gguf``), the
format llama.cpp, ollama, LM Studio and transformers' GGUF loader run (docs/gguf.md).

The file is written with the ``gguf`` package's ``GGUFWriter``: the metadata and the tensor table first (planned from
the checkpoint's index, no tensor read), then the data one full tensor at a time, each assembled from the checkpoint's
pieces (checked as it is read), put in GGUF's layout ([Note: GGUF layouts]), cast or quantised, written and dropped.
Memory stays bounded by the largest tensor (and its copy in the output type). The file is written beside the output
and renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_shard.checkpoint.format import CheckpointError, read_json_object, submodule_prefix
from lightning_shard.checkpoint.format.gguf import GgufArchitecture, Layout, architecture_of, rotary_row_order
from lightning_shard.checkpoint.io.averaged import Weights, weights_prefix
from lightning_shard.checkpoint.io.file_modes import give_default_modes
from lightning_shard.checkpoint.io.index import LEFT_OUT, iter_index_tensors, read_index
from lightning_shard.checkpoint.io.layout import StoredTensor, require_complete
from lightning_shard.checkpoint.io.reader import FileHandles, read_tensor
from lightning_shard.checkpoint.io.storage import local_only
from lightning_shard.checkpoint.tools.export import temporary_directory_beside

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")  # what --dtype takes for --format gguf
_ALIASES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # export_hf's spellings are taken too
_Q8_0_BLOCK = 32  # values per Q8_0 block: a row of another length is written as f16
_NOT_BYTES = np.dtype("float32")  # what add_tensor_info is told a tensor holds: not uint8, so the shape given is kept


@dataclass(frozen=True)
class GgufExport:
    """What ``export_gguf`` wrote: the file, its architecture, and each tensor's GGUF name and type."""

    output: Path
    architecture: str
    tensors: dict[str, str]  # GGUF name -> GGML type name (F32, F16, BF16, Q8_0)
    skipped: list[str]  # model keys without the prefix: not exported
    vocabulary: int  # tokens written (0 without a tokenizer)


def export_gguf(
    checkpoint: str | Path,
    output: str | Path,
    config: str | Path,
    prefix: str = "",
    dtype: str | None = None,
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
    weights: Weights = "current",
) -> GgufExport:
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

    directory = local_only(checkpoint, "export_gguf()")
    out = Path(output)
    kind = _ggml_type(dtype)
    if out.is_dir():
        raise CheckpointError(f"The GGUF export's path {out} is a directory: give a file name (OUT.gguf).")
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} exists: pass overwrite=True (--overwrite) to replace it.")
    hf_config = read_json_object(Path(config), "Export config file")
    arch = architecture_of(hf_config.get("model_type"), f"The config {config}")
    metadata = arch.metadata(hf_config)
    entries, skipped = _entries(directory, submodule_prefix(prefix), weights)
    names = _gguf_names(arch, entries, metadata["block_count"], directory)
    shapes = {names[key]: _gguf_shape(arch.layout(names[key]), entry.shape) for key, entry in entries.items()}
    planned = {names[key]: (entry, _output_type(kind, shapes[names[key]])) for key, entry in entries.items()}

    staging = temporary_directory_beside(out)
    tmp = staging / out.name
    writer = gguf.GGUFWriter(tmp, arch.name)
    try:
        _add_metadata(writer, arch, metadata, kind, hf_config)
        vocabulary = _add_tokenizer(writer, arch, tokenizer, metadata["vocab_size"]) if tokenizer else 0
        if not tokenizer:
            writer.add_tokenizer_model("none")  # llama.cpp's word for a file without a vocabulary
        for name, (entry, ggml) in planned.items():
            nbytes = _nbytes(entry.shape, ggml)
            writer.add_tensor_info(name, shapes[name], _NOT_BYTES, nbytes, ggml)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with FileHandles() as handles:
            for name, (entry, ggml) in planned.items():  # in the order of the tensor table
                full = _in_gguf_layout(arch, name, read_tensor(entry, handles), metadata)
                writer.write_tensor_data(_encoded(full, ggml))
                del full
        writer.close()
        give_default_modes(staging)
        tmp.replace(out)
    finally:
        writer.close()
        shutil.rmtree(staging, ignore_errors=True)
    return GgufExport(out, arch.name, {n: g.name for n, (_, g) in planned.items()}, skipped, vocabulary)


def _entries(directory: Path, prefix: str, weights: Weights) -> tuple[dict[str, StoredTensor], list[str]]:
    """The checkpoint's model tensors under ``prefix`` (the prefix stripped), and the keys left out."""
    index = read_index(directory)
    if index.get(LEFT_OUT):
        raise CheckpointError(
            f"{directory} holds only part of the model (saved with save_trainable_only=True or a filter), so it is"
            " not a whole model to export as GGUF."
        )
    require_complete(directory, index["tensors"])
    entries, skipped = {}, []
    for key, entry in iter_index_tensors(index, weights_prefix(index, weights, directory)):
        if key.startswith(prefix):
            entries[key[len(prefix):]] = entry
        else:
            skipped.append(key)
    if not entries:
        raise CheckpointError(f"No model key of {directory} starts with the export prefix {prefix!r}.")
    return entries, skipped


def _gguf_names(
    arch: GgufArchitecture, entries: dict[str, StoredTensor], blocks: int, directory: Path
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


def _gguf_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[1], shape[0]) if layout is Layout.TRANSPOSED else shape


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


def _add_tokenizer(writer: Any, arch: GgufArchitecture, tokenizer: str | Path, rows: int) -> int:
    """Write the ``tokenizer.ggml.*`` keys of the Hugging Face tokenizer directory ``tokenizer`` (read with the
    ``gguf`` package's vocabulary readers); a vocabulary shorter than the embedding's ``rows`` is padded with unused
    tokens, as llama.cpp's converter pads it. Returns the tokens written."""
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
    return rows
