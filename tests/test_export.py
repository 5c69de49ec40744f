"""``lightning-shard export --format hf``: a transformers GPT-2 trained under ``ShardStrategy`` on 2 ranks, exported
from its ``last.ckpt`` directory, must load with ``GPT2LMHeadModel.from_pretrained`` and give the logits the sharded
model computed at the end of training. The reference readers are transformers' and safetensors' own."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_shard
from lightning_shard import CheckpointError, ShardStrategy
from lightning_shard.cli import main
from lightning_shard.testing import run_on_ranks

PROBE = torch.arange(24).reshape(2, 12) % 64  # the inputs the logits are compared on


class LitGPT2(L.LightningModule):
    """A tiny GPT-2 held as ``self.model``; hyperparameters saved; the default width is not the trained one."""

    def __init__(self, n_embd: int = 8, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = transformers.GPT2LMHeadModel(gpt2_config(n_embd))

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def on_train_end(self) -> None:
        with torch.no_grad():
            self.final_logits = self.model(input_ids=PROBE).logits.detach().clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def gpt2_config(n_embd: int) -> Any:
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def fit_and_checkpoint(rank: int, world_size: int, ckpt_dir: str, state_dict_type: str = "sharded") -> Tensor:
    L.seed_everything(0)
    module = LitGPT2(n_embd=32)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_epochs=1,
        strategy=ShardStrategy(auto_wrap_policy={"GPT2Block"}, state_dict_type=state_dict_type),
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)],
    )
    tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(tokens), batch_size=4))
    return module.final_logits


@functools.cache
def trained(state_dict_type: str = "sharded") -> tuple[Path, Tensor]:
    """``(last.ckpt, logits of the trained sharded model on PROBE)``: trained once per test process."""
    ckpt_dir = Path(tempfile.mkdtemp(prefix="export-gpt2-"))
    atexit.register(shutil.rmtree, ckpt_dir, ignore_errors=True)
    logits = run_on_ranks(fit_and_checkpoint, 2, str(ckpt_dir), state_dict_type)
    torch.testing.assert_close(logits[0], logits[1])
    return ckpt_dir / "last.ckpt", logits[0]


def write_config(path: Path) -> Path:
    gpt2_config(32).to_json_file(str(path))
    return path


def hf_logits(directory: Path) -> Tensor:
    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits.float()


def test_cli_export_several_files_loads_with_from_pretrained(tmp_path: Path) -> None:
    ckpt, logits = trained()
    out = tmp_path / "hf"
    rc = main(["export", str(ckpt), str(out), "--format", "hf", "--prefix", "model.", "--max-shard-size", "40000",
               "--config", str(write_config(tmp_path / "config.json"))])
    assert rc == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    tensors = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert "lm_head.weight" not in tensors and "transformer.wte.weight" in tensors  # the tie is written once
    torch.testing.assert_close(hf_logits(out), logits)


def test_export_single_file(tmp_path: Path) -> None:
    ckpt, logits = trained()
    out = tmp_path / "hf"
    result = lightning_shard.export_hf(ckpt, out, prefix="model.", config=write_config(tmp_path / "config.json"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert result.files == ["model.safetensors"] and result.skipped == []
    torch.testing.assert_close(hf_logits(out), logits)


def test_export_from_a_full_layout_checkpoint(tmp_path: Path) -> None:
    ckpt, logits = trained("full")
    assert (ckpt / "model.safetensors").is_file()  # the full layout: one piece per tensor
    lightning_shard.export_hf(ckpt, tmp_path / "hf", prefix="model.", max_shard_size=40000,
                              config=write_config(tmp_path / "config.json"))
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), logits)


def test_export_bfloat16_casts_every_tensor(tmp_path: Path) -> None:
    ckpt, _ = trained()
    full = load_file(str(lightning_shard.export_hf(ckpt, tmp_path / "fp32", prefix="model.").output
                         / "model.safetensors"))
    lightning_shard.export_hf(ckpt, tmp_path / "bf16", prefix="model.", dtype="bfloat16")
    half = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert half.keys() == full.keys()
    for key, value in full.items():
        assert half[key].dtype == torch.bfloat16, key
        assert torch.equal(half[key], value.to(torch.bfloat16)), key


def test_export_dtype_is_recorded_in_the_config_and_from_pretrained_auto_loads_it(tmp_path: Path) -> None:
    ckpt, logits = trained()
    config = write_config(tmp_path / "config.json")
    lightning_shard.export_hf(ckpt, tmp_path / "bf16", prefix="model.", dtype="bfloat16", config=config)
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert written["dtype"] == "bfloat16"
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "bf16"), dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    lightning_shard.export_hf(ckpt, tmp_path / "fp32", prefix="model.", config=config)
    assert (tmp_path / "fp32" / "config.json").read_bytes() == config.read_bytes()  # no dtype: copied as it is


def test_export_refuses_a_config_that_is_not_a_json_object(tmp_path: Path) -> None:
    ckpt, _ = trained()
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is not a JSON object"):
        lightning_shard.export_hf(ckpt, tmp_path / "out", prefix="model.", dtype="bfloat16",
                                  config=tmp_path / "config.json")
    assert not (tmp_path / "out").exists()


def test_export_leaves_out_keys_without_the_prefix(tmp_path: Path) -> None:
    ckpt, _ = trained()
    result = lightning_shard.export_hf(ckpt, tmp_path / "hf", prefix="model.transformer.h.0.")
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written and all(not k.startswith("model.") for k in written)
    reference = transformers.GPT2LMHeadModel(gpt2_config(32)).state_dict()
    assert set(written) == {k.removeprefix("transformer.h.0.") for k in reference if k.startswith("transformer.h.0.")}
    assert "model.transformer.wte.weight" in result.skipped
    with pytest.raises(CheckpointError, match="No model key"):
        lightning_shard.export_hf(ckpt, tmp_path / "none", prefix="network.")


def test_a_prefix_without_its_dot_names_the_same_submodule(tmp_path: Path) -> None:
    ckpt, _ = trained()
    with_dot = load_file(str(lightning_shard.export_hf(ckpt, tmp_path / "dot", prefix="model.").output
                             / "model.safetensors"))
    without = load_file(str(lightning_shard.export_hf(ckpt, tmp_path / "bare", prefix="model").output
                            / "model.safetensors"))
    assert without.keys() == with_dot.keys() and "transformer.wte.weight" in without  # not ".transformer.wte.weight"


def test_export_refuses_a_non_empty_destination(tmp_path: Path) -> None:
    ckpt, _ = trained()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        lightning_shard.export_hf(ckpt, out, prefix="model.")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    lightning_shard.export_hf(ckpt, out, prefix="model.", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_failed_export_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_shard.checkpoint.interop.export as export

    ckpt, _ = trained()
    calls = []

    def failing_read_rows(*args: Any) -> Tensor:
        calls.append(1)
        if len(calls) == 5:
            raise OSError("disk full")
        return export_read_rows(*args)

    export_read_rows = export.read_rows
    monkeypatch.setattr(export, "read_rows", failing_read_rows)
    with pytest.raises(OSError, match="disk full"):
        lightning_shard.export_hf(ckpt, tmp_path / "hf", prefix="model.", max_shard_size=40000)
    assert len(calls) == 5
    assert list(tmp_path.iterdir()) == []


def test_block_wise_reading_writes_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_shard.checkpoint.interop.export as export

    ckpt, _ = trained()
    whole = load_file(str(lightning_shard.export_hf(ckpt, tmp_path / "whole", prefix="model.").output
                          / "model.safetensors"))
    monkeypatch.setattr(export, "_BLOCK_BYTES", 100)  # a few rows per block
    blocks = load_file(str(lightning_shard.export_hf(ckpt, tmp_path / "blocks", prefix="model.").output
                           / "model.safetensors"))
    assert blocks.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(blocks[key], value), key


def test_a_piece_failing_its_checksum_fails_the_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_shard.checkpoint.interop.export as export

    ckpt, _ = trained()
    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(ckpt, damaged)
    from lightning_shard.checkpoint.format.safetensors_header import read_safetensors_header

    key = "model/model.transformer.h.1.mlp.c_fc.weight"
    entry = json.loads((damaged / "index.json").read_text())["tensors"][key]
    shard = damaged / entry.get("file", "shard-00001-of-00002.safetensors")  # whole in one file, or rank 1's rows
    data = shard.read_bytes()
    header = read_safetensors_header(shard, len(data))
    at = header.data_start + header.entries[key].begin + 5
    shard.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    monkeypatch.setattr(export, "_BLOCK_BYTES", 100)  # the export reads a piece in parts: each part checked
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted: bytes"):
        lightning_shard.export_hf(damaged, tmp_path / "hf", prefix="model.")
    assert not (tmp_path / "hf").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["damaged.ckpt"]
