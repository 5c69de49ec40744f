"""Side by side on the 25M-parameter GPT: ShardStrategy, DDPStrategy, ModelParallelStrategy with PyTorch's
fully_shard (per block and root), and a single process. Median step time after warm-up, peak RSS per rank above
the interpreter-and-libraries baseline, collective bytes per step, and the step split into forward (to the end of
``training_step``), backward (to ``on_after_backward``, the engine's last reduction included) and the rest (the
optimizer step and Lightning's bookkeeping), each the median over steps of the slowest rank.

    .venv/bin/python benchmarks/step_time.py --repeats 3            # writes docs/benchmarks.md's table and a PNG

The model is d=512, 8 blocks, ctx 64, vocab 512, batch 8 per rank, AdamW, "32-true", 2 gloo ranks with one
thread each (the single process: one rank, same per-rank batch). Engines run in fresh processes, alternating,
``--repeats`` times; every figure is the median over repeats. Run with nothing else busy on the machine.
The PNG needs matplotlib (``pip install -c constraints.txt -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINES = ["shard", "ddp", "fully_shard", "single"]
WARMUP, MEASURED = 3, 8
PHASES = ["forward", "backward", "optimizer"]
ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "<!-- step-time table start -->", "<!-- step-time table end -->"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_engine(engine: str, out_dir: str) -> None:
    """One measurement, run by Lightning's launcher on every rank (this script is re-executed for rank 1)."""
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(Path(__file__).parent))
    from peak_memory import BATCH, GPT, Block, Tokens

    from lightning_shard import ShardStrategy
    from lightning_shard.engine import collectives

    torch.set_num_threads(1)
    baseline = _rss_mb()
    counted = {"bytes": 0}
    _count_collectives(dist, counted)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None
            self.times: list[float] = []
            self.phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer step (and the rest)

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = GPT()
            if engine == "fully_shard":
                from torch.distributed.fsdp import fully_shard

                for block in self.model.blocks:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = F.cross_entropy(self.model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            self._t_forward = time.perf_counter()
            return loss

        def on_after_backward(self) -> None:
            self._t_backward = time.perf_counter()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == WARMUP:
                counted["bytes"] = 0
                counted["engine_bytes"] = collectives.STATS.all_gather_bytes + collectives.STATS.reduce_bytes
            if dist.is_initialized():
                dist.barrier()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            end = time.perf_counter()
            self.times.append(end - self._t0)
            self.phases.append((self._t_forward - self._t0, self._t_backward - self._t_forward, end - self._t_backward))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    strategy: Any = {
        "shard": lambda: ShardStrategy(auto_wrap_policy={Block}),
        "ddp": lambda: DDPStrategy(),
        "fully_shard": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        "single": lambda: "auto",
    }[engine]()
    L.seed_everything(0)
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=1 if engine == "single" else 2, strategy=strategy,
                        max_steps=WARMUP + MEASURED, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, precision="32-true")
    trainer.fit(module, DataLoader(Tokens(), batch_size=BATCH, num_workers=0))
    moved = counted["bytes"] / MEASURED
    if engine == "shard":  # on gloo its exchanges are point-to-point: count them where the engine issues them
        engine_bytes = collectives.STATS.all_gather_bytes + collectives.STATS.reduce_bytes - counted["engine_bytes"]
        moved = engine_bytes / MEASURED
    if engine == "ddp":  # DDP's reducer all-reduces from C++, out of the Python wrappers' sight: every gradient once
        moved = sum(p.numel() * p.element_size() for p in module.parameters())
    result = {
        "step_time": statistics.median(module.times[WARMUP:]),
        **{f"{phase}_time": statistics.median(p[i] for p in module.phases[WARMUP:]) for i, phase in enumerate(PHASES)},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline,
        "bytes_per_step": moved,
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _count_collectives(dist: Any, counted: dict[str, int]) -> None:
    """Count the bytes each collective moves into or out of this rank's buffers."""

    def wrap(name: str, size_of: Any) -> None:
        original = getattr(dist, name, None)
        if original is None:
            return

        def counting(*args: Any, **kwargs: Any) -> Any:
            counted["bytes"] += size_of(*args, *kwargs.values())
            return original(*args, **kwargs)

        setattr(dist, name, counting)

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size()

    wrap("all_gather_single", lambda out, inp, *rest: nbytes(out))
    wrap("all_gather_into_tensor", lambda out, inp, *rest: nbytes(out))
    wrap("reduce_scatter_single", lambda out, inp, *rest: nbytes(inp))
    wrap("reduce_scatter_tensor", lambda out, inp, *rest: nbytes(inp))
    wrap("all_reduce", lambda t, *rest: nbytes(t))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--out")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()
    if args.engine:
        run_engine(args.engine, args.out)
        return
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    for engine, ranks in run_alternating(__file__, ENGINES, args.repeats):
        runs[engine].append({
            "step_time": max(r["step_time"] for r in ranks),
            **{f"{phase}_time": max(r[f"{phase}_time"] for r in ranks) for phase in PHASES},
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "bytes_per_step": max(r["bytes_per_step"] for r in ranks),
        })
    table = _table(runs)
    print(table)
    if not args.no_write:
        _write(table, runs)


def run_alternating(script: str, engines: list[str], repeats: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """Run ``script --engine E --out DIR`` for each engine in turn, ``repeats`` times, each in fresh processes with one
    thread per rank (and no MALLOC_* variables: each engine's own allocator settings); every run's per-rank results
    (``DIR/rank*.json``), in run order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for _ in range(repeats):
        for engine in engines:
            with tempfile.TemporaryDirectory() as out:
                subprocess.run([sys.executable, script, "--engine", engine, "--out", out], env=env, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
                results.append((engine, [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]))
    return results


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _table(runs: dict[str, list[dict[str, float]]]) -> str:
    ddp, fsdp = _median(runs["ddp"], "step_time"), _median(runs["fully_shard"], "step_time")
    lines = [
        "| engine | median step (s) | vs DDP | vs fully_shard | forward / backward / optimizer step (s)"
        " | peak RSS above baseline (MiB) | collective MiB per step |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"shard": "ShardStrategy", "ddp": "DDPStrategy", "fully_shard": "ModelParallelStrategy + fully_shard",
             "single": "single process"}
    for engine, values in runs.items():
        step = _median(values, "step_time")
        phases = " / ".join(f"{_median(values, phase + '_time'):.3f}" for phase in PHASES)
        lines.append(
            f"| {names[engine]} | {step:.3f} | {step / ddp:.2f}x | {step / fsdp:.2f}x |"
            f" {phases} |"
            f" {_median(values, 'peak_rss_mb'):.0f} | {_median(values, 'bytes_per_step') / 2**20:.0f} |"
        )
    return "\n".join(lines)


def _write(table: str, runs: dict[str, list[dict[str, float]]]) -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    stamp = time.strftime("%Y-%m-%d")
    repeats = len(runs["shard"])
    block = f"{TABLE_START}\nMeasured {stamp}, medians of {repeats} alternating runs:\n\n{table}\n{TABLE_END}"
    if TABLE_START in text:
        text = text[: text.index(TABLE_START)] + block + text[text.index(TABLE_END) + len(TABLE_END) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG written")
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    labels = list(runs)
    for ax, (key, title, scale) in zip(axes, [("step_time", "median step (s)", 1), ("peak_rss_mb",
                                              "peak RSS above baseline (MiB)", 1),
                                             ("bytes_per_step", "collective MiB per step", 2**20)]):
        ax.bar(labels, [_median(runs[e], key) / scale for e in labels], color=["#3b7dd8", "#999", "#d8893b", "#5a5"])
        ax.set_title(title)
    fig.suptitle("25M-parameter GPT, 2 gloo ranks, batch 8 per rank, AdamW, fp32")
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "benchmarks_step_time.png", dpi=90)


if __name__ == "__main__":
    main()
