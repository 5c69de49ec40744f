"""The fine-tuning path end to end, as docs/finetuning.md describes it: a transformers GPT-2 written by
``save_pretrained`` in several files with an index is loaded shard-wise (``load_safetensors_into`` in
``on_fit_start``) into a model ``configure_model`` builds on the meta device, under
``ShardStrategy(param_init="empty")`` on 2 ranks; its logits equal the Hugging Face model's before training; after a
few steps ``lightning-shard export --format hf`` of ``last.ckpt`` loads with ``from_pretrained`` to the trained
logits, and ``lightning_shard.load_from_checkpoint`` in one process gives the same logits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_shard
from lightning_shard import ShardStrategy, load_safetensors_into
from lightning_shard.cli import main
from lightning_shard.testing import run_on_ranks
from tests.test_export import PROBE, gpt2_config


class FineTunedGPT2(L.LightningModule):
    """GPT-2 built on the meta device in ``configure_model`` and filled from ``pretrained`` when fit starts."""

    def __init__(self, pretrained: str, n_embd: int = 32, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = transformers.GPT2LMHeadModel(gpt2_config(self.hparams.n_embd))
        self.resets_when_built = _reset_calls[0]  # the constructors' own calls, on the meta device

    def on_fit_start(self) -> None:
        self.resets = _reset_calls[0] - self.resets_when_built  # calls while the strategy sharded the model
        load_safetensors_into(self, self.hparams.pretrained, prefix="model.")
        self.start_logits = self.logits()

    def logits(self) -> Tensor:
        assert self.model is not None
        with torch.no_grad():
            return self.model(input_ids=PROBE).logits.detach().clone()

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        assert self.model is not None
        return self.model(input_ids=x, labels=x).loss

    def on_train_end(self) -> None:
        self.final_logits = self.logits()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


_reset_calls = [0]


@contextmanager
def _counting_resets() -> Iterator[None]:
    """Count reset_parameters() calls of the initialisable modules GPT-2 holds (Embedding, LayerNorm) in
    ``_reset_calls``, from zero; the classes get their own methods back on exit (the rank workers outlive a test)."""
    originals = {cls: cls.reset_parameters for cls in (nn.Embedding, nn.LayerNorm)}

    def counting(original: Any) -> Any:
        def counted(self: nn.Module) -> None:
            _reset_calls[0] += 1
            original(self)

        return counted

    _reset_calls[0] = 0
    for cls, original in originals.items():
        cls.reset_parameters = counting(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.reset_parameters = original  # type: ignore[method-assign]


def fine_tune(rank: int, world_size: int, pretrained: str, ckpt_dir: str) -> dict[str, Any]:
    with _counting_resets():
        return _fine_tune(world_size, pretrained, ckpt_dir)


def _fine_tune(world_size: int, pretrained: str, ckpt_dir: str) -> dict[str, Any]:
    L.seed_everything(0)
    module = FineTunedGPT2(pretrained)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=4,
        strategy=ShardStrategy(auto_wrap_policy={"GPT2Block"}, param_init="empty"),
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)],
    )
    tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(tokens), batch_size=4))
    return {"start": module.start_logits, "final": module.final_logits, "resets": module.resets}


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    pretrained = transformers.GPT2LMHeadModel(gpt2_config(32)).eval()
    pretrained.save_pretrained(root / "pretrained", max_shard_size="40KB")
    with torch.no_grad():
        reference = pretrained(input_ids=PROBE).logits
    runs = run_on_ranks(fine_tune, 2, str(root / "pretrained"), str(root / "ckpt"))
    return {"root": root, "reference": reference, "runs": runs}


def test_the_pretrained_model_loads_shard_wise_to_the_hugging_face_logits(fine_tuned: dict[str, Any]) -> None:
    index = json.loads((fine_tuned["root"] / "pretrained" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # several files and an index
    for run in fine_tuned["runs"]:
        torch.testing.assert_close(run["start"], fine_tuned["reference"])
        assert run["resets"] == 0  # param_init="empty": nothing initialised only to be overwritten


def test_the_export_of_the_fine_tuned_checkpoint_loads_with_from_pretrained(fine_tuned: dict[str, Any]) -> None:
    root, final = fine_tuned["root"], fine_tuned["runs"][0]["final"]
    assert not torch.allclose(final, fine_tuned["reference"])  # training moved the weights
    out = root / "exported"
    rc = main(["export", str(root / "ckpt" / "last.ckpt"), str(out), "--format", "hf", "--prefix", "model.",
               "--config", str(root / "pretrained" / "config.json")])
    assert rc == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=PROBE).logits, final)


def test_load_from_checkpoint_gives_the_fine_tuned_logits(fine_tuned: dict[str, Any]) -> None:
    root, final = fine_tuned["root"], fine_tuned["runs"][0]["final"]
    module = lightning_shard.load_from_checkpoint(FineTunedGPT2, root / "ckpt" / "last.ckpt")
    torch.testing.assert_close(module.logits(), final)
