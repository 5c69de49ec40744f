"""torch's Muon under sharding, on the 25M-parameter GPT: ShardStrategy with AdamW, ShardStrategy with Muon on the
blocks' matrices and AdamW on the rest, and PyTorch's fully_shard (per block and root, through Lightning's
ModelParallelStrategy) with the same split. Median step time after warm-up, the step split into forward, backward
and optimizer step, peak RSS per rank above the interpreter-and-libraries baseline, and where the Muon step's time
goes (the Newton-Schulz orthogonalisation; under ShardStrategy also the two row exchanges and the all-gather of the
state's layout).

    .venv/bin/python benchmarks/muon_step.py --repeats 3                 # prints the markdown tables
    .venv/bin/python benchmarks/muon_step.py --repeats 1 --layers 2 --warmup 1 --steps 2   # a quick check

The model is d=512, 8 blocks, ctx 64, vocab 512, batch 8 per rank, "32-true", 2 gloo ranks with one thread each
(benchmarks/step_time.py's setting). Muon is torch's own, with its defaults (Newton-Schulz in bfloat16, 5 steps),
lr 0.02, on every 2-D weight of the blocks; AdamW (lr 3e-4) takes the embeddings, the head, the norms and the
biases, as torch's documentation advises. All engines use manual optimization, so that the three phases are timed
the same way: forward (to the loss), backward (``manual_backward``, the engine's last reduction included),
optimizer (every optimizer's ``step`` and ``zero_grad``). Engines run in fresh processes, alternating,
``--repeats`` times; every figure is the median over repeats of the slower rank's median over the measured steps.
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

ENGINES = ["shard_adamw", "shard_muon", "fully_shard_muon"]
NAMES = {
    "shard_adamw": "(a) ShardStrategy + AdamW",
    "shard_muon": "(b) ShardStrategy + Muon/AdamW",
    "fully_shard_muon": "(c) ModelParallelStrategy + fully_shard + Muon/AdamW",
}
PHASES = ["forward", "backward", "optimizer"]
# Inside the Muon step: the orthogonalisation (both engines), and ShardStrategy's whole-tensor step around it.
PARTS = ["newton_schulz", "gather", "layouts", "scatter"]
ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_engine(engine: str, out_dir: str, layers: int, warmup: int, measured: int) -> None:
    """One measurement, run by Lightning's launcher on every rank (this script is re-executed for rank 1)."""
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(Path(__file__).parent))
    from peak_memory import BATCH, GPT, Block, Tokens

    from lightning_shard import ShardStrategy

    torch.set_num_threads(1)
    baseline = _rss_mb()
    spent = _time_muon_parts()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.model: torch.nn.Module | None = None
            self.times: list[float] = []
            self.phases: list[tuple[float, float, float]] = []  # forward, backward, optimizer step (and the rest)
            self.muon: list[float] = []  # the Muon optimizer's step alone
            self.parts: list[dict[str, float]] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = GPT(layers=layers)
            if engine == "fully_shard_muon":
                from torch.distributed.fsdp import fully_shard

                for block in self.model.blocks:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if dist.is_initialized():
                dist.barrier()
            spent.clear()
            self._t0 = time.perf_counter()

        def training_step(self, idx: torch.Tensor, batch_idx: int) -> None:
            loss = F.cross_entropy(self.model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            self._t_forward = time.perf_counter()
            self.manual_backward(loss)
            self._t_backward = time.perf_counter()
            optimizers = self.optimizers()
            self._t_muon = 0.0
            for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
                start = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad()
                if isinstance(optimizer.optimizer, torch.optim.Muon):
                    self._t_muon = time.perf_counter() - start

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            end = time.perf_counter()
            self.times.append(end - self._t0)
            self.phases.append((self._t_forward - self._t0, self._t_backward - self._t_forward, end - self._t_backward))
            self.muon.append(self._t_muon)
            self.parts.append(dict(spent))

        def configure_optimizers(self) -> Any:
            if engine == "shard_adamw":
                return torch.optim.AdamW(self.model.parameters(), lr=3e-4)
            # torch's advice: Muon for the hidden layers' 2-D weights, AdamW for embeddings, head, norms, biases.
            named = list(self.model.named_parameters())
            hidden = [p for n, p in named if p.ndim == 2 and "blocks." in n]
            rest = [p for n, p in named if not (p.ndim == 2 and "blocks." in n)]
            assert len(hidden) == 4 * layers, f"expected 4 matrices per block, found {[n for n, _ in named]}"
            return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4)]

    strategy: Any = {
        "shard_adamw": lambda: ShardStrategy(auto_wrap_policy={Block}),
        "shard_muon": lambda: ShardStrategy(auto_wrap_policy={Block}),
        "fully_shard_muon": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    }[engine]()
    L.seed_everything(0)
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=warmup + measured, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision="32-true")
    trainer.fit(module, DataLoader(Tokens(), batch_size=BATCH, num_workers=0))
    after = slice(warmup, None)
    result = {
        "step_time": statistics.median(module.times[after]),
        **{f"{phase}_time": statistics.median(p[i] for p in module.phases[after]) for i, phase in enumerate(PHASES)},
        "muon_time": statistics.median(module.muon[after]),
        **{part: statistics.median(p.get(part, 0.0) for p in module.parts[after]) for part in PARTS},
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - baseline,
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _time_muon_parts() -> dict[str, float]:
    """Wrap torch's Newton-Schulz and the whole-tensor step's gather, layout all-gather and scatter with timers
    (wall time, summed per step into the returned dict, which ``on_train_batch_start`` clears). The scatter's figure
    includes the layout all-gather, which runs inside it; ``_muon_table`` subtracts it."""
    import torch.optim._muon as muon

    from lightning_shard.engine import whole_tensor_step as whole

    spent: dict[str, float] = {}

    def timed(module: Any, name: str, part: str) -> None:
        original = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - start

        setattr(module, name, wrapper)

    timed(muon, "_zeropower_via_newtonschulz", "newton_schulz")
    timed(whole, "_gather_to_owners", "gather")
    timed(whole, "_state_layouts", "layouts")
    timed(whole, "_scatter_from_owners", "scatter")
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8, help="blocks of the GPT (8: the 25M-parameter one)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="measured steps after the warm-up")
    parser.add_argument("--engine", choices=ENGINES)
    parser.add_argument("--out")
    args = parser.parse_args()
    sizes = ["--layers", str(args.layers), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    if args.engine:
        run_engine(args.engine, args.out, args.layers, args.warmup, args.steps)
        return
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in ENGINES}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(args.repeats):  # alternate, so drift on a shared machine hits every engine alike
        for engine in ENGINES:
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, __file__, "--engine", engine, "--out", out, *sizes]
                done = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True)
                if done.returncode != 0:
                    sys.exit(f"{engine} failed:\n{done.stderr[-4000:]}")
                ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
            runs[engine].append(_slower_rank(ranks))
    print(_table(runs))
    print()
    print(_muon_table(runs))


