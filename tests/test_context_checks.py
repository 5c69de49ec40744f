"""What ``ShardStrategy(context_parallel_size=2)`` refuses before the first optimizer step, on pooled gloo ranks: a
step whose model would number positions from its own part of the sequence (a Hugging Face GPT-2 or Llama called
without ``position_ids``, an embedding looked up at ``torch.arange`` of the part's length) or shift labels within
it (a Hugging Face model called with ``labels=``). Each refusal comes on both ranks, in the first step, naming the
module, and no rank is left waiting; the supported form (``position_ids`` from the batch, the loss computed in
``training_step``) trains as DDP (Llama: tests/test_context_parallel.py; GPT-2 here)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from lightning_shard import ShardStrategy
from lightning_shard.engine.parallel import ContextParallelError
from lightning_shard.testing import run_on_ranks
from tests.context_parallel_models import DIM, HEADS, SEQ, VOCAB, Block, CausalLM, LitCausalLM, token_loader
from tests.fits import trainer_for
from tests.test_context_parallel_engine import _whole
from tests.test_parity import assert_same_training

BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}
MODELS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


def hugging_face_model(kind: str) -> transformers.PreTrainedModel:
    """A tiny GPT-2 (learned positions, tied head) or Llama (rotary positions) with SDPA attention and no dropout,
    built from a config: nothing is downloaded."""
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=DIM, n_layer=2, n_head=HEADS, n_positions=4 * SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=4 * SEQ, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class LitHuggingFace(LitCausalLM):
    """A Hugging Face model as ``self.net``, called in ``training_step`` as ``call`` says: ``"tokens"``, on the
    tokens alone, the loss by ``F.cross_entropy`` on its logits; ``"labels"``, with the batch's ``position_ids``
    and a mask of ones, its own loss from ``labels=``; ``"positions"``, with the batch's ``position_ids`` and a mask
    of ones, the loss by ``F.cross_entropy`` (the supported form)."""

    def __init__(self, kind: str = "llama", call: str = "positions") -> None:
        super().__init__()
        self.kind, self.call = kind, call

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = hugging_face_model(self.kind)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, position_ids = batch
        if self.call == "tokens":
            loss = F.cross_entropy(self.net(input_ids=x).logits.flatten(0, 1), y.flatten())
        elif self.call == "labels":
            loss = self.net(input_ids=x, position_ids=position_ids, attention_mask=torch.ones_like(x), labels=x).loss
        else:
            logits = self.net(input_ids=x, position_ids=position_ids, attention_mask=torch.ones_like(x)).logits
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("loss", loss)
        self.losses.append(loss.item())
        return loss


class LocallyNumberedLM(CausalLM):
    """The causal LM numbering its positions from the length it sees, as nanoGPT does: the batch's position ids
    are ignored."""

    def forward(self, idx: Tensor, position_ids: Tensor) -> Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        return self.head(self.norm(self.blocks(self.wte(idx) + self.wpe(positions))))


class LitLocallyNumbered(LitCausalLM):
    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = LocallyNumberedLM()


def refused(rank: int, world_size: int, module: L.LightningModule, unit: Any) -> dict[str, Any]:
    """Fit ``module`` for 2 steps under context parallelism on every rank; what refused it, and how far it got."""
    L.seed_everything(0)
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={unit}, context_parallel_size=world_size), world_size, 2)
    try:
        trainer.fit(module, train_dataloaders=token_loader(samples=8))
    except ContextParallelError as err:
        return {"error": str(err), "steps": trainer.global_step, "losses": module.losses}
    return {"error": None, "steps": trainer.global_step, "losses": module.losses}


def assert_refused_on_every_rank(results: list[dict[str, Any]], *phrases: str) -> None:
    """Every rank raised (none was left waiting: ``run_on_ranks`` names a silent rank), in the first step's
    forward, before a loss or an optimizer step, with the same message containing each phrase."""
    assert [r["steps"] for r in results] == [0, 0] and [r["losses"] for r in results] == [[], []]
    assert results[0]["error"] is not None and results[0]["error"] == results[1]["error"]
    for phrase in phrases:
        assert phrase in results[0]["error"], results[0]["error"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_model_called_without_position_ids_is_refused(kind: str) -> None:
    """GPT-2 would look its learned positions up at 0..n-1 of each rank's part, Llama rotate by them."""
    results = run_on_ranks(refused, 2, LitHuggingFace(kind, "tokens"), BLOCKS[kind], timeout=120)
    assert_refused_on_every_rank(results, f"{MODELS[kind]} (net) was called without position_ids under"
                                          " context_parallel_size=2", "position_ids=position_ids")  # fmt: skip


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_hugging_face_model_called_with_labels_is_refused(kind: str) -> None:
    """The model's own loss would shift the labels within each rank's part, with every position right."""
    results = run_on_ranks(refused, 2, LitHuggingFace(kind, "labels"), BLOCKS[kind], timeout=120)
    assert_refused_on_every_rank(results, f"{MODELS[kind]} (net) was called with labels=", "targets = tokens[:, 1:]",
                                 "F.cross_entropy")  # fmt: skip


def test_an_embedding_looked_up_at_positions_numbered_from_the_part_is_refused() -> None:
    results = run_on_ranks(refused, 2, LitLocallyNumbered(), Block, timeout=120)
    assert_refused_on_every_rank(results, "The embedding model.wpe (Embedding of 64 x 32) was looked up at"
                                          " positions 0..7", "look model.wpe up at them")  # fmt: skip


def fabric_labels(rank: int, world_size: int) -> str:
    """The set-up module is the Hugging Face model itself, called with ``labels=``: what refused it."""
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    strategy = FabricShardStrategy(auto_wrap_policy={"GPT2Block"}, context_parallel_size=2)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    module = fabric.setup_module(hugging_face_model("gpt2"))
    (x, _, position_ids), = token_loader(samples=2)
    with pytest.raises(ContextParallelError) as refusal:
        module(input_ids=x, position_ids=position_ids, attention_mask=torch.ones_like(x), labels=x)
    return str(refusal.value)


def test_fabric_refuses_a_set_up_hugging_face_model_called_with_labels() -> None:
    messages = run_on_ranks(fabric_labels, 2, timeout=120)
    assert messages[0] == messages[1] and messages[0].startswith("GPT2LMHeadModel was called with labels=")


def gpt2_fit(rank: int, world_size: int, engine: str) -> dict[str, Any]:
    L.seed_everything(0)
    module = LitHuggingFace("gpt2", "positions")
    strategy = DDPStrategy() if engine == "ddp" else ShardStrategy(auto_wrap_policy={"GPT2Block"},
                                                                   context_parallel_size=2)  # fmt: skip
    trainer_for(strategy, world_size, 10).fit(module, train_dataloaders=token_loader())
    params = {n: p.detach().clone() for n, p in module.named_parameters()} if engine == "ddp" else _whole(module)
    return {"losses": module.losses, "params": params}


def test_gpt2_given_position_ids_and_a_loss_in_the_step_trains_as_ddp() -> None:
    """The supported form: its learned positions looked up at the batch's position ids, which no check mistakes for
    positions numbered from the part."""
    assert_same_training(run_on_ranks(gpt2_fit, 2, "shard"), run_on_ranks(gpt2_fit, 1, "ddp") * 2)
