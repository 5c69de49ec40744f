"""What ``save_trainable_only=True`` saves on a LoRA fine-tune: bytes on disk and save time, against a checkpoint of
every weight, on Hugging Face GPT-2 small (124M parameters, built from its config: nothing is downloaded) with a peft
LoRA (r=8) on every attention input projection.

    .venv/bin/python benchmarks/adapter_checkpoint.py --repeats 3

2 gloo ranks (one thread each) shard the model (one unit per ``GPT2Block``), train one AdamW step on the adapters,
then save REPEATS times each way, alternating, with ``lightning_shard.checkpoint.save_checkpoint``: every weight, and
the trainable ones only (``ModelSelection(SavedParameters.TRAINABLE)``, what the strategies' ``save_trainable_only``
passes). Figures: the checkpoint's bytes on disk, the adapter's fp32 bytes, and rank 0's median save time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, repeats: int, root: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29874")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import peft
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from lightning_shard.checkpoint import save_checkpoint
    from lightning_shard.checkpoint.io.selection import ModelSelection
    from lightning_shard.engine import shard_model
    from lightning_shard.engine.option_choices import SavedParameters

    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"],
                                                      fan_in_fan_out=True))
    adapter_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    shard_model(model, auto_wrap_policy={GPT2Block})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(rank))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    selections = {"every weight": None, "trainable only": ModelSelection(SavedParameters.TRAINABLE)}
    times: dict[str, list[float]] = {name: [] for name in selections}
    sizes: dict[str, int] = {}
    for i in range(repeats):
        for name, selection in selections.items():
            path = Path(root) / f"{name.replace(' ', '-')}-{i}"
            dist.barrier()
            start = time.perf_counter()
            save_checkpoint(path, model, [optimizer], {"step": 1}, selection=selection)
            times[name].append(time.perf_counter() - start)
            dist.barrier()
            sizes[name] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if rank == 0:
        out.put({"adapter_bytes": adapter_bytes, "sizes": sizes,
                 "seconds": {k: statistics.median(v) for k, v in times.items()}})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as root:
        procs = [ctx.Process(target=_worker, args=(r, args.repeats, root, out)) for r in range(2)]
        for p in procs:
            p.start()
        result = out.get(timeout=1800)
        for p in procs:
            p.join()
    adapter = result["adapter_bytes"]
    print(f"adapter (fp32): {adapter / 2**20:.2f} MiB")
    print("| checkpoint | bytes on disk | vs the adapter | save, rank 0 (median) |")
    print("|---|---|---|---|")
    for name, size in result["sizes"].items():
        print(f"| {name} | {size / 2**20:.2f} MiB | {size / adapter:.1f}x | {result['seconds'][name]:.2f} s |")


if __name__ == "__main__":
    main()
