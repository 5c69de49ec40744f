"""Pipeline parallelism on CPU: step time, peak memory per rank and the measured bubble of two pipeline stages
against pure sharding on the same two ranks and the same global batch, under Fabric with ``ShardStrategy``.

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipeline_parallel.py

The model is the example's GPT (``examples/train_gpt.py``: embedding tied to the head; 8 blocks, width 128, 4 heads,
vocab 256, sequences of 128 tokens), global batch 16, AdamW. Each configuration runs in fresh processes (2 gloo
ranks): 2 warm-up steps, then the median of 5 steps (the slowest rank's). Peak memory is the rank's maximum RSS
during the steps (the kernel's high-water mark, reset after set-up) above its RSS after set-up, the larger of the
two ranks; MALLOC_MMAP_THRESHOLD_ makes freed blocks go back to the kernel, so RSS follows what the step holds. The
bubble is the share of the schedule's forward and backward a stage spent outside its own microbatches' forwards and
backwards (``Pipeline.busy_seconds`` of ``Pipeline.schedule_seconds``), the larger of the two stages, against the
theory for both schedules, ``(P - 1) / (M + P - 1)``; the idle share of the step also counts what every step does
outside the schedule (the loss, the optimizer step). Medians over the measured steps. Run it with nothing else
busy: 2 ranks on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ, LAYERS, WIDTH, HEADS, BATCH = 256, 128, 8, 128, 4, 16
WARMUP, MEASURED = 2, 5


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak_rss() -> None:
    """Make the kernel's high-water mark of this process's RSS (``VmHWM``) start again from its RSS now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _worker(rank: int, port: int, config: dict, out: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", NODE_RANK="0")  # fmt: skip
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    import lightning as L
    import torch
    import torch.nn.functional as F
    from train_gpt import GPT, Block

    from lightning_shard.engine import sharded_module_of
    from lightning_shard.engine.parallel.pipeline import measured_bubble
    from lightning_shard.fabric import ShardStrategy

    torch.set_num_threads(1)
    stages = config["stages"]
    kwargs = {"pipeline_parallel_size": 2, "pipeline_schedule": config["schedule"],
              "microbatches": config["microbatches"]} if stages > 1 else {}  # fmt: skip
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardStrategy(auto_wrap_policy={Block}, **kwargs))
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(VOCAB, SEQ, LAYERS, WIDTH, HEADS)
    module = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-3))
    stage = sharded_module_of(model).pipeline_stage  # type: ignore[union-attr]
    pipeline = stage.pipeline if stage is not None else None
    # Every rank of a pipeline sees the global batch; pure sharding splits it over its 2 data-parallel ranks.
    local = BATCH if stages > 1 else BATCH // 2
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    if stages == 1:
        tokens = tokens[rank * local : (rank + 1) * local]
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    before = _rss_mib()
    _reset_peak_rss()  # the steps' peak, not set-up's (the whole model is built before a stage is kept)
    times, bubbles = [], []
    for step in range(WARMUP + MEASURED):
        torch.distributed.barrier()
        if pipeline is not None:
            pipeline.busy_seconds = pipeline.schedule_seconds = 0.0
        start = time.perf_counter()
        logits = module(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
        slowest = torch.tensor([seconds])
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        if step >= WARMUP:
            times.append(slowest.item())
            if pipeline is not None:
                bubbles.append((measured_bubble(pipeline.busy_seconds, pipeline.schedule_seconds),
                                measured_bubble(pipeline.busy_seconds, slowest.item()), pipeline.busy_seconds))
    peak = _peak_rss_mib() - before
    medians = [statistics.median(b[i] for b in bubbles) if bubbles else 0.0 for i in range(3)]
    result = torch.tensor([peak, *medians])
    gathered = [torch.zeros(4) for _ in range(2)]
    torch.distributed.all_gather(gathered, result)
    if rank == 0:
        Path(str(out)).write_text(json.dumps({
            "step_s": statistics.median(times),
            "peak_mib": max(g[0].item() for g in gathered),
            "bubble": max(g[1].item() for g in gathered),  # of the schedule
            "step_bubble": max(g[2].item() for g in gathered),  # of the whole step
            "busy_s": [g[3].item() for g in gathered],  # each stage's forwards and backwards
        }))  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(config: dict, out: Path) -> dict:
    import torch.multiprocessing as mp

    port = _free_port()
    mp.start_processes(_worker, args=(port, config, out), nprocs=2, start_method="spawn")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/pipeline_benchmark.json"))
    args = parser.parse_args()
    configs = [{"stages": 1, "schedule": "-", "microbatches": 1}]
    configs += [{"stages": 2, "schedule": s, "microbatches": m} for s in ("gpipe", "1F1B") for m in (2, 4, 8)]
    rows = []
    for config in configs:
        result = measure(config, args.out)
        theory = (config["stages"] - 1) / (config["microbatches"] + config["stages"] - 1)
        rows.append({**config, **result, "theory": theory})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print("\n| layout | schedule | microbatches | step (s) | vs sharding | peak MiB/rank | vs sharding |"
          " bubble of the schedule | theory | idle share of the step | busy s, stage 0 / 1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        layout = "FULL_SHARD, data 2" if r["stages"] == 1 else "pipeline 2"
        bubble = "-" if r["stages"] == 1 else f"{r['bubble']:.2f}"
        idle = "-" if r["stages"] == 1 else f"{r['step_bubble']:.2f}"
        busy = "-" if r["stages"] == 1 else " / ".join(f"{b:.3f}" for b in r["busy_s"])
        theory = "-" if r["stages"] == 1 else f"{r['theory']:.2f}"
        print(f"| {layout} | {r['schedule']} | {r['microbatches']} | {r['step_s']:.3f} |"
              f" {r['step_s'] / base['step_s']:.2f}x | {r['peak_mib']:.1f} | {r['peak_mib'] / base['peak_mib']:.2f}x |"
              f" {bubble} | {theory} | {idle} | {busy} |")


if __name__ == "__main__":
    main()
