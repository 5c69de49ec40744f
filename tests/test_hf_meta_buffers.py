"""The fine-tuning guide's flow (docs/finetuning.md) for every Hugging Face family it names: the model is built with
``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` in ``configure_model``,
``ShardStrategy(param_init="empty")`` shards it on 2 ranks, and ``load_safetensors_into`` fills its weights in
``on_fit_start`` from a ``save_pretrained`` directory of the same model built on CPU (fixed seed). For GPT-2, Llama,
Qwen2, Mistral, Gemma, Phi-3 and Mixtral:

- the buffers no checkpoint holds (rotary ``inv_freq`` and ``original_inv_freq``, Gemma's ``embed_scale``) equal the
  CPU-built model's bit for bit, given by transformers' own ``_init_weights`` (see [Note: buffers transformers
  initialises] in lightning_shard/engine/transformers_buffers.py);
- training follows DDP on the CPU-built model step for step (losses and weights at ``assert_close`` defaults).

``load_from_checkpoint`` of the guide's checkpoint (its step 4, one process, the meta build again) gives the same
buffers and the fine-tuned logits. Then the same bit-for-bit buffers for the RoPE variants transformers computes
differently (scaled, dynamic, YaRN, Llama 3, Phi-3's long RoPE) and for GPT-Neo's causal-mask buffers; and a meta
buffer no rule gives values to is refused by name, at set-up and by ``load_from_checkpoint``.

``transformers`` is a test dependency (the ``[test]`` extra), imported unconditionally."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy, load_from_checkpoint, load_safetensors_into
from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.testing import run_on_ranks
from tests.fits import full_params_shard, trainer_for
from tests.test_parity import assert_same_training

STEPS = 10  # assert_same_training compares at least 10 steps
VOCAB = 64
SEED = 0  # the pretrained model's, built on CPU
PROBE = torch.arange(24).reshape(2, 12) % VOCAB  # the inputs logits are compared on
# The sizes every family's tiny config shares; token ids inside the vocabulary, so that transformers does not warn.
_SIZES: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                              bos_token_id=1, eos_token_id=2)  # fmt: skip

# family -> (its tiny config, its decoder block: the sharding unit)
FAMILIES: dict[str, tuple[Callable[[], Any], str]] = {
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                             eos_token_id=2), "GPT2Block"),  # fmt: skip
    "llama": (lambda: transformers.LlamaConfig(**_SIZES), "LlamaDecoderLayer"),
    "qwen2": (lambda: transformers.Qwen2Config(**_SIZES), "Qwen2DecoderLayer"),
    "mistral": (lambda: transformers.MistralConfig(**_SIZES), "MistralDecoderLayer"),
    "gemma": (lambda: transformers.GemmaConfig(**_SIZES, head_dim=8, pad_token_id=0), "GemmaDecoderLayer"),
    "phi3": (lambda: transformers.Phi3Config(**_SIZES, pad_token_id=0), "Phi3DecoderLayer"),
    "mixtral": (lambda: transformers.MixtralConfig(**_SIZES, num_local_experts=4, num_experts_per_tok=2),
                "MixtralDecoderLayer"),
}


def build_on_cpu(config: Any) -> Any:
    """The pretrained model: built on CPU from ``config`` with the fixed seed (its buffers are the reference)."""
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``save_pretrained`` directory per family, of the model ``build_on_cpu`` gives (several files, an index).
    Mixtral's in the layout its module holds (experts fused), not the per-expert one transformers converts when it
    loads: ``load_safetensors_into`` converts nothing (see docs/finetuning.md)."""
    root = tmp_path_factory.mktemp("pretrained")
    for family, (config, _) in FAMILIES.items():
        build_on_cpu(config()).save_pretrained(root / family, max_shard_size="40KB",
                                               save_original_format=family != "mixtral")  # fmt: skip
    return root


