"""How a rank's memory, its set-up and a step's Python work grow with the world size: real gloo ranks where they fit
on this machine (2 to 8), simulated ranks beyond (up to 1024: one process standing in for one rank of the world,
on PyTorch's fake process group; see ``lightning_shard.testing.simulate_rank``).

    .venv/bin/python benchmarks/world_size.py simulate                  # 25M and 1B GPTs, simulated W = 2 ... 1024
    .venv/bin/python benchmarks/world_size.py simulate --sizes 25M --world-sizes 8 1024
    .venv/bin/python benchmarks/world_size.py paths                     # real gloo, 2/4/8 ranks: the two gloo paths
    .venv/bin/python benchmarks/world_size.py collectives               # the same, one unit's collectives alone
    .venv/bin/python benchmarks/world_size.py setup                     # real gloo, 2/4 ranks: set-up, old and new

``simulate`` runs every (model, world size) as global rank 0 (the rank holding the most rows) with gloo's
collective paths, the model built on the meta device and initialised sharded, fp32 AdamW, the batch of
``benchmarks/scaling.py``'s sizes, in two fresh processes. The fake group communicates nothing, so a simulated step
is this rank's own work: its compute, its copies and its Python work, without waiting for anybody.

- Memory: the model state as ``memory_report`` counts it, ``estimate_memory(..., backend="gloo")``'s total, and the
  peak resident memory above a baseline taken after a small GPT's warm-up steps (so that the code the steps run is
  already paged in): VmHWM, reset at the baseline, over set-up and the warm-up steps plus one. The process runs with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the kernel, so the resident size follows live memory)
  and ``MALLOC_PERTURB_=165`` (glibc writes every block it hands out, so a buffer that a real collective would
  write but the fake one leaves alone is resident too, as on a real rank).
- Time: the set-up time, the median step after warm-up and the Python calls of one step (``count_python_calls``),
  with the allocator as users run it (the engine's ``cpu_allocator="reuse"``).

``paths`` times real training steps of the 25M GPT on 2, 4 and 8 gloo ranks (one thread each, on this machine's
cores) with gloo's two ways to communicate: the point-to-point exchanges and the flat collectives with an
all-to-all reduction; the engine switches from the first to the second above ``POINT_TO_POINT_MAX_RANKS``. It
reports the median step of the slowest rank and the CPU seconds of a step, all ranks together (less dependent on
what else runs on the machine).
``setup`` times ``shard_model`` of the 400M GPT (meta device, ``reset_parameters()`` one unit at a time) on 2 and 4
gloo ranks with rank 0's values broadcast (before) and with the checksum agreement (now): the slowest rank's time
and the CPU seconds of all ranks together.
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

sys.path.insert(0, str(Path(__file__).parent))
from scaling import SIZES  # noqa: E402 - the benchmarks' GPT sizes

WORLD_SIZES = [2, 4, 8, 16, 64, 256, 1024]
SIMULATED_BUDGET_GB = 3.0  # one simulated rank's model state may use this much of the shared machine's memory


def _resident_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> float:
    """Reset this process's resident high-water mark; return the resident size now (MiB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _resident_mib()


