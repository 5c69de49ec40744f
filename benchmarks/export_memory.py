"""Extra memory of ``export_hf`` on a 403 MB checkpoint written by 2 ranks, sharded and full layout.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/export_memory.py

The model is six ``Linear(4096, 4096)`` layers (the largest tensor is a 64 MiB weight). 2 gloo ranks shard it
and save a checkpoint in each layout; then, in a fresh process per export, a thread samples the RSS every
millisecond while ``export_hf`` writes the model in several files; the figure is the highest sample above the
RSS just before the export. The bar: below the largest tensor plus 64 MiB, i.e. never the whole model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WIDTH, LAYERS = 4096, 6


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _save(rank: int, port: int, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lightning_shard.checkpoint.save.directory import save_checkpoint_dir
    from lightning_shard.engine.mesh import build_shard_mesh
    from lightning_shard.engine.option_choices import ShardingStrategy, StateDictType
    from lightning_shard.engine.policies import resolve_wrap_policy
    from lightning_shard.engine.sharded_module import shard_module

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    strategy = ShardingStrategy.FULL_SHARD
    engine = shard_module(model, build_shard_mesh(strategy, None), strategy, resolve_wrap_policy({nn.Linear}),
                          torch.device("cpu"))
    for layout in (StateDictType.SHARDED, StateDictType.FULL):
        checkpoint = {"epoch": 0, "global_step": 0, "state_dict": {}, "optimizer_states": []}
        save_checkpoint_dir(engine, model, [], checkpoint, Path(directory) / layout.value, layout)
    dist.destroy_process_group()


def _export(checkpoint: str, output: str) -> None:
    """Run in a fresh process: print the peak RSS growth (MiB) during the export."""
    from lightning_shard import export_hf

    peak, running = [0.0], threading.Event()

    def sample() -> None:
        while running.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.001)

    before = _rss_mb()
    running.set()
    sampler = threading.Thread(target=sample)
    sampler.start()
    result = export_hf(checkpoint, output, max_shard_size="150MB")
    running.clear()
    sampler.join()
    print(f"{peak[0] - before:.1f} {len(result.files)} {result.total_size / 2**20:.1f}")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--export":
        _export(sys.argv[2], sys.argv[3])
        return
    ctx = mp.get_context("spawn")
    largest = WIDTH * WIDTH * 4 / 2**20
    with tempfile.TemporaryDirectory() as directory:
        procs = [ctx.Process(target=_save, args=(r, 29879, directory)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            assert p.exitcode == 0
        print(f"largest tensor {largest:.1f} MiB; bar {largest + 64:.1f} MiB")
        print("| checkpoint layout | checkpoint on disk (MiB) | files written | extra RSS during export (MiB) |")
        print("|---|---|---|---|")
        for layout in ("sharded", "full"):
            ckpt = Path(directory) / layout
            on_disk = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20
            command = [sys.executable, __file__, "--export", str(ckpt), str(Path(directory) / f"hf-{layout}")]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout.split()
            print(f"| {layout} | {on_disk:.1f} | {out[1]} | {out[0]} |")


if __name__ == "__main__":
    main()
