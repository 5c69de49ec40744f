"""``lightning-shard export CKPT OUT.ckpt --format lightning`` (``export_lightning``): one Lightning checkpoint file
that ``LightningModule.load_from_checkpoint`` and ``torch.load(weights_only=True)`` read, holding exactly the
consolidated weights and the trainer state."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_shard import CheckpointError, consolidate, export_lightning, inspect
from lightning_shard.cli import main
from tests.test_export import PROBE, LitGPT2, trained


def test_load_from_checkpoint_holds_exactly_the_consolidated_weights(tmp_path: Path) -> None:
    ckpt, logits = trained()
    assert main(["export", str(ckpt), str(tmp_path / "out.ckpt"), "--format", "lightning"]) == 0
    module = LitGPT2.load_from_checkpoint(tmp_path / "out.ckpt")  # hyperparameters from the file: n_embd=32
    consolidated = load_file(str(consolidate(ckpt, tmp_path / "model.safetensors")))
    state = module.state_dict()
    assert module.hparams.n_embd == 32
    for key, value in consolidated.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(module.model(input_ids=PROBE).logits, logits)


def test_torch_load_with_weights_only_reads_the_trainer_state(tmp_path: Path) -> None:
    ckpt, _ = trained()
    previous = os.umask(0o022)
    try:
        result = export_lightning(ckpt, tmp_path / "out.ckpt")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out.ckpt").stat().st_mode) == 0o644  # readable by others
    checkpoint = torch.load(tmp_path / "out.ckpt", weights_only=True)
    for key in ("state_dict", "epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "loops"):
        assert key in checkpoint, key
    summary = inspect(ckpt, verify=False)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (summary.epoch, summary.global_step) == (1, 4)
    assert len(result.tensors) == len(checkpoint["state_dict"])
    weights = checkpoint["state_dict"]
    stored = [weights[k].untyped_storage().data_ptr() for k in ("model.lm_head.weight", "model.transformer.wte.weight")]
    assert stored[0] == stored[1]  # the tie: one tensor under both names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.ckpt"]  # nothing staged left behind


def test_an_existing_file_is_replaced_only_when_asked(tmp_path: Path) -> None:
    ckpt, _ = trained()
    (tmp_path / "out.ckpt").write_text("keep me")
    with pytest.raises(CheckpointError, match="exists: pass overwrite=True"):
        export_lightning(ckpt, tmp_path / "out.ckpt")
    assert (tmp_path / "out.ckpt").read_text() == "keep me"
    export_lightning(ckpt, tmp_path / "out.ckpt", overwrite=True)
    assert "state_dict" in torch.load(tmp_path / "out.ckpt", weights_only=True)


def test_options_of_other_formats_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, _ = trained()
    assert main(["export", str(ckpt), str(tmp_path / "out.ckpt"), "--format", "lightning", "--dtype", "bfloat16"]) == 2
    assert "--dtype do not apply to --format lightning" in capsys.readouterr().err
    assert not (tmp_path / "out.ckpt").exists()
    assert main(["export", str(ckpt), str(tmp_path / "dcp"), "--format", "dcp", "--adapter-name", "default"]) == 2
    assert "--adapter-name do not apply to --format dcp" in capsys.readouterr().err  # was accepted and ignored
    assert not (tmp_path / "dcp").exists()