def _gpt(size_name: str) -> tuple[Any, type]:
    from peak_memory import GPT, Block

    size = SIZES[size_name]
    return GPT(size.d, size.layers, size.d // 64, size.ctx, size.vocab), Block


def _step(model: Any, optimizer: Any, size_name: str, generator: Any) -> None:
    import torch
    import torch.nn.functional as F

    size = SIZES[size_name]
    idx = torch.randint(0, size.vocab, (size.batch, size.ctx + 1), generator=generator)
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


# Simulated ranks #


def simulated_rank(size_name: str, world_size: int, what: str) -> dict[str, float]:
    """One simulated rank (global rank 0) of ``world_size``; ``what``: "memory" or "time" (see the module
    docstring)."""
    import torch

    from lightning_shard import estimate_memory
    from lightning_shard.engine import shard_model
    from lightning_shard.engine.memory import memory_report
    from lightning_shard.testing import count_python_calls, simulate_rank

    torch.set_num_threads(1)
    torch.manual_seed(0)
    size = SIZES[size_name]
    steps = size.warmup + 1 if what == "memory" else size.steps
    with simulate_rank(world_size, 0, backend="gloo"):
        _warm_up()
        baseline = _reset_peak()
        with torch.device("meta"):
            model, block = _gpt(size_name)
        start = time.perf_counter()
        engine = shard_model(model, auto_wrap_policy={block}, device="cpu")
        setup_s = time.perf_counter() - start
        setup_peak = _resident_mib("VmHWM") - baseline
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(0)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            _step(model, optimizer, size_name, generator)
            times.append(time.perf_counter() - start)
        peak = _resident_mib("VmHWM") - baseline
        state = memory_report(engine, [optimizer], 0).sharded
        if what == "time":
            calls = count_python_calls(lambda: _step(model, optimizer, size_name, generator))
            return {"setup_s": setup_s, "step_s": statistics.median(times[size.warmup :]), "python_calls": calls}
    with torch.device("meta"):
        estimate = estimate_memory(_gpt(size_name)[0], world_size, auto_wrap_policy={block}, backend="gloo")
    return {
        "setup_peak_mib": setup_peak,
        "model_state_mib": state.total / 2**20,
        "estimate_mib": estimate.total / 2**20,
        "peak_mib": peak,
    }


def _warm_up() -> None:
    """A small GPT's steps under the engine, so that the code the measured steps run (libtorch's kernels, the
    engine's paths) is paged in before the baseline: what is resident above it is then the measured model's data."""
    import gc

    import torch
    from peak_memory import GPT, Block

    from lightning_shard.engine import shard_model

    with torch.device("meta"):
        model = GPT(64, 2, 1, 16, 64)
    shard_model(model, auto_wrap_policy={Block}, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        idx = torch.randint(0, 64, (2, 17))
        torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer
    gc.collect()


def fits_simulated(size_name: str, world_size: int) -> bool:
    """Whether one rank's fp32 AdamW model state (16 bytes a parameter over the world) fits the budget."""
    return 16 * SIZES[size_name].params / world_size < SIMULATED_BUDGET_GB * 2**30


def simulate(
    sizes: list[str], world_sizes: list[int], saved: Path | None = None
) -> dict[str, dict[int, dict[str, float]]]:
    memory_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_PERTURB_": "165"}
    results: dict[str, dict[int, dict[str, float]]] = {}
    for size_name in sizes:
        for world_size in world_sizes:
            if not fits_simulated(size_name, world_size):
                print(f"{size_name} at W={world_size}: model state over {SIMULATED_BUDGET_GB} GB, skipped", flush=True)
                continue
            result: dict[str, float] = {}
            for what, child_env in (("memory", memory_env), ("time", os.environ)):
                cmd = [sys.executable, __file__, "_simulated", size_name, str(world_size), what]
                done = subprocess.run(cmd, env=child_env, capture_output=True, text=True, check=True)
                result |= json.loads(done.stdout.strip().splitlines()[-1])
            results.setdefault(size_name, {})[world_size] = result
            print(size_name, world_size, json.dumps(result), flush=True)
            if saved is not None:
                saved.write_text(json.dumps(results, indent=1))
    return results


def simulated_table(results: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [
        "| model | W | model state (MiB) | 16 bytes x params / W (MiB) | estimate (MiB) | measured peak (MiB)"
        " | estimate / peak | set-up (s) | step (s) | Python calls a step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size_name, by_world in results.items():
        ideal = 16 * SIZES[size_name].params / 2**20
        for world_size, r in sorted(by_world.items()):
            lines.append(
                f"| {size_name} | {world_size} | {r['model_state_mib']:.1f} | {ideal / world_size:.1f}"
                f" | {r['estimate_mib']:.0f} | {r['peak_mib']:.0f} | {r['estimate_mib'] / r['peak_mib']:.2f}"
                f" | {r['setup_s']:.2f} | {r['step_s']:.3f} | {r['python_calls']:,} |"
            )
    return "\n".join(lines)


# Real gloo ranks #


def _real_rank(rank: int, world_size: int, port: int, out: str, task: str, variant: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from lightning_shard.engine import collectives, initial_values, shard_model

    torch.manual_seed(0)
    result: dict[str, float] = {}
    if task == "paths":
        collectives.POINT_TO_POINT_MAX_RANKS = world_size if variant == "point_to_point" else 1
        with torch.device("meta"):
            model, block = _gpt("25M")
        shard_model(model, auto_wrap_policy={block}, device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(rank)
        times, cpu = [], 0.0
        for step in range(SIZES["25M"].steps):
            dist.barrier()
            start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            _step(model, optimizer, "25M", generator)
            times.append(time.perf_counter() - start)
            end = resource.getrusage(resource.RUSAGE_SELF)
            if step >= SIZES["25M"].warmup:
                cpu += end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime
        result["step_s"] = statistics.median(times[SIZES["25M"].warmup :])
        result["cpu_s"] = cpu / (SIZES["25M"].steps - SIZES["25M"].warmup)
    else:
        if variant == "broadcast":  # every full tensor from rank 0, as set-up did before the checksums
            initial_values.values_of_rank0 = lambda tensors, device: [  # type: ignore[assignment]
                initial_values._broadcast_from_rank0(t, device) for t in tensors
            ]
            import lightning_shard.engine.unit as unit_module

            unit_module.values_of_rank0 = initial_values.values_of_rank0
        with torch.device("meta"):
            model, block = _gpt("400M")
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        shard_model(model, auto_wrap_policy={block}, device="cpu")
        result["setup_s"] = time.perf_counter() - start
        result["cpu_s"] = time.process_time() - cpu
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _collectives_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """One unit's collectives alone (a 25M GPT block: 3.15M fp32 parameters in 12 pieces), median of 9."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from lightning_shard.engine import collectives

    group = dist.group.WORLD
    assert group is not None
    pieces, per = 12, 3_145_728 // 12 // world_size
    shard = torch.randn(pieces * per)
    outputs = list(torch.empty(world_size * pieces * per).split(world_size * per))
    rank_major = torch.empty(world_size * pieces * per)
    full, received = torch.randn(world_size * pieces * per), torch.empty(world_size * pieces * per)

    def flat_gather() -> None:
        collectives.all_gather_flat(rank_major, shard, group).wait()
        torch.split_with_sizes_copy(rank_major.view(world_size, -1), [per] * pieces, dim=1,
                                    out=[o.view(world_size, -1) for o in outputs])

    cases = {
        "all-gather, point-to-point into place": lambda: collectives.all_gather_pieces(
            outputs, list(shard.split(per)), group).wait(),
        "all-gather, flat + one copy": flat_gather,
        "reduction, reduce_scatter": lambda: collectives.reduce_scatter_sum(full, group).wait(),
        "reduction, all_to_all + sum": lambda: collectives.reduce_scatter_all_to_all(full, received, group).wait(),
    }
    result = {}
    for name, case in cases.items():
        case()
        dist.barrier()
        times = []
        for _ in range(9):
            start = time.perf_counter()
            case()
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def collectives_alone(world_sizes: list[int], port: int) -> None:
    import torch.multiprocessing as mp

    rows = []
    for world_size in world_sizes:
        port += 1
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_collectives_rank, args=(world_size, port, out), nprocs=world_size, start_method="spawn")
            ranks = [json.loads(p.read_text()) for p in Path(out).glob("rank*.json")]
        rows.append((world_size, {key: max(r[key] for r in ranks) for key in ranks[0]}))
    names = list(rows[0][1])
    print("| W | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for world_size, result in rows:
        print(f"| {world_size} | " + " | ".join(f"{result[n] * 1e3:.1f} ms" for n in names) + " |")


def real(task: str, variant: str, world_size: int, port: int) -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_real_rank, args=(world_size, port, out, task, variant), nprocs=world_size,
                           start_method="spawn")
        ranks = [json.loads(p.read_text()) for p in Path(out).glob("rank*.json")]
    slowest = {key: max(r[key] for r in ranks) for key in ranks[0]}
    if "cpu_s" in slowest:  # CPU time: the world's, summed over its ranks
        slowest["cpu_s"] = sum(r["cpu_s"] for r in ranks)
    return slowest


def compare(task: str, variants: list[str], world_sizes: list[int], repeats: int, port: int) -> None:
    keys = ["step_s", "cpu_s"] if task == "paths" else ["setup_s", "cpu_s"]
    measured: dict[tuple[int, str, str], list[float]] = {}
    for _ in range(repeats):  # alternate, so drift on a shared machine hits both alike
        for world_size in world_sizes:
            for variant in variants:
                port += 1
                result = real(task, variant, world_size, port)
                for key in keys:
                    measured.setdefault((world_size, variant, key), []).append(result[key])
                print(task, world_size, variant, json.dumps(result), flush=True)
    for key in keys:
        print(f"\n{key} (median of {repeats}):\n")
        print(f"| W | {' | '.join(variants)} | {variants[1]} / {variants[0]} |")
        print("|---|" + "---|" * (len(variants) + 1))
        for world_size in world_sizes:
            medians = [statistics.median(measured[world_size, v, key]) for v in variants]
            print(f"| {world_size} | {' | '.join(f'{m:.3f} s' for m in medians)} | {medians[1] / medians[0]:.2f}x |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_simulated":  # a child of ``simulate``: one measurement, as JSON
        print(json.dumps(simulated_rank(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("task", choices=["simulate", "paths", "collectives", "setup"])
    parser.add_argument("--sizes", nargs="+", default=["25M", "1B"], choices=list(SIZES))
    parser.add_argument("--world-sizes", nargs="+", type=int)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=29800)
    parser.add_argument("--results", help="simulate: also write the results to this JSON file as they come")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.task == "simulate":
        saved = Path(args.results) if args.results else None
        print(simulated_table(simulate(args.sizes, args.world_sizes or WORLD_SIZES, saved)))
    elif args.task == "collectives":
        collectives_alone(args.world_sizes or [2, 4, 8], args.port)
    elif args.task == "paths":
        compare("paths", ["point_to_point", "all_to_all"], args.world_sizes or [2, 4, 8], args.repeats, args.port)
    else:
        compare("setup", ["broadcast", "checksum"], args.world_sizes or [2, 4], args.repeats, args.port)


if __name__ == "__main__":
    main()
