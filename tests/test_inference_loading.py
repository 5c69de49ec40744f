"""``lightning_shard.load_from_checkpoint``: one process, no Trainer, the GPT-2 of ``tests/test_export.py`` (trained
under ``ShardStrategy`` on 2 ranks) rebuilt from its saved hyperparameters must give the trained logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import lightning_shard
from lightning_shard import CheckpointError
from tests.test_export import PROBE, LitGPT2, gpt2_config, trained


def logits_of(module: LitGPT2) -> torch.Tensor:
    with torch.no_grad():
        return module.model(input_ids=PROBE).logits


def test_load_from_checkpoint_gives_the_trained_logits() -> None:
    ckpt, logits = trained()
    module = lightning_shard.load_from_checkpoint(LitGPT2, ckpt)
    assert module.hparams.n_embd == 32  # from the checkpoint: the class default is 8
    assert not module.training
    torch.testing.assert_close(logits_of(module), logits)


def test_kwargs_override_the_saved_hyperparameters() -> None:
    ckpt, _ = trained()
    module = lightning_shard.load_from_checkpoint(LitGPT2, ckpt, lr=0.5)
    assert module.hparams.lr == 0.5 and module.hparams.n_embd == 32


class MetaGPT2(LitGPT2):
    """Builds the network in ``configure_model()`` on the meta device."""

    def __init__(self, n_embd: int = 8, lr: float = 1e-2) -> None:
        super(LitGPT2, self).__init__()
        self.save_hyperparameters()
        self.model: nn.Module | None = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        with torch.device("meta"):
            self.model = transformers.GPT2LMHeadModel(gpt2_config(self.hparams.n_embd))


def test_meta_configure_model_is_materialised_and_filled() -> None:
    ckpt, logits = trained()
    module = lightning_shard.load_from_checkpoint(MetaGPT2, ckpt)
    assert not any(t.is_meta for t in module.state_dict().values())
    torch.testing.assert_close(logits_of(module), logits)


def test_meta_configure_model_keeps_its_tied_weights_tied() -> None:
    ckpt, _ = trained()
    module = lightning_shard.load_from_checkpoint(MetaGPT2, ckpt)
    assert module.model.lm_head.weight is module.model.transformer.wte.weight  # fine-tuning updates one tensor
    assert len(list(module.parameters())) == len(list(LitGPT2(n_embd=32).parameters()))


class MetaWithExtra(MetaGPT2):
    def configure_model(self) -> None:
        super().configure_model()
        with torch.device("meta"):
            self.head = nn.Linear(2, 2)


def test_meta_parameter_the_checkpoint_lacks_is_refused_by_name() -> None:
    ckpt, _ = trained()
    with pytest.raises(CheckpointError, match=r"uninitialised: head\.bias, head\.weight"):
        lightning_shard.load_from_checkpoint(MetaWithExtra, ckpt, strict=False)


class WithExtra(LitGPT2):
    def __init__(self, n_embd: int = 8, lr: float = 1e-2) -> None:
        super().__init__(n_embd, lr)
        self.head = nn.Linear(2, 2)


def test_strict_refuses_missing_keys_and_non_strict_loads_the_rest() -> None:
    ckpt, logits = trained()
    with pytest.raises(RuntimeError, match=r"missing keys: \['head\.weight', 'head\.bias'\]"):
        lightning_shard.load_from_checkpoint(WithExtra, ckpt)
    module = lightning_shard.load_from_checkpoint(WithExtra, ckpt, strict=False)
    torch.testing.assert_close(logits_of(module), logits)


def test_map_location_places_the_module(tmp_path: Path) -> None:
    ckpt, _ = trained()
    module = lightning_shard.load_from_checkpoint(LitGPT2, ckpt, map_location="meta")
    assert all(t.is_meta for t in module.state_dict().values())


def test_a_torch_load_style_callable_map_location_places_the_module() -> None:
    ckpt, logits = trained()
    to_meta = lightning_shard.load_from_checkpoint(
        LitGPT2, ckpt, map_location=lambda storage, location: torch.empty(0, device="meta").untyped_storage()
    )
    assert all(t.is_meta for t in to_meta.state_dict().values())
    kept = lightning_shard.load_from_checkpoint(LitGPT2, ckpt, map_location=lambda storage, location: storage)
    torch.testing.assert_close(logits_of(kept), logits)


class RecordingGPT2(LitGPT2):
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.seen = {"keys": sorted(checkpoint), "built": self.model is not None}


def test_on_load_checkpoint_sees_the_trainer_state_before_the_weights() -> None:
    ckpt, logits = trained()
    module = lightning_shard.load_from_checkpoint(RecordingGPT2, ckpt)
    assert {"epoch", "global_step", "hyper_parameters"} <= set(module.seen["keys"]), module.seen
    assert "state_dict" not in module.seen["keys"] and module.seen["built"]
    torch.testing.assert_close(logits_of(module), logits)
