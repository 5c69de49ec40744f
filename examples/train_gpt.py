"""Train a small character-level GPT with fully sharded data parallelism on CPU.

Run from the repository root:

    python examples/train_gpt.py

or let the Makefile create the virtual environment first:

    make demo

By default this starts 2 CPU processes (gloo backend). Every parameter, gradient and
optimizer state is split between them by ``ShardStrategy``. The model is built on the
``meta`` device in ``configure_model()``, so no process ever holds the full model, and
``ShardStrategy`` materialises only each rank's shard. After training, every rank prints
its final loss and how many bytes it holds compared with full replication, and rank 0
prints a short text sample.

Options worth trying: ``--precision bf16-mixed`` (bf16 all-gathers, fp32 master shards),
``--activation-checkpointing`` (recompute each block's activations in backward), and
``--sharding-strategy SHARD_GRAD_OP``.

The corpus in ``examples/data/tiny_text.txt`` is a short play written for this project,
"The Keeper of Gull Point".
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_shard import ShardStrategy, generate

DATA_PATH = Path(__file__).resolve().parent / "data" / "tiny_text.txt"


# --------------------------------------------------------------------------- data


class CharDataset(Dataset):
    """Every window of ``block_size + 1`` consecutive characters; input and target are offset by one."""

    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.block_size = block_size
        self.data = torch.tensor(self.encode(text), dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[idx : idx + self.block_size + 1]
        return chunk[:-1], chunk[1:]


# -------------------------------------------------------------------------- model
#
# Every module that owns parameters has a ``reset_parameters()`` (nn.Linear, nn.LayerNorm
# and the Embedding below), and the model registers no buffers: causal masking uses
# ``is_causal=True``. That is what lets the strategy build the model on the meta device
# and initialise only the local shards.


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised like GPT-2, N(0, 0.02), instead of N(0, 1)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block. Each Block is one sharding unit (``auto_wrap_policy={Block}``)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = Embedding(vocab_size, n_embd)
        self.pos_emb = Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        assert T <= self.block_size, f"sequence of length {T} is longer than block_size {self.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---------------------------------------------------------------------- lightning


class CharGPT(L.LightningModule):
    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 4,
        n_embd: int = 128,
        n_head: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: GPT | None = None

    def configure_model(self) -> None:
        # Called by the Trainer once the strategy is set up. Building on the meta device
        # allocates no memory; ShardStrategy then materialises only this rank's shards.
        if self.model is not None:
            return
        hp = self.hparams
        with torch.device("meta"):
            self.model = GPT(hp.vocab_size, hp.block_size, hp.n_layer, hp.n_embd, hp.n_head)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Two parameter groups, chosen by name: no weight decay for biases, LayerNorm
        # weights and embeddings (which include the tied LM head).
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim < 2 or name.endswith(".bias") or "_emb." in name or ".ln_" in name:
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))


# ----------------------------------------------------------------------- sampling


def sample(
    model: nn.Module,
    dataset: CharDataset,
    prompt: str,
    num_chars: int,
    block_size: int,
    device: torch.device,
    seed: int = 0,
) -> str:
    """Autoregressive sampling with the weights kept sharded: every forward gathers them with
    collectives, so all ranks call this together. ``generate`` keeps the ranks in step even when
    they stop at different lengths; with the same seed they all draw the same text."""
    generator = torch.Generator().manual_seed(seed)  # on the CPU: the same draws on any device
    idx = torch.tensor([dataset.encode(prompt)], dtype=torch.long, device=device)
    idx = generate(model, idx, num_chars, generator=generator, context_length=block_size)
    return dataset.decode(idx[0].tolist())


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--sharding-strategy",
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
    )
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute block activations")
    parser.add_argument("--cpu-offload", action="store_true", help="shards and optimizer state in CPU memory (GPU)")
    parser.add_argument("--sample-chars", type=int, default=200)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one thread per process: the processes share the CPU cores
    L.seed_everything(1337)

    dataset = CharDataset(DATA_PATH.read_text(encoding="utf-8"), args.block_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = CharGPT(
        vocab_size=dataset.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        lr=args.lr,
    )

    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ShardStrategy(
            auto_wrap_policy={Block},
            sharding_strategy=args.sharding_strategy,
            activation_checkpointing_policy={Block} if args.activation_checkpointing else None,
            cpu_offload=args.cpu_offload,
        ),
        max_steps=args.max_steps,
        max_epochs=math.ceil(args.max_steps / len(loader)),  # the progress bar's "Epoch i/n" (else n is -2)
        precision=args.precision,
        log_every_n_steps=10,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=True,
    )
    trainer.fit(model, loader)

    # Every rank reports its own loss and the bytes it holds vs. a fully replicated copy.
    loss = trainer.callback_metrics["train_loss"].item()
    report = trainer.strategy.memory_report()
    print(f"rank {trainer.global_rank}: final loss {loss:.3f} | {report}", flush=True)

    # Sampling runs on all ranks (forward is collective); only rank 0 prints.
    text = sample(
        trainer.lightning_module,  # the sharded model: generate() switches it to eval mode and back
        dataset,
        prompt="TOBIAS:\n",
        num_chars=args.sample_chars,
        block_size=args.block_size,
        device=trainer.strategy.root_device,
        seed=1337,
    )
    if trainer.global_rank == 0:
        print("-" * 60)
        print(text)
        print("-" * 60, flush=True)


if __name__ == "__main__":
    main()
