"""GGUF as llama.cpp and transformers' GGUF loader read it: the architectures written and read, their metadata from
a Hugging Face ``config.json``, each tensor's GGUF name, and the layout GGUF stores it in (docs/gguf.md).

The names come from the ``gguf`` package's own table (``gguf.get_tensor_name_map``), the one llama.cpp's converter and
transformers' loader use, so a Hugging Face key has exactly the GGUF name both expect. Two layouts differ from the
Hugging Face tensor (see [Note: GGUF layouts]); everything here is pure arithmetic on names and shapes, no file is
touched.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_shard.checkpoint.format import CheckpointError

# [Note: GGUF layouts]
# GGUF keeps most Hugging Face tensors as they are, with two exceptions that llama.cpp's converter makes and
# transformers' GGUF loader undoes:
# - GPT-2's Conv1D weights (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) are stored as (in, out); GGUF stores them
#   as the (out, in) of a linear layer: TRANSPOSED.
# - Llama's q_proj and k_proj rows are reordered within each head, from the halves Hugging Face's rotary embedding
#   rotates (the first half of a head's dimensions against the second) to the interleaved pairs llama.cpp rotates
#   (dimension 2i against 2i + 1): ROTARY_ROWS, with the head count of q (attention.head_count) or of k
#   (attention.head_count_kv). ``rotary_row_order`` gives, for each GGUF row, the Hugging Face row it holds.
# A rank importing its rows [start, stop) of a Hugging Face tensor reads GGUF rows [start, stop) (AS_IS), GGUF columns
# [start, stop) (TRANSPOSED), or the GGUF rows that hold those Hugging Face rows (ROTARY_ROWS): never the whole tensor.


class Layout(enum.Enum):
    """How a GGUF tensor holds the Hugging Face tensor of the same weight (see [Note: GGUF layouts])."""

    AS_IS = "as is"
    TRANSPOSED = "transposed"
    ROTARY_ROWS = "rotary rows"


@dataclass(frozen=True)
class GgufArchitecture:
    """One architecture as GGUF writes it: ``general.architecture``, the ``gguf`` package's enum member for its name
    table, the Hugging Face ``model_type``, and which tensors are stored in another layout."""

    name: str
    model_type: str
    metadata: Callable[[Mapping[str, Any]], dict[str, Any]]  # the "<arch>.*" keys from a config.json, checked
    transposed: tuple[str, ...] = ()  # GGUF names (without .weight) stored TRANSPOSED
    rotary: tuple[str, ...] = ()  # GGUF names (without .weight) stored as ROTARY_ROWS

    def layout(self, gguf_name: str) -> Layout:
        base, _, suffix = gguf_name.rpartition(".")
        kind = base.split(".")[-1]
        if suffix == "weight" and kind in self.transposed:
            return Layout.TRANSPOSED
        if suffix in ("weight", "bias") and kind in self.rotary:
            return Layout.ROTARY_ROWS
        return Layout.AS_IS

    def rotary_heads(self, gguf_name: str, metadata: Mapping[str, Any]) -> int:
        """The head count whose rows ``gguf_name`` (ROTARY_ROWS) reorders: q's heads for attn_q, k's for attn_k.
        ``metadata``: the architecture's keys without the ``"<arch>."`` in front."""
        heads = int(metadata["attention.head_count"])
        if ".attn_k." in gguf_name:
            return int(metadata.get("attention.head_count_kv", heads))
        return heads

    def name_map(self, block_count: int) -> Callable[[str], str | None]:
        """The GGUF name of a Hugging Face key (``transformer.h.0.attn.c_attn.weight``), ``None`` for a key GGUF has
        no name for."""
        import gguf

        gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.name)
        table = gguf.get_tensor_name_map(gguf_arch, block_count)

        def gguf_name(key: str) -> str | None:
            base, dot, suffix = key.rpartition(".")
            if not dot or suffix not in ("weight", "bias"):
                return None
            name = table.get_name(base)
            return None if name is None else f"{name}.{suffix}"

        return gguf_name


def rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """For each row of a ROTARY_ROWS GGUF tensor of ``rows`` rows and ``heads`` heads, the Hugging Face row it holds
    (``gguf = hf[order]``); ``torch.argsort(order)`` goes back (see [Note: GGUF layouts])."""
    if heads < 1 or rows % (2 * heads):
        raise CheckpointError(f"Cannot reorder {rows} rows into {heads} rotary heads of pairs.")
    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)


def transposed(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A 2-D ``shape`` swapped for a TRANSPOSED tensor (see [Note: GGUF layouts]): the Hugging Face tensor's as GGUF
    stores it, and back."""
    return (shape[1], shape[0]) if layout is Layout.TRANSPOSED and len(shape) == 2 else shape


def _required(config: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    raise CheckpointError(f"The model's config.json has no {' or '.join(names)}, which GGUF's metadata needs.")


def _refuse_unless(config: Mapping[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    value = config.get(name, allowed[0])
    if value not in allowed:
        raise CheckpointError(f"The model's config.json has {name}={value!r}; {why}")


def _gpt2_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    _refuse_unless(config, "activation_function", ("gelu_new",),
                   "llama.cpp's GPT-2 computes gelu_new only, so the GGUF model would compute another function.")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        _refuse_unless(config, flag, (False,), "GGUF's GPT-2 has no such variant.")
    _refuse_unless(config, "scale_attn_weights", (True,), "GGUF's GPT-2 scales its attention weights.")
    embd = int(_required(config, "n_embd"))
    return {
        "context_length": int(_required(config, "n_positions")),
        "embedding_length": embd,
        "block_count": int(_required(config, "n_layer")),
        "feed_forward_length": int(config.get("n_inner") or 4 * embd),
        "attention.head_count": int(_required(config, "n_head")),
        "attention.layer_norm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)),
        "vocab_size": int(_required(config, "vocab_size")),
    }


def _llama_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    _refuse_unless(config, "hidden_act", ("silu",), "llama.cpp's Llama computes SiLU only.")
    for flag in ("attention_bias", "mlp_bias"):
        _refuse_unless(config, flag, (False,), "transformers' GGUF loader builds Llama without biases.")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    _refuse_unless(rope, "rope_type", ("default",),
                   "scaled rotary embeddings are not written to GGUF here, so the model would compute differently.")
    hidden, heads = int(_required(config, "hidden_size")), int(_required(config, "num_attention_heads"))
    return {
        "context_length": int(_required(config, "max_position_embeddings")),
        "embedding_length": hidden,
        "block_count": int(_required(config, "num_hidden_layers")),
        "feed_forward_length": int(_required(config, "intermediate_size")),
        "attention.head_count": heads,
        "attention.head_count_kv": int(config.get("num_key_value_heads") or heads),
        "rope.dimension_count": int(config.get("head_dim") or hidden // heads),
        "rope.freq_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "vocab_size": int(_required(config, "vocab_size")),
    }


ARCHITECTURES: dict[str, GgufArchitecture] = {
    "gpt2": GgufArchitecture("gpt2", "gpt2", _gpt2_metadata,
                             transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down")),
    "llama": GgufArchitecture("llama", "llama", _llama_metadata, rotary=("attn_q", "attn_k")),
}


def architecture_of(model_type: Any, where: str) -> GgufArchitecture:
    """The architecture written for a Hugging Face ``model_type`` (``config.json``), or read for a GGUF
    ``general.architecture``; anything else is refused naming the ones there are."""
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise CheckpointError(
            f"{where}: the architecture {model_type!r} is not one GGUF is written or read for here; the architectures"
            f" are {', '.join(sorted(ARCHITECTURES))} (Hugging Face GPT2LMHeadModel and LlamaForCausalLM)."
        )
    return arch