class FineTune(L.LightningModule):
    """The guide's ``LightningModule``: ``on_meta`` builds the network on the meta device and loads ``pretrained``
    when fit starts (the sharded run); otherwise it is the pretrained model built on CPU (the DDP reference).
    Records this rank's loss at every step and the network's buffers as training starts."""

    def __init__(self, pretrained: str, on_meta: bool) -> None:
        super().__init__()
        self.pretrained, self.on_meta = pretrained, on_meta
        self.model: nn.Module | None = None
        self.losses: list[float] = []
        self.buffers_at_start: dict[str, Tensor] = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        config = transformers.AutoConfig.from_pretrained(self.pretrained)
        if self.on_meta:
            with torch.device("meta"):
                self.model = transformers.AutoModelForCausalLM.from_config(config)
        else:
            self.model = build_on_cpu(config)

    def on_fit_start(self) -> None:
        if self.on_meta:
            load_safetensors_into(self, self.pretrained, prefix="model.")
        assert self.model is not None
        self.buffers_at_start = {n: b.detach().clone() for n, b in self.model.named_buffers()}

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        assert self.model is not None
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def logits(self) -> Tensor:
        assert self.model is not None
        with torch.no_grad():
            return self.model(input_ids=PROBE).logits.detach().clone()


class Mask(nn.Module):
    """A module of the user's own with a causal mask and no ``reset_parameters()``: built on the meta device, nothing
    gives the mask values (transformers' ``_init_weights`` knows nothing of it)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(n, n, dtype=torch.bool).tril(), persistent=False)


def fine_tune(rank: int, world_size: int, pretrained: str, block: str, on_meta: bool) -> dict[str, Any]:
    L.seed_everything(0)
    module = FineTune(pretrained, on_meta)
    strategy = ShardStrategy(auto_wrap_policy={block}, param_init="empty") if on_meta else DDPStrategy()
    tokens = torch.randint(0, VOCAB, (8 * STEPS, 16), generator=torch.Generator().manual_seed(1))
    trainer_for(strategy, world_size, STEPS).fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    if isinstance(strategy, ShardStrategy):
        params = full_params_shard(strategy)
    else:
        assert module.model is not None
        params = {f"model.{n}": p.detach().clone() for n, p in module.model.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": params, "buffers": module.buffers_at_start}


def assert_same_bits(ours: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """The same names, and for each the same dtype, shape and bytes."""
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert (ours[name].dtype, ours[name].shape) == (value.dtype, value.shape), name
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), (
            f"{name}: {ours[name]} != {value}"
        )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_guides_flow_gives_the_cpu_built_buffers_and_trains_as_ddp(pretrained: Path, family: str) -> None:
    block = FAMILIES[family][1]
    sharded = run_on_ranks(fine_tune, 2, str(pretrained / family), block, True)
    replicated = run_on_ranks(fine_tune, 2, str(pretrained / family), block, False)
    expected = dict(build_on_cpu(FAMILIES[family][0]()).named_buffers())
    if family != "gpt2":  # GPT-2 has no buffers; every other family has its rotary table, Gemma its scale too
        assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= expected.keys()
    for rank in range(2):
        assert_same_bits(sharded[rank]["buffers"], expected)
        assert_same_bits(replicated[rank]["buffers"], expected)
    assert_same_training(sharded, replicated)


def fine_tune_and_save(rank: int, world_size: int, pretrained: str, block: str, ckpt_dir: str) -> Tensor:
    """The guide's fit, with its ``ModelCheckpoint``; the fine-tuned model's logits."""
    L.seed_everything(0)
    module = FineTune(pretrained, on_meta=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=ShardStrategy(auto_wrap_policy={block}, param_init="empty"),
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)],
    )
    tokens = torch.randint(0, VOCAB, (16, 16), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    return module.logits()


@pytest.fixture(scope="module")
def fine_tuned(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Tensor]]:
    """For Llama and Gemma: the guide's checkpoint directory after its fit, and the fine-tuned logits."""
    runs = {}
    for family in ("llama", "gemma"):
        directory = tmp_path_factory.mktemp(f"checkpoints-{family}")
        logits = run_on_ranks(fine_tune_and_save, 2, str(pretrained / family), FAMILIES[family][1], str(directory))
        runs[family] = (directory, logits[0])
    return runs


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_load_from_checkpoint_gives_the_cpu_built_buffers_and_the_fine_tuned_logits(
    pretrained: Path, fine_tuned: dict[str, tuple[Path, Tensor]], family: str
) -> None:
    """The guide's step 4: ``load_from_checkpoint`` in one process runs ``configure_model()`` (the meta build again);
    the buffers no checkpoint holds get the CPU-built model's values there too."""
    directory, logits = fine_tuned[family]
    module = load_from_checkpoint(FineTune, directory / "last.ckpt", pretrained=str(pretrained / family), on_meta=True)
    assert module.model is not None
    assert_same_bits(dict(module.model.named_buffers()), dict(build_on_cpu(FAMILIES[family][0]()).named_buffers()))
    torch.testing.assert_close(module.logits(), logits)


