"""Peak resident memory per rank: ShardStrategy's engine against PyTorch's fully_shard, meta-device init,
with and without activation checkpointing, and the two grad_sync modes under gradient accumulation.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/peak_memory.py

Each variant runs in fresh processes (2 gloo ranks, one thread each) so that peaks do not mix:
build a 25M-parameter GPT (d=512, 8 blocks, ctx 64) on the meta device, shard and initialise it,
then train 3 AdamW steps on batch 8 (the grad_sync variants: 4 micro-batches of 8 per step). The
peak is the process's maximum RSS minus its RSS after imports; MALLOC_MMAP_THRESHOLD_ makes freed
tensors go back to the OS so RSS follows live memory. Gradient-reduction bytes per optimizer step
are the engine's reduce-scatter input bytes, counted at lightning_shard.engine.collectives.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

D, LAYERS, HEADS, CTX, VOCAB, BATCH = 512, 8, 8, 64, 512, 8


class Block(nn.Module):
    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.heads
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The benchmarks' GPT: by default the 25M-parameter one (the sizes above); scaling.py builds larger ones."""

    def __init__(
        self, d: int = D, layers: int = LAYERS, heads: int = HEADS, ctx: int = CTX, vocab: int = VOCAB
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Tokens(torch.utils.data.Dataset):
    """Random token windows of CTX + 1 (inputs and next-token targets), the same for every engine and run."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (CTX + 1,), generator=torch.Generator().manual_seed(i))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


VARIANTS = {
    "shard": {},
    "shard + activation checkpointing": {"checkpointing": True},
    "fully_shard": {"fully_shard": True},
    "shard, accumulate 4, grad_sync=microbatch": {"accumulate": 4},
    "shard, accumulate 4, grad_sync=step": {"accumulate": 4, "hold": True},
}


def _worker(rank: int, variant: str, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    options = VARIANTS[variant]
    # Both engines' imports happen before the baseline, so only model state and activations are measured.
    from torch.distributed.fsdp import fully_shard

    from lightning_shard.engine import collectives
    from lightning_shard.engine.activation_checkpointing import apply_activation_checkpointing
    from lightning_shard.engine.mesh import build_shard_mesh
    from lightning_shard.engine.option_choices import ShardingStrategy
    from lightning_shard.engine.policies import resolve_wrap_policy
    from lightning_shard.engine.sharded_module import shard_module

    baseline = _rss_mb()
    with torch.device("meta"):
        model = GPT()
    engine = None
    if options.get("fully_shard"):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    else:
        strategy, policy = ShardingStrategy.FULL_SHARD, resolve_wrap_policy({Block})
        engine = shard_module(model, build_shard_mesh(strategy, None), strategy, policy, torch.device("cpu"))
        if options.get("checkpointing"):
            apply_activation_checkpointing(model, policy)
    reduced_before = collectives.STATS.reduce_bytes  # the engine's gradient reductions (input bytes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    accumulate = options.get("accumulate", 1)
    for _ in range(3):
        for micro in range(accumulate):
            if engine is not None:  # what ShardStrategy.block_backward_sync does for grad_sync="step"
                engine.hold_gradients(bool(options.get("hold")) and micro < accumulate - 1)
            idx = torch.randint(0, VOCAB, (BATCH, CTX + 1), generator=g)
            loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reduced = collectives.STATS.reduce_bytes - reduced_before
    out.put((rank, peak - baseline, reduced / 3 / 2**20))
    dist.destroy_process_group()


def run_once(variant: str, port: int) -> list[tuple[float, float]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, variant, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {rank: (peak, reduced) for rank, peak, reduced in (out.get(timeout=900) for _ in procs)}
    for p in procs:
        p.join()
    return [results[r] for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=list(VARIANTS))
    parser.add_argument("--port", type=int, default=29600)
    args = parser.parse_args()
    if args.variant:  # one measurement in this fresh process: "peak reduce_mib_per_step"
        results = run_once(args.variant, args.port)
        print(max(p for p, _ in results), results[0][1])
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    peaks: dict[str, list[float]] = {v: [] for v in VARIANTS}
    reduced: dict[str, float] = {}
    port = args.port
    for _ in range(args.repeats):  # alternate, so drift on a shared machine hits every variant alike
        for variant in VARIANTS:
            port += 1
            cmd = [sys.executable, __file__, "--variant", variant, "--port", str(port)]
            peak, mib = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()[-2:]
            peaks[variant].append(float(peak))
            reduced[variant] = float(mib)
    model_mb = sum(p.numel() for p in GPT().parameters()) * 4 / 2**20
    print(f"GPT: {model_mb:.1f} MiB of fp32 parameters; 2 ranks; peak RSS above baseline per rank (max of ranks)")
    print("| variant | median peak (MiB) | runs | engine's gradient reduce-scatter MiB per optimizer step |")
    print("|---|---|---|---|")
    for variant, values in peaks.items():
        runs = ", ".join(f"{v:.0f}" for v in values)
        counted = "(not counted)" if VARIANTS[variant].get("fully_shard") else f"{reduced[variant]:.0f}"
        print(f"| {variant} | {statistics.median(values):.0f} | {runs} | {counted} |")


if __name__ == "__main__":
    main()