def _slower_rank(ranks: list[dict[str, float]]) -> dict[str, float]:
    """Each figure of the slower (or larger) rank. The parts of the Muon step come from the rank that reached the
    layout all-gather last (it waits least there, so its parts are its own work, and they add up to its Muon step);
    ``waited`` is how long the other rank waited there for it."""
    last = min(ranks, key=lambda r: (r["layouts"], -r["muon_time"]))
    figures = {key: max(r[key] for r in ranks) for key in ranks[0]} | {part: last[part] for part in PARTS}
    return figures | {"waited": max(r["layouts"] for r in ranks) - last["layouts"]}


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _table(runs: dict[str, list[dict[str, float]]]) -> str:
    lines = [
        "| engine | median step (s) | forward / backward / optimizer step (s) | of which Muon's step (s)"
        " | peak RSS above baseline (MiB) | runs (s) |",
        "|---|---|---|---|---|---|",
    ]
    for engine, values in runs.items():
        phases = " / ".join(f"{_median(values, phase + '_time'):.3f}" for phase in PHASES)
        muon = f"{_median(values, 'muon_time'):.3f}" if engine != "shard_adamw" else "-"
        each = ", ".join(f"{v['step_time']:.3f}" for v in values)
        lines.append(f"| {NAMES[engine]} | {_median(values, 'step_time'):.3f} | {phases} | {muon} |"
                     f" {_median(values, 'peak_rss_mb'):.0f} | {each} |")
    lines += ["", "| | step | optimizer step | peak RSS |", "|---|---|---|---|"]
    for label, other in [("(b)/(a)", "shard_adamw"), ("(b)/(c)", "fully_shard_muon")]:
        ratios = [_median(runs["shard_muon"], key) / _median(runs[other], key)
                  for key in ["step_time", "optimizer_time", "peak_rss_mb"]]
        lines.append(f"| {label} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(lines)


def _muon_table(runs: dict[str, list[dict[str, float]]]) -> str:
    lines = ["Where the Muon step's time goes (seconds per step):", "",
             "| engine | Muon's step | Newton-Schulz | gather rows to owners | all-gather of the state layout"
             " | scatter rows back | the rest | the other rank's wait at the layout all-gather |",
             "|---|---|---|---|---|---|---|---|"]
    for engine in ["shard_muon", "fully_shard_muon"]:
        values = runs[engine]
        parts = {part: statistics.median(r[part] - (r["layouts"] if part == "scatter" else 0) for r in values)
                 for part in PARTS}
        total = _median(values, "muon_time")
        rest = total - sum(parts.values())
        cells = " | ".join(f"{parts[p]:.3f}" if parts[p] or p == "newton_schulz" else "-" for p in PARTS)
        waited = f"{_median(values, 'waited'):.3f}" if parts["layouts"] else "-"
        lines.append(f"| {NAMES[engine]} | {total:.3f} | {cells} | {rest:.3f} | {waited} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