class FineTuneWithMask(FineTune):
    """``FineTune`` whose network holds a ``Mask`` of the user's own, built on the meta device too."""

    def configure_model(self) -> None:
        super().configure_model()
        with torch.device("meta"):
            self.model.model.extra = Mask(4)  # type: ignore[union-attr]


def test_load_from_checkpoint_refuses_a_meta_buffer_no_rule_gives_values_by_name(
    pretrained: Path, fine_tuned: dict[str, tuple[Path, Tensor]]
) -> None:
    directory, _ = fine_tuned["llama"]
    with pytest.raises(CheckpointError, match="does not hold them, so they would stay uninitialised") as refused:
        load_from_checkpoint(FineTuneWithMask, directory / "last.ckpt", pretrained=str(pretrained / "llama"),
                             on_meta=True)  # fmt: skip
    assert str(refused.value).endswith(": model.model.extra.mask."), refused.value  # the rotary table is not named


# A model's buffers after ``shard_model(param_init="empty")`` of the model built on the meta device (no training).

ROPE_VARIANTS: dict[str, Callable[[], Any]] = {
    "linear": lambda: transformers.LlamaConfig(**_SIZES, rope_parameters={"rope_type": "linear", "factor": 2.0}),
    "dynamic": lambda: transformers.LlamaConfig(**_SIZES, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
    "yarn": lambda: transformers.Qwen2Config(**_SIZES, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
    "llama3": lambda: transformers.LlamaConfig(**_SIZES, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),  # fmt: skip
    "longrope": lambda: transformers.Phi3Config(**(_SIZES | {"max_position_embeddings": 64}), pad_token_id=0,
                                                original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3],
        "long_factor": [2.0, 2.5, 3.0, 3.5]}),  # fmt: skip
    "gpt_neo": lambda: transformers.GPTNeoConfig(vocab_size=VOCAB, max_position_embeddings=16, hidden_size=32,
                                                 num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
                                                 window_size=4, bos_token_id=1, eos_token_id=2),  # fmt: skip
}


def buffers_after_set_up(rank: int, world_size: int, config: Any) -> dict[str, Tensor]:
    from lightning_shard.engine import shard_model

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shard_model(model, device="cpu", param_init="empty")
    return {n: b.detach().clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_and_causal_masks_get_the_cpu_built_values(variant: str) -> None:
    config = ROPE_VARIANTS[variant]()
    expected = dict(build_on_cpu(config).named_buffers())
    if variant == "gpt_neo":  # the causal masks, a boolean tril and its local window
        assert {"transformer.h.0.attn.attention.bias", "transformer.h.1.attn.attention.bias"} <= expected.keys()
    else:  # the table each variant's own rule computes from the config
        assert "model.rotary_emb.original_inv_freq" in expected
    for ours in run_on_ranks(buffers_after_set_up, 2, config):
        assert_same_bits(ours, expected)


def refusal_at_set_up(rank: int, world_size: int) -> str:
    from lightning_shard.engine import shard_model

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_SIZES))
        model.model.extra = Mask(4)
    try:
        shard_model(model, auto_wrap_policy={"LlamaDecoderLayer"}, device="cpu", param_init="empty")
    except TypeError as err:
        return str(err)
    return ""


def test_a_meta_buffer_no_rule_gives_values_is_refused_by_name() -> None:
    for message in run_on_ranks(refusal_at_set_up, 2):
        assert message.startswith("These buffers were built on the meta device and nothing gives them values:")
        assert "model.extra.mask (Mask: no reset_parameters(); LlamaModel._init_weights does not set it)" in (
            message
        ), message
        assert "rotary_emb" not in message, message  # the rotary table has its values: only the mask is named
