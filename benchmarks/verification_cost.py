"""What the checks of a load cost: the 25M-parameter GPT of the benchmarks with its AdamW state, saved and loaded
in one process, and each check a load runs (docs/checkpoint_format.md, "What a load verifies") timed on its own.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verification_cost.py --repeats 7

One gloo rank reads everything (a rank of a larger world reads its share of the data and checks that share, so the
fraction is the same): the figure is the median over repeats of ``load_checkpoint``'s wall time into a sharded GPT
and its AdamW, beside the medians of the checks it contains: the index's seal (the SHA-256 of its canonical JSON),
the SHA-256 of each data file's header, the CRC-32 of every 64 KiB block of data, and the SHA-256 of the trainer
state's two files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import BATCH, CTX, GPT, VOCAB, Block  # noqa: E402

from lightning_shard.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from lightning_shard.checkpoint.format import crc32_of_bytes  # noqa: E402
from lightning_shard.checkpoint.io.index import index_seal  # noqa: E402
from lightning_shard.engine import shard_model  # noqa: E402


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT()
    shard_model(model, auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, VOCAB, (BATCH, CTX + 1))
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _checks(ckpt: Path) -> dict[str, Callable[[], object]]:
    index = json.loads((ckpt / "index.json").read_text())
    data_files = [name for name, info in index["files"].items() if "header_sha256" in info]
    state_files = [name for name in index["files"] if name not in data_files]

    def headers() -> None:
        for name in data_files:
            with open(ckpt / name, "rb") as f:
                head = f.read(8)
                hashlib.sha256(head + f.read(struct.unpack("<Q", head)[0])).hexdigest()

    data = []  # the data sections, read beforehand: a load reads them anyway, the check is the CRC-32 alone
    for name in data_files:
        raw = (ckpt / name).read_bytes()
        data.append(memoryview(raw)[8 + struct.unpack("<Q", raw[:8])[0] :])

    def blocks() -> None:
        for view in data:
            for at in range(0, len(view), 64 * 2**10):
                crc32_of_bytes(view[at : at + 64 * 2**10])

    def state() -> None:
        for name in state_files:
            hashlib.sha256((ckpt / name).read_bytes()).hexdigest()

    return {"index seal": lambda: index_seal(json.loads((ckpt / "index.json").read_text())),
            "header digests": headers, "block CRC-32s": blocks, "trainer state SHA-256": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    model, optimizer = _model()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        save_checkpoint(ckpt, model, [optimizer], {"epoch": 1, "global_step": 100})
        size = sum(p.stat().st_size for p in ckpt.iterdir())
        target, target_optimizer = _model()
        load = _median(lambda: load_checkpoint(ckpt, target, [target_optimizer]), args.repeats)
        checks = {name: _median(fn, args.repeats) for name, fn in _checks(ckpt).items()}
    parameters = sum(p.numel() for p in GPT().parameters())
    print(f"{parameters / 1e6:.1f}M-parameter GPT with AdamW state, {size / 2**20:.0f} MiB on disk,"
          f" median of {args.repeats}")
    print(f"| load_checkpoint | {load * 1e3:.0f} ms | 100% |")
    for name, seconds in checks.items():
        print(f"| {name} | {seconds * 1e3:.1f} ms | {100 * seconds / load:.1f}% |")
    total = sum(checks.values())
    print(f"| all checks | {total * 1e3:.1f} ms | {100 * total / load:.1f}% |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
