"""What the stall diagnosis costs per training step: the same sharded model on 2 gloo ranks, stepping alternately
with progress counting, stall watching and publishing on (as shipped) and with all of it patched out.

    flock /tmp/heavy.lock env OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python benchmarks/stall_overhead.py

The model is 8 blocks of Linear(256, 1024)-GELU-Linear(1024, 256), one sharding unit each, batch 32 per rank, SGD:
small on purpose, so that the per-collective bookkeeping is as large a share of the step as it gets (about 40
collectives per step). Rounds alternate on/off in the same processes; the figures are medians over all steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_shard.engine import collectives, progress, shard_model  # noqa: E402
from lightning_shard.engine.unit import ShardUnit  # noqa: E402

WARMUP, ROUNDS, STEPS_PER_ROUND = 5, 10, 20


class Block(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _NoWatch:
    def __init__(self, activity: Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_ORIGINAL = {
    "watching": collectives.watching,
    "about": collectives.about,
    "start_unshard": ShardUnit.start_unshard,
    "start_reduce_grads": ShardUnit.start_reduce_grads,
}


def _switch(on: bool, rank: int, world_size: int) -> None:
    """Counting, watching and publishing as shipped (``on``), or patched out."""
    if on:
        progress.RECORD.__dict__.pop("enter", None)
        collectives.watching, collectives.about = _ORIGINAL["watching"], _ORIGINAL["about"]
        ShardUnit.start_unshard = _ORIGINAL["start_unshard"]  # type: ignore[method-assign]
        ShardUnit.start_reduce_grads = _ORIGINAL["start_reduce_grads"]  # type: ignore[method-assign]
        store = dist.distributed_c10d._get_default_store()
        progress.start_publishing(store, rank, world_size, timedelta(minutes=10))
    else:
        progress.stop_publishing()
        progress.RECORD.enter = lambda op: None  # type: ignore[method-assign,assignment,return-value]
        collectives.watching = collectives.about = _NoWatch  # type: ignore[assignment,misc]
        ShardUnit.start_unshard = _ORIGINAL["start_unshard"].__wrapped__  # type: ignore[attr-defined]
        ShardUnit.start_reduce_grads = _ORIGINAL["start_reduce_grads"].__wrapped__  # type: ignore[attr-defined]


def measure(rank: int, world_size: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(8)])
    shard_model(model, auto_wrap_policy={Block}, device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256)

    def step() -> float:
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    _switch(True, rank, world_size)
    for _ in range(WARMUP):
        step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * ROUNDS):
        mode = "on" if i % 2 == 0 else "off"
        _switch(mode == "on", rank, world_size)
        dist.barrier()
        times[mode].extend(step() for _ in range(STEPS_PER_ROUND))
    _switch(True, rank, world_size)
    return times


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from lightning_shard.testing import run_on_ranks

    results = run_on_ranks(measure, 2, timeout=1200)
    on = statistics.median(t for r in results for t in r["on"]) * 1e3
    off = statistics.median(t for r in results for t in r["off"]) * 1e3
    print(f"median step: on {on:.2f} ms, off {off:.2f} ms, on/off {on / off:.3f}")
    # The spread: each "on" round's median against the "off" round right after it (rank 0).
    starts = range(0, ROUNDS * STEPS_PER_ROUND, STEPS_PER_ROUND)
    on_rounds = [statistics.median(results[0]["on"][i : i + STEPS_PER_ROUND]) for i in starts]
    off_rounds = [statistics.median(results[0]["off"][i : i + STEPS_PER_ROUND]) for i in starts]
    pairs = [a / b for a, b in zip(on_rounds, off_rounds)]
    print(f"per-round on/off ratios (rank 0): min {min(pairs):.3f}, median {statistics.median(pairs):.3f},"
          f" max {max(pairs):.3f}")


if __name__ == "__main__":
    main()
