"""Fine-tune small trainable adapters on a frozen Hugging Face GPT-2, sharded by block class name.

    python examples/finetune_adapters.py               # 2 CPU processes
    python examples/finetune_adapters.py --weights model.safetensors   # start from a local model file

The GPT-2 is built from a config (nothing is downloaded). Every weight of the base model is frozen;
each block's attention input projection gets a low-rank adapter (``LowRankAdapter``: x @ A @ B,
B starting at zero) whose two small matrices are the only trainable parameters, mixed with the
frozen ones inside each sharding unit. ``ShardStrategy(auto_wrap_policy={"GPT2Block"})`` wraps the
blocks by class name, as a YAML config would. With ``--weights``, a local ``.safetensors`` model
file (for example a saved GPT-2) is loaded into the sharded model, each rank reading only its rows.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from train_gpt import DATA_PATH, CharDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_shard import ShardStrategy, load_safetensors_into


class LowRankAdapter(nn.Module):
    """Wraps a frozen projection: ``base(x) + x @ A @ B``; only ``A`` and ``B`` train."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(in_features, rank) / rank)
        self.B = nn.Parameter(torch.zeros(rank, out_features))  # starts as the identity change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.A @ self.B


class AdapterFineTune(L.LightningModule):
    def __init__(self, vocab_size: int, weights: str | None = None) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=4)
        self.model = GPT2LMHeadModel(config)
        self.model.requires_grad_(False)
        for block in self.model.transformer.h:
            block.attn.c_attn = LowRankAdapter(block.attn.c_attn, config.n_embd, 3 * config.n_embd)
        self.weights = weights

    def on_fit_start(self) -> None:
        if self.weights:  # a GPT-2 file's keys lack this module's "model." prefix and the adapters' ".base"
            result = load_safetensors_into(
                self, self.weights, prefix="model.", strict=False,
                rename=lambda key: key.replace(".attn.c_attn.", ".attn.c_attn.base."),
            )
            if self.global_rank == 0:
                print(f"loaded {self.weights}; not in the file (new): {result.missing_keys}")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--weights", default=None, help="a local .safetensors GPT-2 model file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(1337)
    dataset = CharDataset(DATA_PATH.read_text(encoding="utf-8"), block_size=64)
    module = AdapterFineTune(dataset.vocab_size, args.weights)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=ShardStrategy(auto_wrap_policy={"GPT2Block"}),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, DataLoader(dataset, batch_size=8, shuffle=True, drop_last=True))
    if trainer.is_global_zero:
        print(f"trained {trainable:,} of {total:,} parameters; final loss {trainer.callback_metrics['train_loss']:.3f}")


if __name__ == "__main__":
    main()
