"""Small models for the tests: a stack of MLP blocks, a GPT with tied embeddings and frozen weights, and an MLP whose
shapes three ranks do not divide."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, width: int = 12, depth: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.blocks = nn.Sequential(*[MLPBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.inp(x)))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has zero true gradient: Adam would amplify noise
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Tied embedding/LM head; frozen position embedding and first-block qkv (mixed with trainable ones in a unit)."""

    def __init__(self, vocab: int = 37, d: int = 16, depth: int = 2, heads: int = 2, ctx: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([GPTBlock(d, heads) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.blocks[0].qkv.weight.requires_grad_(False)
        self.wpe.weight.requires_grad_(False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class UnevenMLP(MLPStack):
    """Row counts that 3 ranks do not divide (10, 20), a 2-row head and a 0-dim scale: at 3 ranks the last rank holds
    a short chunk of most parameters and no rows at all of the head, and only the first rank holds the scale."""

    def __init__(self) -> None:
        super().__init__(width=10, depth=2, classes=2)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * self.scale


def make_model(kind: str) -> nn.Module:
    return {"mlp": MLPStack, "gpt": TinyGPT, "uneven": UnevenMLP}[kind]()


def make_dataset(kind: str, n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    if kind == "uneven":
        return TensorDataset(torch.randn(n, 7, generator=g), torch.randint(0, 2, (n,), generator=g))
    if kind == "mlp":
        return TensorDataset(torch.randn(n, 7, generator=g), torch.randint(0, 5, (n,), generator=g))
    tokens = torch.randint(0, 37, (n, 9), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def block_class(kind: str) -> type[nn.Module]:
    return {"mlp": MLPBlock, "gpt": GPTBlock, "uneven": MLPBlock}[kind]


class LitModel(L.LightningModule):
    """Records this rank's loss at every training step; AdamW with weight decay off for 1-D parameters."""

    def __init__(self, kind: str, lr: float = 1e-2) -> None:
        super().__init__()
        self.kind = kind
        self.lr = lr
        self.model = make_model(kind)
        self.losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for n, p in self.named_parameters() if p.requires_grad and not _no_decay(n)]
        no_decay = [p for n, p in self.named_parameters() if p.requires_grad and _no_decay(n)]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=self.lr
        )


class SGDLitModel(LitModel):
    """``LitModel`` trained with SGD and momentum. Its step is proportional to the gradient, so a gradient off by a
    constant factor (an average over the wrong number of ranks) shows in the parameters; Adam's step, normalised by
    the gradient's own magnitude, would hide it."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def lit_model(kind: str) -> LitModel:
    """The LightningModule the fits train for ``kind``: SGD for ``"uneven"``, AdamW (``LitModel``) otherwise."""
    return SGDLitModel(kind) if kind == "uneven" else LitModel(kind)


def _no_decay(name: str) -> bool:
    return name.endswith("bias") or ".ln" in name or ".norm" in name or "wpe" in name


def loader(kind: str, batch_size: int = 4) -> DataLoader:
    return DataLoader(make_dataset(kind), batch_size=batch_size, shuffle=False)
