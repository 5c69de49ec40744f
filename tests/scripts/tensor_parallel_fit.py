"""Tensor parallelism composed with sharding, run the way a user runs it: fresh scripts under Lightning's launcher
(``python``), where ``ShardStrategy`` itself creates the process group. Each role is one launch, in this order:

    python tests/scripts/tensor_parallel_fit.py --role reference --devices 2 --root /tmp/tp   # DDP, the oracle
    python tests/scripts/tensor_parallel_fit.py --role tp --devices 4 --root /tmp/tp          # (dp=2, tp=2)
    python tests/scripts/tensor_parallel_fit.py --role resume --devices 2 --root /tmp/tp      # at (2, 1) and (1, 2)

(``tests/test_tensor_parallel.py`` calls ``run(root, "reference")`` on its pooled ranks instead: the oracle needs no
fresh process.)

``reference`` (DDP): our GPT for 8 steps in fp32 and 4 in bf16-mixed (Trainer), 4 steps in Fabric, Hugging Face Llama
for 3 steps; the Trainer and Fabric with ShardStrategy and the model built on the meta device (``trainer_meta``,
``fabric_meta``); and ShardStrategy at (dp=2, tp=1) for 3 steps in fp32, saved to ``<root>/tp1-ckpt``. ``tp``
(ShardStrategy, ``tensor_parallel_size=2``; each LightningModule applies its plan on
``self.device_mesh["tensor_parallel"]`` in ``configure_model``, as under ModelParallelStrategy without
``fully_shard``): the same fits (fp32 for 3 steps, then a checkpoint to ``<root>/tp-ckpt``), Fabric with
``parallelize_fn``, both also with the model built on the meta device (``trainer_meta``, ``fabric_meta``), Llama with
the plan its config carries, Lightning's ModelParallelStrategy + ``fully_shard`` with the same plan for 3 steps, and
``<root>/tp1-ckpt`` resumed at (2, 2) up to step 8 (``back``). ``resume``: ``<root>/tp-ckpt`` resumed at (2, 1)
(``tp1``) and at (1, 2) (``dp1``), each up to step 6.
Every rank writes ``<root>/<name>-<rank>.pt`` for each role (``back``, ``tp1`` and ``dp1`` on their own): the losses
of each fit, each the mean over the global batch (what every rank logs).
"""

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning_shard  # noqa: E402
import lightning_shard.fabric  # noqa: E402

GLOBAL_BATCH = 8
VOCAB, CTX, WIDTH, HEADS = 48, 8, 32, 4


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections: a tensor-parallel plan splits them by heads."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 2, heads: int = HEADS, vocab: int = VOCAB, ctx: int = CTX):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(ctx, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


