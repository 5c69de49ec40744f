"""A fit on one GPU whose all-reduce cannot complete within the strategy's timeout, for tests/test_cuda.py:

    TORCH_NCCL_BLOCKING_WAIT=1 python tests/scripts/nccl_stall_fit.py --timeout 3

At the start of training the GPU is kept busy (``torch.cuda._sleep``) for several times the timeout, then the engine's
all-reduce is issued on the strategy's NCCL group: it is queued behind the busy GPU and cannot finish in time. With
blocking waits NCCL raises the timeout in the waiting call, which must surface as a ``StalledRanksError`` naming the
all-reduce (at world size 1 no peer can stop, so this is the one way a single GPU shows the diagnosis).
"""

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard import ShardStrategy  # noqa: E402
from lightning_shard.engine import collectives  # noqa: E402
from tests.models import GPTBlock, LitModel, loader  # noqa: E402


class BusyGPU(LitModel):
    def __init__(self, busy_s: float) -> None:
        super().__init__("gpt")
        self.busy_s = busy_s

    def on_train_start(self) -> None:
        rate = torch.cuda.get_device_properties(self.device).clock_rate * 1000  # cycles per second (clock in kHz)
        torch.cuda._sleep(int(self.busy_s * rate))
        options = getattr(dist.group.WORLD._get_backend(self.device), "options", None)
        print(f"all-reduce issued behind the busy GPU (group timeout {getattr(options, '_timeout', '?')})", flush=True)
        start = time.perf_counter()
        try:
            collectives.all_reduce_sum(torch.ones(1, device=self.device), dist.group.WORLD)
        finally:
            print(f"the all-reduce's wait returned or raised after {time.perf_counter() - start:.1f} s", flush=True)
        print("all-reduce completed", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    trainer = L.Trainer(
        accelerator="gpu", devices=1, strategy=ShardStrategy(auto_wrap_policy={GPTBlock}, timeout=timedelta(
            seconds=args.timeout)), max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BusyGPU(busy_s=5 * args.timeout), train_dataloaders=loader("gpt"))
    print("finished", flush=True)
