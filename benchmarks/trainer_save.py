"""What ``trainer.save_checkpoint`` costs under ShardStrategy, and what reading state through the strategy costs, on the
25M-parameter GPT of the benchmarks, for both ``state_dict_type`` values.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/trainer_save.py --repeats 3

2 gloo ranks fit one AdamW step with the Trainer, then save REPEATS times each way, in turn:

- ``empty``: the strategy's ``lightning_module_state_dict()`` and ``optimizer_state()`` return ``{}`` (what they
  returned before they gave the state dict contract: the floor, since the save writes from the shards itself);
- ``save``: ``trainer.save_checkpoint`` as it is;
- ``unscoped``: ``Trainer.save_checkpoint`` called past the strategy's wrapper, so the checkpoint dict gets the layout
  ``state_dict_type`` names (under ``"full"``: the full state dict gathered onto rank 0 for nothing; see [Note: a
  Trainer save gathers nothing it does not write]);
- ``read``: ``lightning_module_state_dict()`` and ``optimizer_state()`` alone, outside a save.

Figures (medians over the repeats): rank 0's seconds for the whole call and, of them, the seconds spent inside the
strategy's two state-dict methods; each rank's highest RSS sample (every millisecond, by a thread) above the RSS
just before.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import BATCH, GPT, Block, Tokens, _rss_mb  # noqa: E402

MODES = ("empty", "save", "unscoped", "read")


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT()

    def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return F.cross_entropy(self.model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _measure(run: Callable[[], Any]) -> tuple[float, float]:
    """Seconds and the highest RSS above the start (MiB) while ``run`` runs."""
    dist.barrier()
    before, peak, running = _rss_mb(), [0.0], threading.Event()
    running.set()

    def sample() -> None:
        while running.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    running.clear()
    sampler.join()
    del result
    return seconds, max(peak[0], _rss_mb()) - before


def worker(rank: int, world_size: int, layout: str, directory: str, repeats: int) -> dict[str, list[float]]:
    from lightning_shard import ShardStrategy

    strategy = ShardStrategy(auto_wrap_policy={Block}, state_dict_type=layout)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(Tokens(), batch_size=BATCH))
    optimizer = trainer.optimizers[0]

    in_methods = [0.0]  # seconds spent in the strategy's two state-dict methods during the current save

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                in_methods[0] += time.perf_counter() - start

        return run

    def save(mode: str, path: Path) -> None:
        if mode == "empty":
            strategy.lightning_module_state_dict = lambda: {}  # type: ignore[method-assign]
            strategy.optimizer_state = lambda opt: {}  # type: ignore[method-assign]
        else:
            strategy.lightning_module_state_dict = timed(type(strategy).lightning_module_state_dict.__get__(strategy))  # type: ignore[method-assign]  # noqa: E501
            strategy.optimizer_state = timed(type(strategy).optimizer_state.__get__(strategy))  # type: ignore[method-assign]  # noqa: E501
        try:
            if mode == "unscoped":
                type(trainer).save_checkpoint(trainer, path)  # past the strategy's wrapper
            else:
                trainer.save_checkpoint(path)
        finally:
            del strategy.lightning_module_state_dict, strategy.optimizer_state

    def read() -> tuple[dict[str, Any], dict[str, Any]]:
        return strategy.lightning_module_state_dict(), strategy.optimizer_state(optimizer)

    results: dict[str, list[float]] = {}
    for i in range(repeats):
        for mode in MODES:
            path = Path(directory) / f"{mode}-{i}"
            in_methods[0] = 0.0
            seconds, mib = _measure(read if mode == "read" else lambda: save(mode, path))  # noqa: B023 - called here
            results.setdefault(f"{mode} in methods s", []).append(seconds if mode == "read" else in_methods[0])
            results.setdefault(f"{mode} s", []).append(seconds)
            results.setdefault(f"{mode} MiB", []).append(mib)
    return results


def main() -> None:
    from lightning_shard.testing import run_on_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'layout':8} {'mode':9} {'rank 0 s':>9} {'in methods s':>13} {'rank 0 MiB':>11} {'rank 1 MiB':>11}")
    for layout in ("sharded", "full"):
        with tempfile.TemporaryDirectory() as directory:
            ranks = run_on_ranks(worker, 2, layout, directory, args.repeats, timeout=1800)
        for mode in MODES:
            seconds = statistics.median(ranks[0][f"{mode} s"])
            methods = statistics.median(ranks[0][f"{mode} in methods s"])
            mib = [statistics.median(r[f"{mode} MiB"]) for r in ranks]
            print(f"{layout:8} {mode:9} {seconds:9.2f} {methods:13.3f} {mib[0]:11.0f} {mib[1]:11.0f}")


if __name__ == "__main__":
    main()
