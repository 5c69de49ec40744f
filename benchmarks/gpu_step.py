"""On one GPU: a 1B-parameter GPT trained in bf16-mixed under ShardStrategy, under Lightning's
ModelParallelStrategy with PyTorch's fully_shard (FSDP2), and by a plain single-device Trainer; the same with the
model state offloaded to CPU memory (ShardStrategy(cpu_offload=True) against fully_shard's CPUOffloadPolicy); and
ShardStrategy with every block compiled (``block.compile()``) against eager blocks.

    python benchmarks/gpu_step.py                      # every variant once, fresh processes, a markdown table
    python benchmarks/gpu_step.py --variants single shard fully_shard --repeats 2

Median step time after warm-up (each step between two device synchronisations), peak allocated GPU memory
(``torch.cuda.max_memory_allocated``), peak resident host memory, and the first losses (the same weights and
batches in every variant, so they must agree to bf16 rounding). The GPT is the benchmarks' GPT (benchmarks/
peak_memory.py) at d=2048, 20 blocks, 16 heads, context 1024, vocabulary 32000: 1.08B parameters; 8 sequences a
step, AdamW. Results on the machine of record are in docs/benchmarks.md ("On one GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

D, LAYERS, HEADS, CTX, VOCAB, BATCH = 2048, 20, 16, 1024, 32000, 8
WARMUP, MEASURED = 3, 6
VARIANTS = {  # engine, offload, compiled
    "single": ("single", False, False),
    "shard": ("shard", False, False),
    "fully_shard": ("fully_shard", False, False),
    "shard_offload": ("shard", True, False),
    "fully_shard_offload": ("fully_shard", True, False),
    "shard_compiled": ("shard", False, True),
}
NAMES = {
    "single": "single device (Lightning, autocast)",
    "shard": "ShardStrategy",
    "fully_shard": "ModelParallelStrategy + fully_shard",
    "shard_offload": "ShardStrategy(cpu_offload=True)",
    "fully_shard_offload": "fully_shard + CPUOffloadPolicy",
    "shard_compiled": "ShardStrategy, blocks compiled",
}


def run_variant(variant: str, out: str) -> None:
    """One measurement in this (fresh) process."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, Dataset

    sys.path.insert(0, str(Path(__file__).parent))
    from peak_memory import GPT, Block

    from lightning_shard import ShardStrategy

    engine, offload, compiled = VARIANTS[variant]

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.randint(0, VOCAB, (CTX + 1,), generator=torch.Generator().manual_seed(i))

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.times: list[float] = []
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            # fully_shard's CPUOffloadPolicy wants the model built in CPU memory (the other engines build it on
            # the GPU, or on the meta device for ShardStrategy, as Lightning's init context says).
            with torch.device("cpu") if engine == "fully_shard" and offload else contextlib.nullcontext():
                self.model = GPT(D, LAYERS, HEADS, CTX, VOCAB)
            if compiled:
                for block in self.model.blocks:
                    block.compile()
            if engine == "fully_shard":
                from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

                kwargs: dict[str, Any] = {
                    "mesh": self.device_mesh["data_parallel"],
                    "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                }
                if offload:
                    kwargs["offload_policy"] = CPUOffloadPolicy()
                for block in self.model.blocks:
                    fully_shard(block, **kwargs)
                fully_shard(self.model, **kwargs)

        def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.model(idx[:, :-1]).flatten(0, 1).float(), idx[:, 1:].flatten())
            self.losses.append(loss.item())
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)
            if batch_idx == WARMUP - 1:
                torch.cuda.reset_peak_memory_stats()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    L.seed_everything(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    module = Module()
    strategy: Any = {
        "single": "auto",
        "shard": ShardStrategy(auto_wrap_policy={Block}, cpu_offload=offload),
        "fully_shard": ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
    }[engine]
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed",
                        max_steps=WARMUP + MEASURED, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, DataLoader(Tokens(), batch_size=BATCH))
    result = {
        "step_s": statistics.median(module.times[WARMUP:]),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "params": sum(p.numel() for p in module.model.parameters()),
        "losses": module.losses[:3],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    Path(out, f"{variant}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run_variant(args.variant, args.out)
        return
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    for _ in range(args.repeats):
        for variant in args.variants:
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, __file__, "--variant", variant, "--out", out]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{variant} failed:\n{done.stderr[-3000:]}", flush=True)
                    continue
                runs[variant].append(json.loads(Path(out, f"{variant}.json").read_text()))
                print(variant, json.dumps(runs[variant][-1]), flush=True)
    print(_table(runs))


def _table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    lines = [
        "| variant | step (s) | vs single device | peak GPU memory (GiB) | peak host memory (GiB) | first losses |",
        "|---|---|---|---|---|---|",
    ]
    for variant, results in runs.items():
        if not results:
            lines.append(f"| {NAMES[variant]} | failed | | | | |")
            continue
        step = median(variant, "step_s")
        ratio = f"{step / median('single', 'step_s'):.3f}x" if runs.get("single") else ""
        losses = ", ".join(f"{x:.4f}" for x in results[0]["losses"])
        lines.append(f"| {NAMES[variant]} | {step:.4f} | {ratio} | {median(variant, 'peak_gib'):.2f} |"
                     f" {median(variant, 'host_peak_gib'):.2f} | {losses} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
