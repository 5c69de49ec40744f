"""Which models ``ShardStrategy(pipeline_parallel_size=2)`` takes: a Hugging Face GPT-2 or Llama (whose decoder
layers take masks and position embeddings the model computes before them) is refused at set-up on both pooled gloo
ranks, naming the block class and what to use instead, before transformers could fail inside its forward; the
project's own models with blocks of the hidden state alone are not (and train: tests/test_pipeline_parallel.py)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.engine.parallel.pipeline import PipelineError
from lightning_shard.engine.parallel.pipeline_support import unsupported_blocks
from lightning_shard.testing import run_on_ranks
from tests.context_parallel_models import Block, CausalLM, token_loader
from tests.fits import trainer_for
from tests.test_context_checks import BLOCKS, MODELS, LitHuggingFace

TAKES = {"gpt2": "past_key_values, attention_mask, encoder_hidden_states, encoder_attention_mask, use_cache",
         "llama": "attention_mask, position_ids, past_key_values, use_cache, position_embeddings"}  # fmt: skip
OWNERS = {"gpt2": "GPT2Model", "llama": "LlamaModel"}


def refused_at_setup(rank: int, world_size: int, kind: str, blocks: Any) -> dict[str, Any]:
    """Fit the Hugging Face model under two stages on every rank; what refused it, and how far it got."""
    L.seed_everything(0)
    module = LitHuggingFace(kind, "positions")
    strategy = ShardStrategy(pipeline_parallel_size=2, **({"auto_wrap_policy": blocks} if blocks else {}))
    trainer = trainer_for(strategy, world_size, 2)
    try:
        trainer.fit(module, train_dataloaders=token_loader(batch=4, samples=8))
    except PipelineError as err:
        return {"error": str(err), "steps": trainer.global_step, "losses": module.losses}
    return {"error": None, "steps": trainer.global_step, "losses": module.losses}


@pytest.mark.parametrize("blocks", [True, False], ids=["auto_wrap_policy", "repeated-blocks"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_model_is_refused_at_setup_on_every_rank(kind: str, blocks: bool) -> None:
    """Whether the blocks are named or found as the model's repeated layers: both ranks raise the same message
    before the first forward, and neither is left waiting."""
    results = run_on_ranks(refused_at_setup, 2, kind, {BLOCKS[kind]} if blocks else None, timeout=120)
    assert [(r["steps"], r["losses"]) for r in results] == [(0, []), (0, [])]
    message = results[0]["error"]
    assert message is not None and message == results[1]["error"]
    assert message.startswith(f"pipeline_parallel_size=2 cannot split {MODELS[kind]} at its {BLOCKS[kind]} blocks:"
                              " Hugging Face models are not supported under pipeline parallelism yet.")  # fmt: skip
    assert f"{BLOCKS[kind]}.forward takes {TAKES[kind]} besides the hidden state, which {OWNERS[kind]}" in message
    assert "context_parallel_size, tensor_parallel_size or data parallelism instead" in message


def test_models_whose_blocks_take_the_hidden_state_alone_are_taken() -> None:
    """The project's own: the causal LM (its blocks and its block stack as plain modules) and a Sequential."""
    assert unsupported_blocks(CausalLM(layers=2), ("blocks.0", "blocks.1"), 2) is None
    stack = torch.nn.Sequential(torch.nn.Embedding(10, 4), *(Block() for _ in range(2)))
    assert unsupported_blocks(stack, ("1", "2"), 2) is None
