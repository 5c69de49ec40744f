"""How long a save holds the training loop, synchronous against background (AsyncCheckpointIO's path), on the
25M-parameter GPT of the benchmarks.

    .venv/bin/python benchmarks/async_save.py --repeats 5

2 gloo ranks train one AdamW step (so optimizer state exists), then save the checkpoint REPEATS times each way,
alternating. The figure is the time the calling thread spends in the save: the whole save when synchronous; the
agreement and the copy of this rank's rows aside when in the background (the writing goes on in a worker thread,
which the next save waits for before starting: that wait is not counted, so this measures the loop's hold, not
the disk). Medians over the repeats, rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import BATCH, CTX, GPT, VOCAB, Block  # noqa: E402


def _worker(rank: int, port: int, directory: str, repeats: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lightning_shard.checkpoint.save.background import BackgroundSaver
    from lightning_shard.checkpoint.save.directory import save_checkpoint_dir
    from lightning_shard.engine import shard_model
    from lightning_shard.engine.option_choices import StateDictType

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT()
    engine = shard_model(model, auto_wrap_policy={Block}, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, VOCAB, (BATCH, CTX + 1))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    optimizer.step()
    saver = BackgroundSaver()
    held: dict[str, list[float]] = {"sync": [], "background": []}
    layout = StateDictType.SHARDED
    for i in range(repeats):
        for mode in ("sync", "background"):
            saver.wait()  # a background save in flight finishes first: only the hold of this save is timed
            dist.barrier()
            path = Path(directory) / f"{mode}-{i}"
            start = time.perf_counter()
            if mode == "sync":
                save_checkpoint_dir(engine, model, [optimizer], {"optimizer_states": []}, path, layout)
            else:
                saver.save(engine, model, [optimizer], {"optimizer_states": []}, path, layout)
            held[mode].append(time.perf_counter() - start)
    saver.close()
    if rank == 0:
        out.put(held)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    with tempfile.TemporaryDirectory() as directory:
        procs = [ctx.Process(target=_worker, args=(r, port, directory, args.repeats, out)) for r in range(2)]
        for p in procs:
            p.start()
        held = out.get()
        for p in procs:
            p.join()
    sync, background = statistics.median(held["sync"]), statistics.median(held["background"])
    print(f"loop held by a save (median of {args.repeats}, rank 0): synchronous {sync * 1000:.0f} ms,"
          f" background {background * 1000:.0f} ms, ratio {background / sync:.2f}")


if __name__ == "__main__":
    main()
