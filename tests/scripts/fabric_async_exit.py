"""Fabric with ``ShardStrategy(async_save=True)`` saving as the last thing before the process exits; the writer is
slowed down (and on request fails on rank 1), so the exit handler must wait for it.

    python tests/scripts/fabric_async_exit.py CHECKPOINT_DIR [--fail-on-rank-1]
"""

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard.checkpoint.save import directory as save  # noqa: E402
from lightning_shard.fabric import ShardStrategy  # noqa: E402
from tests.models import GPTBlock, TinyGPT, make_dataset  # noqa: E402


def slow_writer(fail_on_rank_1: bool, rank: int) -> None:
    original = save._ShardedWriter.write_tensors

    def write(self: Any, local: Any) -> Any:
        if threading.current_thread().name == "lightning_shard-background-save":
            time.sleep(2.0)  # still writing when the script's last line has run
            if fail_on_rank_1 and rank == 1:
                raise OSError("No space left on device")
        return original(self, local)

    save._ShardedWriter.write_tensors = write  # type: ignore[method-assign]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--fail-on-rank-1", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, async_save=True)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    slow_writer(args.fail_on_rank_1, fabric.global_rank)
    fabric.seed_everything(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = make_dataset("gpt", n=12)[:6]
    logits = model(x)
    fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    optimizer.step()
    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": 1})
    print(f"rank {fabric.global_rank} returned from save", flush=True)
