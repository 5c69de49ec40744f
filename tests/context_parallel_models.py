"""The causal language model the context-parallel tests train: SDPA attention with separate query, key and value
projections (a tensor-parallel plan splits each by heads), learned position embeddings looked up by the
``position_ids`` the batch carries, so a part of the sequence sits where it belongs."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, HEADS, SEQ = 61, 32, 4, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no key bias: softmax ignores it, so its gradient is rounding noise that AdamW would amplify
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))  # B,nh,S,d
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CausalLM(nn.Module):
    def __init__(self, layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(4 * SEQ, DIM)
        self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        if tied:  # the embedding is the head's weight, as in GPT-2
            self.head.weight = self.wte.weight

    def forward(self, idx: Tensor, position_ids: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.wte(idx) + self.wpe(position_ids))))


def tensor_parallel_plan() -> dict[str, object]:
    """Heads split over the tensor-parallel ranks, the MLP by columns then rows (for each Block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}  # fmt: skip


def token_batches(steps: int, batch: int, seq: int = SEQ, seed: int = 1) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``steps`` global batches of (tokens, next tokens, position ids), each ``(batch, seq)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(VOCAB, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:], torch.arange(seq).expand(batch, seq)))
    return out


def lm_loss(model: nn.Module, x: Tensor, y: Tensor, position_ids: Tensor) -> Tensor:
    return F.cross_entropy(model(x, position_ids).flatten(0, 1), y.flatten())


class LitCausalLM(L.LightningModule):
    """``CausalLM`` on batches of (tokens, next tokens, position ids), as a user writes it: nothing in it knows of
    context parallelism. Records the loss ``training_step`` returns; SGD with momentum (its step is proportional to
    the gradient, so rounding-level gradients stay rounding-level weights)."""

    def __init__(self, tensor_parallel: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.tensor_parallel, self.tied = tensor_parallel, tied
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        self.model = CausalLM(tied=self.tied)
        if self.tensor_parallel:
            from torch.distributed.tensor.parallel import parallelize_module

            for block in self.model.blocks:
                parallelize_module(block, self.device_mesh["tensor_parallel"], tensor_parallel_plan())

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, position_ids = batch
        loss = lm_loss(self.model, x, y, position_ids)
        self.log("loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def token_loader(batch: int = 2, samples: int = 48, seq: int = SEQ) -> DataLoader:
    """(tokens, next tokens, position ids) of ``samples`` sequences, ``batch`` per data-parallel rank."""
    (x, y, pos), = token_batches(1, samples, seq)
    return DataLoader(TensorDataset(x, y, pos.contiguous()), batch_size=batch)


class LitLlama(LitCausalLM):
    """A Hugging Face Llama (grouped-query attention, rotary embeddings from ``position_ids``) through its SDPA
    attention. The attention mask of ones tells transformers the sequences are not packed: without one it reads the
    jumps in the load-balanced position ids as the starts of packed sequences."""

    def configure_model(self) -> None:
        import transformers

        if hasattr(self, "model"):
            return
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=4 * SEQ,
            tie_word_embeddings=False, attn_implementation="sdpa",
        )  # fmt: skip
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, position_ids = batch
        logits = self.model(input_ids=x, position_ids=position_ids, attention_mask=torch.ones_like(x)).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("loss", loss)
        self.losses.append(loss.item())
        return loss
