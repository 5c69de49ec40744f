"""A Hugging Face ``transformers`` Llama (grouped-query attention, rotary embeddings computed once in the model and
passed to every decoder layer, untied LM head; built from a config, no download) trained under ``ShardStrategy``
with its decoder layers as units:

- follows DDP step for step in fp32, every parameter included;
- with a ``peft`` LoRA adapter (frozen base weights sharded next to trainable adapters in the same units) follows
  DDP too, and the frozen weights stay as they were;
- with every decoder layer compiled in ``configure_model`` (``layer.compile()``, as users compile Hugging Face
  models per layer) trains like the eager layers (see [Note: the tolerance of compiled against eager] in
  test_compile.py) and compiles nothing after the second step.

``transformers`` and ``peft`` are test dependencies (the ``[test]`` extra), imported unconditionally: without them
this file fails to collect instead of being skipped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L
import peft
import torch
import transformers
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.compile_fits import graphs_compiled
from tests.fits import full_params_shard, trainer_for
from tests.test_compile import COMPILED_ATOL
from tests.test_parity import assert_same_training

STEPS = 10  # assert_same_training compares at least 10 steps
VOCAB = 97


@dataclass(frozen=True)
class LlamaRun:
    engine: str = "shard"  # or "ddp"
    lora: bool = False  # a peft LoRA adapter on the attention's q and v projections; only it trains
    compiled: bool = False  # every decoder layer compiled in configure_model


def llama_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


class LitLlama(L.LightningModule):
    """Llama language modelling on its own inputs, built in ``configure_model``; records this rank's loss and the
    graphs dynamo has compiled so far at every training step."""

    def __init__(self, run: LlamaRun) -> None:
        super().__init__()
        self.run = run
        self.model: Any = None
        self.losses: list[float] = []
        self.graphs: list[int] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config())
        if self.run.lora:
            lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
            model = peft.get_peft_model(model, lora)
        if self.run.compiled:
            for layer in _decoder_layers(model):
                layer.compile()
        self.model = model

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.graphs.append(graphs_compiled())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, transformers.models.llama.modeling_llama.LlamaDecoderLayer)]


def llama_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8 * STEPS, 17), generator=g)
    return DataLoader(TensorDataset(tokens), batch_size=4, shuffle=False)


def fit_llama(rank: int, world_size: int, run: LlamaRun) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the rank workers outlive a test: count this fit's graphs only
    counters.clear()
    L.seed_everything(0)
    module = LitLlama(run)
    strategy = ShardStrategy(auto_wrap_policy={"LlamaDecoderLayer"}) if run.engine == "shard" else DDPStrategy()
    trainer = trainer_for(strategy, world_size, STEPS)
    trainer.fit(module, train_dataloaders=llama_loader())
    if isinstance(strategy, ShardStrategy):
        params = full_params_shard(strategy)
        units = [unit.name for unit in strategy.engine.units]
    else:
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
        units = []
    trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    return {"losses": module.losses, "graphs": module.graphs, "params": params, "units": units, "trainable": trainable}


def test_llama_shard_matches_ddp() -> None:
    sharded = run_on_ranks(fit_llama, 2, LlamaRun())
    replicated = run_on_ranks(fit_llama, 2, LlamaRun(engine="ddp"))
    assert_same_training(sharded, replicated)
    assert sharded[0]["units"] == ["", "model.model.layers.0", "model.model.layers.1", "model.model.layers.2"]


def test_peft_lora_llama_shard_matches_ddp_and_leaves_the_base_frozen() -> None:
    sharded = run_on_ranks(fit_llama, 2, LlamaRun(lora=True))
    replicated = run_on_ranks(fit_llama, 2, LlamaRun(engine="ddp", lora=True))
    assert_same_training(sharded, replicated)
    trainable = sharded[0]["trainable"]
    assert len(trainable) == 12 and all(".lora_" in name for name in trainable), trainable  # 3 layers x q, v x A, B
    initial = run_on_ranks(fit_llama_untrained, 2, LlamaRun(lora=True))[0]
    for name, value in sharded[0]["params"].items():
        if name not in trainable:
            torch.testing.assert_close(value, initial[name], rtol=0, atol=0, msg=name)
        else:
            assert not torch.equal(value, initial[name]), f"{name} did not train"


def fit_llama_untrained(rank: int, world_size: int, run: LlamaRun) -> dict[str, Tensor]:
    """The LoRA model's parameters as ``configure_model`` builds them (same seed as ``fit_llama``)."""
    module = LitLlama(run)
    module.configure_model()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_llama_decoder_layers_compiled_match_ddp_train_like_eager_and_compile_once() -> None:
    """Compiled layers are compared with the same compiled layers under DDP at the default tolerances (the same
    kernels on the same numbers), and with eager layers at the compile tolerance, on the losses: over a few AdamW
    steps a rounding difference in a near-zero gradient moves a weight by up to the learning
    rate, so the weights of compiled and eager runs are not comparable at 1e-4."""
    eager = run_on_ranks(fit_llama, 2, LlamaRun())
    compiled = run_on_ranks(fit_llama, 2, LlamaRun(compiled=True))
    compiled_ddp = run_on_ranks(fit_llama, 2, LlamaRun(engine="ddp", compiled=True))
    assert_same_training(compiled, compiled_ddp)
    for e, c in zip(eager, compiled):
        assert c["graphs"][0] > 0, c["graphs"]
        assert c["graphs"][1:] == [c["graphs"][1]] * (STEPS - 1), c["graphs"]  # nothing compiled after step 2
        assert e["graphs"] == [0] * STEPS, e["graphs"]
        torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(e["losses"]), rtol=0, atol=COMPILED_ATOL)
