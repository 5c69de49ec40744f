"""How the cost of a training step grows with the model: GPTs of 25M, ~100M, ~400M and 1B parameters under
ShardStrategy's engine, PyTorch's fully_shard, DDP (where it fits in memory) and one process.

    .venv/bin/python benchmarks/scaling.py                      # all sizes; writes docs/benchmarks.md's table + PNG
    .venv/bin/python benchmarks/scaling.py --sizes 25M --engines shard ddp --no-write
    .venv/bin/python benchmarks/scaling.py --sizes 25M --engines shard --sharding-strategy SHARD_GRAD_OP --no-write
    .venv/bin/python benchmarks/scaling.py --sizes 1B --engines shard --profile /tmp/prof   # cProfile per rank
    .venv/bin/python benchmarks/scaling.py --sizes 1B --results runs.json   # add to (or redo in) earlier runs
    .venv/bin/python benchmarks/scaling.py --results runs.json --table-only  # write the table and plot of runs.json

Every run is fresh processes: 2 gloo ranks with one thread each (the single process: one rank, same per-rank
batch), the model built on the meta device and initialised sharded (DDP and the single process build it in
full), fp32 AdamW, no MALLOC_* variables (as users run; ShardStrategy's engine applies its cpu_allocator
default). Per rank it records the median step time after the warm-up steps, the peak RSS (``ru_maxrss``,
absolute), and over the measured steps the user and system (kernel) CPU time and the minor page faults. A figure
is the slower or larger rank's. DDP and the single process are skipped where their replicated model state would
not fit in this machine's memory.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_START, TABLE_END = "<!-- scaling table start -->", "<!-- scaling table end -->"
ENGINES = ["shard", "fully_shard", "ddp", "single"]
NAMES = {"shard": "ShardStrategy", "fully_shard": "fully_shard", "ddp": "DDP", "single": "one process"}
MEMORY_BUDGET_GB = 18  # what the replicated engines may use across their processes on a 24 GiB machine


@dataclass(frozen=True)
class Size:
    d: int
    layers: int
    ctx: int
    batch: int  # per rank
    steps: int  # warm-up steps are not measured
    warmup: int
    vocab: int = 512

    @property
    def params(self) -> int:  # blocks (12 d^2 + 13 d) + embeddings + final norm + head
        return self.layers * (12 * self.d**2 + 13 * self.d) + (2 * self.vocab + self.ctx + 2) * self.d


SIZES = {
    "25M": Size(d=512, layers=8, ctx=64, batch=8, steps=8, warmup=3),  # the GPT of step_time.py
    "100M": Size(d=1024, layers=8, ctx=32, batch=4, steps=5, warmup=2),
    "400M": Size(d=1536, layers=14, ctx=32, batch=2, steps=4, warmup=1),
    "1B": Size(d=2048, layers=20, ctx=32, batch=1, steps=3, warmup=1),
}


def _worker(
    rank: int, world: int, engine: str, size_name: str, port: int, out: str, profile: str | None, sharding: str
) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    size = SIZES[size_name]
    sys.path.insert(0, str(Path(__file__).parent))
    from peak_memory import GPT, Block  # the benchmarks' GPT, here at this size with 64-wide heads

    dims = (size.d, size.layers, size.d // 64, size.ctx, size.vocab)
    if engine in ("shard", "fully_shard"):
        with torch.device("meta"):
            model = GPT(*dims)
    else:
        model = GPT(*dims)
    if engine == "shard":
        from lightning_shard.engine.mesh import build_shard_mesh
        from lightning_shard.engine.option_choices import ShardingStrategy
        from lightning_shard.engine.policies import resolve_wrap_policy
        from lightning_shard.engine.sharded_module import shard_module

        strategy = ShardingStrategy.parse(sharding)
        mesh = build_shard_mesh(strategy, None)
        shard_module(model, mesh, strategy, resolve_wrap_policy({Block}), torch.device("cpu"))
    elif engine == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    elif engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times: list[float] = []
    profiler = cProfile.Profile() if profile else None
    usage = None
    for step in range(size.steps):
        if step == size.warmup:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            if profiler is not None:
                profiler.enable()
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        idx = torch.randint(0, size.vocab, (size.batch, size.ctx + 1), generator=g)
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    end = resource.getrusage(resource.RUSAGE_SELF)
    assert usage is not None
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile}.{size_name}.{engine}.{sharding}.rank{rank}")
    measured = size.steps - size.warmup
    result = {
        "step": statistics.median(times[size.warmup :]),
        "peak_rss_gb": end.ru_maxrss / 2**20,
        "user_s": (end.ru_utime - usage.ru_utime) / measured,
        "system_s": (end.ru_stime - usage.ru_stime) / measured,
        "minor_faults": (end.ru_minflt - usage.ru_minflt) / measured,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def fits(engine: str, size: Size) -> bool:
    """Whether the replicated engines' model state (parameters, gradients, two AdamW moments, DDP's buckets) fits."""
    if engine in ("shard", "fully_shard"):
        return True
    processes = 2 if engine == "ddp" else 1
    per_process = size.params * 4 * (5 if engine == "ddp" else 4)
    return processes * per_process < MEMORY_BUDGET_GB * 2**30


def run(engine: str, size_name: str, port: int, profile: str | None, sharding: str = "FULL_SHARD") -> dict[str, float]:
    import torch.multiprocessing as mp

    world = 1 if engine == "single" else 2
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, engine, size_name, port, out, profile, sharding), nprocs=world,
                           start_method="spawn")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    return {key: max(r[key] for r in ranks) for key in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--port", type=int, default=29700)
    parser.add_argument("--profile", help="cProfile the measured steps into PROFILE.<size>.<engine>.<sharding>.rank<r>")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--results", help="a JSON file of results: runs already in it are kept, new ones added")
    parser.add_argument("--table-only", action="store_true", help="run nothing: the table (and plot) of --results")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP"],
                        help="ShardStrategy's; the table in docs/benchmarks.md is FULL_SHARD's")
    args = parser.parse_args()
    if args.table_only and not args.results:
        parser.error("--table-only writes the table of --results: pass the results file")
    if args.sharding_strategy != "FULL_SHARD" and (not args.no_write or args.results):
        parser.error("--sharding-strategy other than FULL_SHARD prints its rows only: add --no-write, drop --results")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    saved = Path(args.results) if args.results else None
    results: dict[str, dict[str, dict[str, float]]] = json.loads(saved.read_text()) if saved and saved.exists() else {}
    port = args.port
    for size_name in [] if args.table_only else args.sizes:
        for engine in args.engines:
            if not fits(engine, SIZES[size_name]):
                continue
            port += 1
            result = run(engine, size_name, port, args.profile, args.sharding_strategy)
            results.setdefault(size_name, {})[engine] = result
            print(size_name, engine, json.dumps(results[size_name][engine]), flush=True)
            if saved:
                saved.write_text(json.dumps(results, indent=1))
    results = {s: {e: results[s][e] for e in ENGINES if e in results[s]} for s in SIZES if s in results}
    if args.profile:
        for path in sorted(Path(args.profile).parent.glob(Path(args.profile).name + ".*.rank*")):
            print(path)
            pstats.Stats(str(path)).sort_stats("tottime").print_stats(25)
    table = _table(results)
    print(table)
    if not args.no_write:
        _write(table, results)


def _table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "| model | engine | median step (s) | vs fully_shard | peak RSS a rank (GB) | user s / step"
        " | system s / step | CPU vs fully_shard | kernel share | minor faults / step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size_name, engines in results.items():
        reference = engines.get("fully_shard")
        for engine, r in engines.items():
            cpu = r["user_s"] + r["system_s"]
            ratio = cpu_ratio = "-"
            if reference:
                ratio = f"{r['step'] / reference['step']:.2f}x"
                cpu_ratio = f"{cpu / (reference['user_s'] + reference['system_s']):.2f}x"
            lines.append(
                f"| {size_name} ({SIZES[size_name].params / 1e6:.0f}M) | {NAMES[engine]} | {r['step']:.3f} | {ratio}"
                f" | {r['peak_rss_gb']:.2f} | {r['user_s']:.2f} | {r['system_s']:.2f} | {cpu_ratio}"
                f" | {r['system_s'] / cpu if cpu else 0:.0%} | {r['minor_faults']:,.0f} |"
            )
    return "\n".join(lines)


def _write(table: str, results: dict[str, dict[str, dict[str, float]]]) -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    block = f"{TABLE_START}\nMeasured {time.strftime('%Y-%m-%d')}:\n\n{table}\n{TABLE_END}"
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
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for engine in ENGINES:
        points = [(SIZES[s].params / 1e6, r[engine]) for s, r in results.items() if engine in r]
        if not points:
            continue
        xs = [x for x, _ in points]
        axes[0].plot(xs, [r["step"] for _, r in points], "o-", label=NAMES[engine])
        axes[1].plot(xs, [r["peak_rss_gb"] for _, r in points], "o-", label=NAMES[engine])
        axes[2].plot(xs, [r["user_s"] + r["system_s"] for _, r in points], "o-", label=NAMES[engine])
        axes[3].plot(xs, [r["system_s"] / (r["user_s"] + r["system_s"]) for _, r in points], "o-",
                     label=NAMES[engine])
    titles = ["median step (s)", "peak RSS a rank (GB)", "CPU s a step (user + system)", "kernel share of CPU time"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.suptitle("GPT, 2 gloo ranks (one thread each), fp32 AdamW")
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "benchmarks_scaling.png", dpi=90)


if __name__ == "__main__":
    main()
