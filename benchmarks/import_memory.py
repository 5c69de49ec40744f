"""RSS growth per rank while a pretrained model is imported shard-wise, against what each rank must hold.

    MALLOC_MMAP_THRESHOLD_=65536 .venv/bin/python benchmarks/import_memory.py

A model of 8 blocks of two Linear(2048, 2048) layers (about 268 MB in fp32, largest tensor 16 MiB) is saved in
the Hugging Face layout (several `model-0000k-of-0000n.safetensors` files and an index, by
`huggingface_hub.save_torch_state_dict`). 2 gloo ranks then build it on the meta device, shard it one block per
unit (once with `param_init="reset_parameters"`, which initialises each unit in full before the load replaces
it, and once with `param_init="empty"`, which materialises nothing in full), and load the files with
`load_safetensors_into`, while a thread samples each process's RSS every millisecond: RssAnon (what the process
allocated) and the whole RSS (which would also count file pages mapped to read; rows are read with plain file
reads, so none are). The figures are the highest samples above the values before the model was built; the bound
is this rank's share of the model, M/N, plus the largest tensor.
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
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import _rss_mb  # noqa: E402

WIDTH, BLOCKS = 2048, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _model() -> nn.Module:
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def _anon_mb() -> float:
    """Anonymous resident memory (RssAnon): what the process allocated, without file pages mapped for reading."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def _sample(peak: list[float], running: threading.Event) -> None:
    while running.is_set():
        peak[0] = max(peak[0], _rss_mb())
        peak[1] = max(peak[1], _anon_mb())
        time.sleep(0.001)


def _worker(rank: int, port: int, directory: str, param_init: str, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lightning_shard import load_safetensors_into
    from lightning_shard.engine import shard_model

    before, before_anon, peak, running = _rss_mb(), _anon_mb(), [0.0, 0.0], threading.Event()
    running.set()
    sampler = threading.Thread(target=_sample, args=(peak, running))
    sampler.start()
    with torch.device("meta"):
        model = _model()
    shard_model(model, auto_wrap_policy={Block}, device="cpu", param_init=param_init)
    sharded_anon, load_peak = _anon_mb(), [0.0, 0.0]
    load_running = threading.Event()
    load_running.set()
    load_sampler = threading.Thread(target=_sample, args=(load_peak, load_running))
    load_sampler.start()
    result = load_safetensors_into(model, directory)
    load_running.clear()
    running.clear()
    sampler.join()
    load_sampler.join()
    assert not result.missing_keys and not result.unexpected_keys
    out.put((rank, (peak[0] - before, peak[1] - before_anon, sharded_anon - before_anon, load_peak[1] - sharded_anon)))
    dist.destroy_process_group()


def main() -> None:
    from huggingface_hub import save_torch_state_dict

    torch.manual_seed(0)
    model = _model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    model_mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    largest_mib = max(t.numel() * t.element_size() for t in state.values()) / 2**20
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as directory:
        save_torch_state_dict(state, directory, max_shard_size="64MB")
        del model, state
        files = sorted(p.name for p in Path(directory).iterdir())
        runs = {}
        for i, param_init in enumerate(("reset_parameters", "empty")):
            port = 29000 + (os.getpid() + i) % 1000
            procs = [ctx.Process(target=_worker, args=(r, port, directory, param_init, out)) for r in range(2)]
            for p in procs:
                p.start()
            runs[param_init] = dict(out.get(timeout=600) for _ in procs)
            for p in procs:
                p.join()
    bound = model_mib / 2 + largest_mib
    print(f"model {model_mib:.0f} MiB in {len(files) - 1} files + index, largest tensor {largest_mib:.0f} MiB;"
          f" M/N + largest tensor = {bound:.0f} MiB")
    for param_init, growth in runs.items():
        for rank, (rss, anon, sharded, load) in sorted(growth.items()):
            print(f"param_init={param_init!r} rank {rank}: anonymous memory grew by {anon:.1f} MiB at the peak"
                  f" ({sharded:.1f} MiB held by the shards after sharding, {load:.1f} MiB more at the peak of the"
                  f" load itself); the whole RSS grew by {rss:.1f} MiB")


if __name__ == "__main__":
    main()
