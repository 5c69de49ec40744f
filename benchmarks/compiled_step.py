"""Compiled blocks against eager ones under ShardStrategy, on the 25M-parameter GPT of step_time.py: median step
time and the largest difference of the losses step by step.

    .venv/bin/python benchmarks/compiled_step.py --repeats 3     # writes docs/benchmarks.md's "Compiled blocks" table
    .venv/bin/python benchmarks/compiled_step.py --engines shard ddp single --repeats 2 --no-write

The model, data and settings are step_time.py's (d=512, 8 blocks, ctx 64, vocab 512, batch 8 per rank, AdamW,
"32-true", 2 gloo ranks with one thread each). "compiled" calls ``block.compile()`` (inductor, default settings)
on every block in ``configure_model``; "eager" does not. Both start from the same weights and see the same
batches, so their losses are comparable step by step. The first steps of a compiled run compile (and the
warm-up steps are left out of the timing); the graphs compiled after the warm-up are counted, and must be none.
Runs alternate in fresh processes, ``--repeats`` times; every figure is the median over repeats. ``--engines`` adds
the same comparison under Lightning's DDP ("ddp", 2 ranks) and in one process ("single", one rank's batch on the
whole model): what compiling gains without any sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ["eager", "compiled"]
ENGINES = ["shard", "ddp", "single"]
ENGINE_NAMES = {"shard": "ShardStrategy", "ddp": "DDP", "single": "one process"}
WARMUP, MEASURED = 3, 8
ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "<!-- compiled-step table start -->", "<!-- compiled-step table end -->"


def run_mode(mode: str, out_dir: str, engine: str = "shard") -> None:
    """One measurement, run by Lightning's launcher on every rank (this script is re-executed for rank 1)."""
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(Path(__file__).parent))
    from peak_memory import BATCH, GPT, Block, Tokens

    from lightning_shard import ShardStrategy

    torch.set_num_threads(1)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.times: list[float] = []
            self.losses: list[float] = []
            self.graphs_after_warmup = 0

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = GPT()
            if mode == "compiled":
                for block in self.model.blocks:
                    block.compile()

        def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            self.losses.append(loss.item())
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == WARMUP:
                self.graphs_after_warmup = -counters["stats"]["unique_graphs"]
            if dist.is_initialized():
                dist.barrier()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._t0)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    L.seed_everything(0)
    module = Module()
    if engine == "shard":
        strategy: Any = ShardStrategy(auto_wrap_policy={Block})
    else:
        strategy = "ddp" if engine == "ddp" else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=1 if engine == "single" else 2, strategy=strategy,
                        max_steps=WARMUP + MEASURED, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, precision="32-true")
    trainer.fit(module, DataLoader(Tokens(), batch_size=BATCH, num_workers=0))
    result = {
        "step_time": statistics.median(module.times[WARMUP:]),
        "losses": module.losses,
        "graphs_after_warmup": module.graphs_after_warmup + counters["stats"]["unique_graphs"],
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=["shard"])
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--engine", choices=ENGINES, default="shard")
    parser.add_argument("--out")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.mode:
        run_mode(args.mode, args.out, args.engine)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no MALLOC_* variables: each engine's own allocator settings
    runs: dict[tuple[str, str], list[list[dict[str, Any]]]] = {(e, m): [] for e in args.engines for m in MODES}
    for _ in range(args.repeats):
        for engine, mode in runs:
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, __file__, "--mode", mode, "--engine", engine, "--out", out]
                subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               cwd=ROOT)
                runs[engine, mode].append([json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))])
    table = _table(runs, args.engines)
    print(table)
    if not args.no_write:
        _write(table, args.repeats)


def _table(runs: dict[tuple[str, str], list[list[dict[str, Any]]]], engines: list[str]) -> str:
    """One row per engine and mode: median step (slowest rank of each run), ratio to the same engine's eager step,
    graphs compiled after warm-up, and the largest loss difference to the same engine's eager run of the same
    repeat, over ranks and steps."""
    lines = ["| engine | blocks | median step (s) | vs eager | graphs compiled after warm-up"
             " | max loss difference to eager |", "|---|---|---|---|---|---|"]
    for engine in engines:
        step = {m: statistics.median(max(r["step_time"] for r in ranks) for ranks in runs[engine, m]) for m in MODES}
        diffs = [
            max(abs(a - b) for c, e in zip(compiled, eager) for a, b in zip(c["losses"], e["losses"]))
            for compiled, eager in zip(runs[engine, "compiled"], runs[engine, "eager"])
        ]
        for mode in MODES:
            graphs = max(r["graphs_after_warmup"] for ranks in runs[engine, mode] for r in ranks)
            diff = "0 (reference)" if mode == "eager" else f"{max(diffs):.1e}"
            lines.append(f"| {ENGINE_NAMES[engine]} | {mode} | {step[mode]:.3f} | {step[mode] / step['eager']:.2f}x"
                         f" | {graphs} | {diff} |")
    return "\n".join(lines)


def _write(table: str, repeats: int) -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    stamp = time.strftime("%Y-%m-%d")
    block = (f"{TABLE_START}\nMeasured {stamp}, medians of {repeats} alternating runs,"
             f" {WARMUP + MEASURED} steps each ({MEASURED} timed):\n\n{table}\n{TABLE_END}")
    if TABLE_START not in text:
        raise SystemExit(f"docs/benchmarks.md has no {TABLE_START} marker: add the 'Compiled blocks' section first.")
    text = text[: text.index(TABLE_START)] + block + text[text.index(TABLE_END) + len(TABLE_END) :]
    doc.write_text(text)


if __name__ == "__main__":
    main()
