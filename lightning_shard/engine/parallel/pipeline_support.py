"""Which models pipeline stages can run: what ``Pipeline.install`` refuses before it prunes anything.

The stages pass only the hidden state from block to block (see [Note: the user's forward runs on every stage] in
``pipeline.py``). A Hugging Face model does not fit that rule: its forward computes the attention mask and the
rotary position embeddings before its decoder layers and passes them to every layer (Llama's ``LlamaDecoderLayer``
takes ``attention_mask``, ``position_ids``, ``position_embeddings``), and works on the output of modules another
stage holds (GPT-2 reshapes what its final norm ``ln_f`` returns). On a stage without those modules (Llama's
``rotary_emb``, GPT-2's ``ln_f``) their output is the placeholder's 0-d zero, and transformers fails inside its
forward on that stage only, while the next stage waits for it. So a model whose blocks are Hugging Face's, or sit
inside a Hugging Face model, is refused at set-up, before anything is pruned, on every rank alike (each decides from
the same module tree), naming the block class.
"""

from __future__ import annotations

import inspect

from torch import nn

from lightning_shard.engine.parallel.hugging_face import is_hugging_face_class, pretrained_model_class


def unsupported_blocks(root: nn.Module, blocks: tuple[str, ...], stages: int) -> str | None:
    """Why ``root`` cannot be split into ``stages`` stages at ``blocks`` (qualified names in it), or ``None``: the
    message names the block class, the Hugging Face model holding it and what to do instead."""
    pretrained = pretrained_model_class()
    for name in blocks:
        block = root.get_submodule(name)
        parts = name.split(".")
        ancestors = [root.get_submodule(".".join(parts[:i])) for i in range(len(parts))]  # root first
        owners = [m for m in ancestors if pretrained is not None and isinstance(m, pretrained)]
        if owners or is_hugging_face_class(type(block)):
            owner = owners[-1] if owners else root
            return _message(type(root).__name__, type(owner).__name__, block, stages)
    return None


def _message(root: str, owner: str, block: nn.Module, stages: int) -> str:
    cls = type(block).__name__
    takes = [p.name for p in list(inspect.signature(block.forward).parameters.values())[1:]
             if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]  # fmt: skip
    extra = ", ".join(takes) if takes else "keyword arguments"
    return (
        f"pipeline_parallel_size={stages} cannot split {root} at its {cls} blocks: Hugging Face models are not"
        f" supported under pipeline parallelism yet. {cls}.forward takes {extra} besides the hidden state, which"
        f" {owner} computes before its layers (the attention mask, the position embeddings), but pipeline stages"
        " pass only the hidden state from block to block. Train it with context_parallel_size, tensor_parallel_size"
        " or data parallelism instead (pipeline_parallel_size=1); pipeline parallelism takes models whose blocks"
        " take and return the hidden state alone (see docs/pipeline_parallel.md)."
    )
