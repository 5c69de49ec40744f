"""Extra memory per rank while a checkpoint is saved, sharded and full, on the 25M-parameter GPT.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/save_memory.py

2 gloo ranks train one AdamW step (so optimizer state exists), then save the checkpoint while a
thread samples the process's RSS every millisecond; the figure is the highest sample above the RSS
just before the save. A "full" save must stay within one gathered tensor (the largest is 4 MiB),
well under one unit (12 MiB per block) and the model (98 MiB).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import BATCH, CTX, GPT, VOCAB, Block, _rss_mb  # noqa: E402


def _sample(peak: list[float], running: threading.Event) -> None:
    while running.is_set():
        peak[0] = max(peak[0], _rss_mb())
        time.sleep(0.001)


def _worker(rank: int, port: int, directory: str, out: mp.Queue) -> None:
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
        model = GPT()
    strategy = ShardingStrategy.FULL_SHARD
    engine = shard_module(model, build_shard_mesh(strategy, None), strategy, resolve_wrap_policy({Block}),
                          torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, VOCAB, (BATCH, CTX + 1))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    results = {}
    for layout in (StateDictType.SHARDED, StateDictType.FULL):
        dist.barrier()
        before, peak, running = _rss_mb(), [0.0], threading.Event()
        running.set()
        sampler = threading.Thread(target=_sample, args=(peak, running))
        sampler.start()
        checkpoint = {"epoch": 0, "global_step": 1, "state_dict": {}, "optimizer_states": [{}]}
        save_checkpoint_dir(engine, model, [optimizer], checkpoint, Path(directory) / layout.value, layout)
        running.clear()
        sampler.join()
        results[layout.value] = peak[0] - before
    out.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as directory:
        procs = [ctx.Process(target=_worker, args=(r, 29877, directory, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    print("| layout | rank 0 extra RSS during save (MiB) | rank 1 extra RSS during save (MiB) |")
    print("|---|---|---|")
    for layout in ("sharded", "full"):
        print(f"| {layout} | {results[0][layout]:.1f} | {results[1][layout]:.1f} |")


if __name__ == "__main__":
    main()
