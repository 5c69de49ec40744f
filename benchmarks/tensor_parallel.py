"""Tensor parallelism with sharding at (dp=2, tp=2) on 4 CPU ranks: ShardStrategy(tensor_parallel_size=2) against
Lightning's ModelParallelStrategy + fully_shard with the same tensor-parallel plan (the GPT and plan of
tests/scripts/tensor_parallel_fit.py). Median step time after warm-up (the slowest rank's) and peak RSS per rank
above the interpreter-and-libraries baseline, each the median over repeats; engines in fresh processes under Lightning's
launcher, alternating.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tensor_parallel.py --repeats 3

The model: width 256, 4 blocks, 8 heads, ctx 64, vocab 512 (3.4M parameters), batch 8 per data-parallel rank,
AdamW, "32-true", one thread per rank, no gradient clipping (ModelParallelStrategy cannot clip this model: its
parameters lie on two meshes). Run with nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ["shard", "model_parallel"]
WARMUP, MEASURED = 3, 8
WIDTH, DEPTH, HEADS, VOCAB, CTX, BATCH = 256, 4, 8, 512, 64, 8
ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_engine(engine: str, out_dir: str) -> None:
    """One measurement, run by Lightning's launcher on every rank (this script is re-executed for ranks 1-3)."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from tensor_parallel_fit import GPT, Block, apply_plan

    from lightning_shard import ShardStrategy

    torch.set_num_threads(1)
    baseline = _rss_mb()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: Any = None
            self.times: list[float] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = apply_plan(GPT(WIDTH, DEPTH, HEADS, VOCAB, CTX), self.device_mesh["tensor_parallel"])
            if engine == "model_parallel":
                from torch.distributed.fsdp import fully_shard

                for block in self.model.blocks:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self.model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            torch.distributed.barrier()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._t0)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    strategy: Any = (
        ShardStrategy(auto_wrap_policy={Block}, tensor_parallel_size=2) if engine == "shard"
        else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    )
    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH * 2 * (WARMUP + MEASURED), CTX + 1), generator=g)
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=WARMUP + MEASURED, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(tokens, batch_size=BATCH))
    result = {
        "step_time": statistics.median(module.times[WARMUP:]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline,
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.engine:
        run_engine(args.engine, args.out)
        return
    from step_time import run_alternating

    runs: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    for engine, ranks in run_alternating(__file__, ENGINES, args.repeats):
        runs[engine].append({key: max(r[key] for r in ranks) for key in ("step_time", "peak_rss_mb")})
    print("| engine | median step (s) | peak RSS above baseline per rank (MiB) |")
    print("|---|---|---|")
    names = {"shard": "ShardStrategy(tensor_parallel_size=2)", "model_parallel": "ModelParallelStrategy + fully_shard"}
    for engine, values in runs.items():
        step = statistics.median(v["step_time"] for v in values)
        rss = statistics.median(v["peak_rss_mb"] for v in values)
        print(f"| {names[engine]} | {step:.4f} | {rss:.0f} |")
    print("raw:", json.dumps(runs))


if __name__ == "__main__":
    main()
