"""Context parallelism on CPU: the longest sequence one training step fits in a fixed memory budget per rank, at
context_parallel_size C = 1, 2 and 4 (C gloo ranks, one data-parallel rank), with the engine's pieces directly
(``ParallelDims``, ``shard_model``, ``ContextParallel``: what ``ShardStrategy(context_parallel_size=C)`` runs).

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_parallel.py

Each (C, sequence length) runs in fresh processes: one warm-up step at the shortest length, then one step at the
length measured. Peak memory is the rank's maximum RSS above its RSS before that step (the largest over the ranks);
step time is the slowest rank's. MALLOC_MMAP_THRESHOLD_ makes large freed blocks go back to the kernel, so RSS
follows what the step holds. The model: the test suite's causal LM (tests/context_parallel_models.py: width 32, 4
heads, 2 blocks, vocab 61), batch 1, SGD. Run with nothing else busy on the machine: with C ranks on fewer cores,
step times mostly measure the sharing of the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_MIB = 48.0  # the memory budget per rank the longest sequence must fit


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, world: int, port: int, seq: int, out: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from lightning_shard.engine import shard_model
    from lightning_shard.engine.parallel import ContextParallel, ParallelDims
    from tests.context_parallel_models import Block, CausalLM, lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = ParallelDims.of_world(world, world).build_mesh("cpu")
    cp = ContextParallel.of(mesh["context_parallel"])
    torch.manual_seed(0)
    model = CausalLM()
    model.wpe = torch.nn.Embedding(seq, model.wpe.embedding_dim)
    shard_model(model, auto_wrap_policy={Block}, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(length: int) -> float:
        tokens = torch.randint(61, (1, length + 1), generator=torch.Generator().manual_seed(0))
        batch = cp.split((tokens[:, :-1], tokens[:, 1:], torch.arange(length).view(1, -1)))
        dist.barrier()
        start = time.perf_counter()
        with cp.step(model):
            loss = lm_loss(model, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    step(8 * world)  # warm-up: every kernel and collective once
    before = _rss_mib()
    seconds = step(seq)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    out.put((rank, peak, seconds))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def measure(world: int, seq: int) -> tuple[float, float]:
    """(peak MiB above the pre-step RSS, the largest over ranks; step seconds, the slowest rank's)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, seq, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return max(r[1] for r in results), max(r[2] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        for seq in args.lengths:
            peak, seconds = measure(size, seq)
            rows.append({"context_parallel_size": size, "seq": seq, "peak_mib": round(peak, 1),
                         "step_s": round(seconds, 3), "fits": peak <= BUDGET_MIB})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    for size in args.sizes:
        fitting = [r["seq"] for r in rows if r["context_parallel_size"] == size and r["fits"]]
        print(f"C={size}: longest sequence within {BUDGET_MIB} MiB per rank: {max(fitting) if fitting else None}")


if __name__ == "__main__":
    main()
