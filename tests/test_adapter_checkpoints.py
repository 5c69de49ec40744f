"""Adapter-only checkpoints and peft export, on a peft LoRA over a pretrained Hugging Face GPT-2 under the Trainer.

The oracle is DDP with the same module: a 2-rank ShardStrategy(save_trainable_only=True) fit checkpoints every 3
steps; the checkpoint holds the adapters and their optimizer state only (at most 4x the adapter's fp32 bytes plus
256 KiB); resumed on 3 ranks (the pretrained import in ``configure_model`` or in ``on_fit_start``) it ends at
DDP's logits; without the import the first forward raises on every rank, naming the weights left out.
``export --format peft`` loads with ``PeftModel.from_pretrained`` to DDP's trained logits, ``--format hf`` merges
them into the base exactly as peft's ``merge_and_unload`` does, and a checkpoint without the save-time record
exports the same bytes with ``--adapter-config``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import peft
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from lightning_shard import GlobalBatchLoader, ShardStrategy, load_safetensors_into
from lightning_shard.checkpoint.io.index import read_index
from lightning_shard.cli import main
from lightning_shard.testing import RankFailure, run_on_ranks
from lightning_shard.testing_checkpoints import reseal_index
from tests.test_export import PROBE, gpt2_config

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True, "lora_dropout": 0.0}
STEPS, SAVE_EVERY, GLOBAL_BATCH = 6, 3, 12


class LoraGPT2(L.LightningModule):
    """peft LoRA on GPT-2's attention input projections; the frozen base imported from ``pretrained`` in
    ``configure_model`` (``from_pretrained``), in ``on_fit_start`` (``load_safetensors_into`` over a random base)
    or nowhere (a random base: what a resume that forgot the import trains on)."""

    def __init__(self, pretrained: str, import_in: str = "configure_model") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.hparams.import_in == "configure_model":
            base = transformers.GPT2LMHeadModel.from_pretrained(self.hparams.pretrained)
        else:
            torch.manual_seed(123)
            base = transformers.GPT2LMHeadModel(gpt2_config(32))
        torch.manual_seed(7)  # the adapters' initial values: the same in every run
        self.model = peft.get_peft_model(base, peft.LoraConfig(**LORA))

    def on_fit_start(self) -> None:
        if self.hparams.import_in == "on_fit_start":
            load_safetensors_into(
                self, Path(self.hparams.pretrained) / "model.safetensors", prefix="model.base_model.model.",
                strict=False, rename=lambda key: key.replace(".attn.c_attn.", ".attn.c_attn.base_layer."),
            )

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        assert self.model is not None
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def logits(self) -> Tensor:
        assert self.model is not None
        with torch.no_grad():
            return self.model(input_ids=PROBE).logits.detach().clone()

    def on_train_end(self) -> None:
        self.final_logits = self.logits()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def fit_lora(
    rank: int, world_size: int, pretrained: str, ckpt_dir: str | None, *, ddp: bool = False,
    import_in: str = "configure_model", resume: str | None = None, trainable_only: bool = True, ema: bool = False,
) -> dict[str, Any]:
    L.seed_everything(0)
    module = LoraGPT2(pretrained, import_in)
    strategy = DDPStrategy() if ddp else ShardStrategy(auto_wrap_policy={"GPT2Block"},
                                                       save_trainable_only=trainable_only)
    callbacks: list[Any] = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_EVERY, save_top_k=-1)
                            ] if ckpt_dir else []
    if ema:
        callbacks.append(EMAWeightAveraging(decay=0.5))
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=STEPS, strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None, use_distributed_sampler=False,
    )
    tokens = torch.randint(0, 64, (72, 16), generator=torch.Generator().manual_seed(1))
    loader = GlobalBatchLoader(torch.utils.data.TensorDataset(tokens), GLOBAL_BATCH, num_replicas=world_size,
                               rank=rank, seed=3)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume)
    return {"losses": module.losses, "final": module.final_logits}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(gpt2_config(32)).save_pretrained(root / "pretrained")
    pretrained = str(root / "pretrained")
    ddp = run_on_ranks(fit_lora, 2, pretrained, None, ddp=True)
    ours = run_on_ranks(fit_lora, 2, pretrained, str(root / "ckpt"))
    return {"root": root, "pretrained": pretrained, "ddp": ddp[0], "ours": ours[0]}


def checkpoint_at(runs: dict[str, Any], step: int) -> Path:
    return runs["root"] / "ckpt" / f"epoch=0-step={step}.ckpt"


def adapter_keys() -> list[str]:
    return [f"model.base_model.model.transformer.h.{i}.attn.c_attn.lora_{ab}.default.weight"
            for i in range(2) for ab in "AB"]


def test_the_adapter_only_checkpoint_holds_the_adapters_and_their_optimizer_state(runs: dict[str, Any]) -> None:
    torch.testing.assert_close(runs["ours"]["final"], runs["ddp"]["final"])  # training itself matches DDP
    ckpt = checkpoint_at(runs, STEPS)
    index = read_index(ckpt)
    model_keys = sorted(k.removeprefix("model/") for k in index["tensors"] if k.startswith("model/"))
    assert model_keys == sorted(adapter_keys())
    optimizer_keys = {k.split("/")[2] for k in index["tensors"] if k.startswith("optimizer/")}
    assert optimizer_keys == set(adapter_keys())
    assert "model.base_model.model.transformer.wte.weight" in {k.removeprefix("model/") for k in index["left_out"]}
    adapter_bytes = 2 * (4 * 32 + 96 * 4) * 4  # two layers of A (4x32) and B (96x4), fp32
    total = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    assert total <= 4 * adapter_bytes + 256 * 1024, total


def test_inspect_says_what_was_left_out_and_which_adapters_are_recorded(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(checkpoint_at(runs, STEPS))]) == 0
    printed = capsys.readouterr().out
    assert "28 model weights left out" in printed and "peft adapters: default" in printed, printed


@pytest.mark.parametrize("import_in", ["configure_model", "on_fit_start"])
def test_resumed_on_3_ranks_it_ends_at_the_uninterrupted_ddp_run(runs: dict[str, Any], import_in: str) -> None:
    resumed = run_on_ranks(fit_lora, 3, runs["pretrained"], None, import_in=import_in,
                           resume=str(checkpoint_at(runs, SAVE_EVERY)))[0]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(runs["ddp"]["losses"][SAVE_EVERY:]))
    torch.testing.assert_close(resumed["final"], runs["ddp"]["final"])


def test_resuming_without_the_frozen_weights_raises_on_every_rank(runs: dict[str, Any]) -> None:
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fit_lora, 2, runs["pretrained"], None, import_in="nowhere",
                     resume=str(checkpoint_at(runs, SAVE_EVERY)))
    message = str(failure.value)
    assert message.count("do not hold the values they had when it was saved") >= 2, message  # both ranks
    assert "transformer.wte.weight" in message and "save_trainable_only" in message


def trained_peft_model(runs: dict[str, Any], adapter_dir: Path) -> peft.PeftModel:
    base = transformers.GPT2LMHeadModel.from_pretrained(runs["pretrained"])
    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def test_export_peft_loads_in_peft_to_ddps_trained_logits(runs: dict[str, Any]) -> None:
    out = runs["root"] / "peft"
    assert main(["export", str(checkpoint_at(runs, STEPS)), str(out), "--format", "peft"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["inference_mode"] is True
    with torch.no_grad():
        logits = trained_peft_model(runs, out)(input_ids=PROBE).logits
    torch.testing.assert_close(logits, runs["ddp"]["final"])


def test_export_hf_merges_the_adapters_as_peft_does(runs: dict[str, Any]) -> None:
    out, adapters = runs["root"] / "merged", runs["root"] / "peft-for-merge"
    assert main(["export", str(checkpoint_at(runs, STEPS)), str(adapters), "--format", "peft"]) == 0
    assert main(["export", str(checkpoint_at(runs, STEPS)), str(out), "--format", "hf"]) == 0  # base: the config's
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    reference = trained_peft_model(runs, adapters).merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=PROBE).logits, reference(input_ids=PROBE).logits)
    assert not any("lora" in k for k in merged.state_dict())


def test_a_checkpoint_without_the_record_exports_the_same_adapter_with_adapter_config(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    recorded, ckpt = tmp_path / "recorded", tmp_path / "unrecorded.ckpt"
    assert main(["export", str(checkpoint_at(runs, STEPS)), str(recorded), "--format", "peft"]) == 0
    shutil.copytree(checkpoint_at(runs, STEPS), ckpt)
    reseal_index(ckpt, lambda index: index.pop("adapters"))
    assert main(["export", str(ckpt), str(tmp_path / "none"), "--format", "peft"]) == 2  # says what to give
    out = tmp_path / "given"
    assert main(["export", str(ckpt), str(out), "--format", "peft", "--prefix", "model",
                 "--adapter-config", str(recorded / "adapter_config.json")]) == 0
    assert (out / "adapter_model.safetensors").read_bytes() == (recorded / "adapter_model.safetensors").read_bytes()


def test_an_adapter_only_checkpoint_is_not_exported_as_a_whole_model(runs: dict[str, Any], tmp_path: Path) -> None:
    ckpt = tmp_path / "unrecorded.ckpt"
    shutil.copytree(checkpoint_at(runs, STEPS), ckpt)
    reseal_index(ckpt, lambda index: index.pop("adapters"))
    for fmt in ("hf", "dcp"):
        assert main(["export", str(ckpt), str(tmp_path / fmt), "--format", fmt]) == 2
        assert not (tmp_path / fmt).exists()


def test_an_ema_fit_saved_adapter_only_resumes_on_3_ranks_to_the_uninterrupted_average(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """The average of the frozen weights is not stored either: it is the frozen weights, restored with them."""
    whole = run_on_ranks(fit_lora, 2, runs["pretrained"], str(tmp_path), ema=True)[0]
    resumed = run_on_ranks(fit_lora, 3, runs["pretrained"], None, ema=True,
                           resume=str(tmp_path / f"epoch=0-step={SAVE_EVERY}.ckpt"))[0]
    assert any(k.startswith("average/") for k in read_index(tmp_path / f"epoch=0-step={SAVE_EVERY}.ckpt")["tensors"])
    assert not torch.allclose(whole["final"], runs["ours"]["final"])  # the model ends as the average
    torch.testing.assert_close(resumed["final"], whole["final"])


def test_options_a_recorded_export_cannot_honour_are_refused_not_ignored(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(checkpoint_at(runs, STEPS))
    refused = {
        "unknown adapter": ["--format", "peft", "--adapter-name", "other"],
        "other prefix": ["--format", "peft", "--prefix", "net"],
        "merge with --config": ["--format", "hf", "--config", str(Path(runs["pretrained"]) / "config.json")],
        "merge with --prefix": ["--format", "hf", "--prefix", "model"],
    }
    for name, flags in refused.items():
        assert main(["export", ckpt, str(tmp_path / name), *flags]) == 2, name
        assert not (tmp_path / name).exists()
    printed = capsys.readouterr().err
    assert "not 'other'" in printed and "not under the prefix 'net'" in printed and "do not apply" in printed
    named = tmp_path / "named"  # the recorded prefix and adapter, named explicitly: honoured
    assert main(["export", ckpt, str(named), "--format", "peft", "--adapter-name", "default", "--prefix", "model"]) == 0
    assert (named / "adapter_model.safetensors").is_file()