def apply_plan(model: GPT, tp_mesh: Any) -> GPT:
    """Attention split by heads, the MLP by its hidden units; embeddings, norms and the head stay replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()}  # fmt: skip
        parallelize_module(block, tp_mesh, plan)
    return model


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=CTX)  # fmt: skip
    return LlamaForCausalLM(config)


class LitModel(L.LightningModule):
    """Our GPT or Hugging Face Llama; with a ``device_mesh`` of tensor-parallel size > 1 its plan is applied (and
    ``fully_shard`` too under Lightning's ModelParallelStrategy)."""

    def __init__(self, kind: str = "gpt", fully_shard: bool = False, meta: bool = False) -> None:
        super().__init__()
        self.kind, self.fully_shard, self.meta = kind, fully_shard, meta
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        with torch.device("meta") if self.meta else nullcontext():
            self.model = GPT() if self.kind == "gpt" else llama()
        mesh = self._device_mesh
        if mesh is None or mesh["tensor_parallel"].size() == 1:
            return
        if self.kind == "gpt":
            apply_plan(self.model, mesh["tensor_parallel"])
        else:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(self.model, mesh["tensor_parallel"],
                               lightning_shard.hf_tensor_parallel_plan(self.model))  # fmt: skip
        if self.fully_shard:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.kind == "gpt":
            logits = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        else:
            loss = self.model(input_ids=x, labels=x).loss  # the next-token loss (transformers shifts the labels)
        self.losses.append(global_mean(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def global_mean(loss: Tensor) -> float:
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def dataset() -> TensorDataset:
    """One global batch: each epoch is one step, so a resumed fit sees what the uninterrupted one saw."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, CTX + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def trainer_fit(strategy: Any, data_parallel: int, steps: int, kind: str = "gpt", precision: str = "32-true",
                resume: Path | None = None, save: Path | None = None, fully_shard: bool = False,
                clip: float | None = 0.5, meta: bool = False) -> list[float]:
    L.seed_everything(0, verbose=False)
    module = LitModel(kind, fully_shard, meta)
    trainer = L.Trainer(
        accelerator="cpu", devices=dist.get_world_size() if dist.is_initialized() else ARGS.devices,
        strategy=strategy, max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision=precision, gradient_clip_val=clip,
    )  # fmt: skip
    data = DataLoader(dataset(), batch_size=GLOBAL_BATCH // data_parallel)
    trainer.fit(module, train_dataloaders=data, ckpt_path=str(resume) if resume else None)
    if save is not None:
        trainer.save_checkpoint(save)
    return module.losses


def fabric_fit(strategy: Any, data_parallel: int, steps: int = 4, empty_init: bool = False) -> list[float]:
    fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=empty_init):
        model = GPT()
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = dataset().tensors
    rank = fabric.global_rank // (fabric.world_size // data_parallel)  # the data-parallel rank
    local = GLOBAL_BATCH // data_parallel
    losses = []
    for _ in range(steps):
        logits = model(x[rank * local : (rank + 1) * local])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y[rank * local : (rank + 1) * local].reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(loss))
    return losses


def ours(tp: int, kind: str = "gpt") -> lightning_shard.ShardStrategy:
    block = Block if kind == "gpt" else "LlamaDecoderLayer"
    return lightning_shard.ShardStrategy(auto_wrap_policy={block}, tensor_parallel_size=tp)


def run(root: Path, role: str) -> dict[str, dict[str, Any]]:
    """What each file ``<root>/<name>-<rank>.pt`` holds, by name."""
    out: dict[str, Any] = {}
    if role == "reference":
        out["fp32"] = trainer_fit("ddp", 2, 8)
        out["bf16"] = trainer_fit("ddp", 2, 4, precision="bf16-mixed")
        out["llama"] = trainer_fit("ddp", 2, 3, kind="llama")
        out["fabric"] = fabric_fit("ddp", 2)
        # Built on the meta device: the strategy initialises it (reset_parameters()), whatever the sizes.
        out["trainer_meta"] = trainer_fit(ours(1), 2, 3, meta=True)
        meta = lightning_shard.fabric.ShardStrategy(auto_wrap_policy={Block})
        out["fabric_meta"] = fabric_fit(meta, 2, empty_init=True)
        trainer_fit(ours(1), 2, 3, save=root / "tp1-ckpt")  # for the tp role to resume at (2, 2)
        return {"reference": out}
    if role == "tp":
        out["fp32"] = trainer_fit(ours(2), 2, 3, save=root / "tp-ckpt")
        out["bf16"] = trainer_fit(ours(2), 2, 4, precision="bf16-mixed")
        out["llama"] = trainer_fit(ours(2, "llama"), 2, 3, kind="llama")
        out["trainer_meta"] = trainer_fit(ours(2), 2, 3, meta=True)
        from lightning.pytorch.strategies import ModelParallelStrategy

        # Unclipped: ModelParallelStrategy cannot clip a model whose parameters lie on two meshes (torch's
        # clip_grad_norm_ refuses to stack norms of DTensors over the 2-D and the 1-D mesh).
        out["unclipped"] = trainer_fit(ours(2), 2, 3, clip=None)
        mp = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        out["model_parallel"] = trainer_fit(mp, 2, 3, fully_shard=True, clip=None)

        def parallelize(module: nn.Module, mesh: Any) -> nn.Module:
            return apply_plan(module, mesh["tensor_parallel"])  # type: ignore[arg-type]

        def fabric_strategy() -> lightning_shard.fabric.ShardStrategy:
            return lightning_shard.fabric.ShardStrategy(
                auto_wrap_policy={Block}, tensor_parallel_size=2, parallelize_fn=parallelize
            )

        out["fabric"] = fabric_fit(fabric_strategy(), 2)
        out["fabric_meta"] = fabric_fit(fabric_strategy(), 2, empty_init=True)
        back = trainer_fit(ours(2), 2, 8, resume=root / "tp1-ckpt")
        return {"tp": out, "back": {"fp32": back}}
    # One process group, two meshes in turn: each fit's strategy builds its own.
    tp1 = trainer_fit(ours(1), 2, 6, resume=root / "tp-ckpt")
    dp1 = trainer_fit(ours(2), 1, 6, resume=root / "tp-ckpt")
    return {"tp1": {"fp32": tp1}, "dp1": {"fp32": dp1}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["reference", "tp", "resume"], required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    ARGS = parser.parse_args()
    torch.set_num_threads(1)
    created = not dist.is_initialized()
    ARGS.root.mkdir(parents=True, exist_ok=True)
    for name, result in run(ARGS.root, ARGS.role).items():
        torch.save({**result, "created": created}, ARGS.root / f"{name}-{dist.get_rank()}.pt")
