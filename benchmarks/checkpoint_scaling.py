"""How a checkpoint's index and its loading grow with the world size that wrote it: the 25M-parameter GPT of the
benchmarks, with its AdamW state, saved by W = 2, 8, 64, 256 and 1,024 ranks and loaded by 2.

    .venv/bin/python benchmarks/checkpoint_scaling.py                          # W = 2, 8, 64, 256, 1024
    .venv/bin/python benchmarks/checkpoint_scaling.py --worlds 8,1024 --repeats 7

W = 2 and W = 8 are real saves by that many gloo ranks (each trains the same AdamW step first); larger worlds are
simulated: ``lightning_shard.testing_checkpoints.simulate_save`` writes, in one process, the directory a FULL_SHARD
save by W ranks writes, with the save's own code (the test suite checks it byte for byte against a real save), from
the same model after the same step. Each checkpoint is loaded by 2 gloo ranks (``load_checkpoint``, as
``fabric.load`` calls it, into a meta-initialised, sharded GPT and its AdamW) REPEATS times, the checkpoints
alternating; the figure is the median over repeats of the slower rank's wall time, with rank 0's CPU time beside
it, and what rank 0 read: the headers (each file once) and the pieces it checked. ``inspect`` (every file's
SHA-256 and every piece's CRC-32, one process) is timed once per checkpoint. Last, the index sizes of the 1B GPT
and of Llama-70B's 723 tensors at large W (``simulated_index``: no tensor, no file) against the limit a load
reads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import BATCH, CTX, GPT, VOCAB, Block  # noqa: E402

REAL_WORLDS = (2, 8)  # saved by that many gloo ranks; larger worlds are simulated


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    idx = torch.randint(0, VOCAB, (BATCH, CTX + 1), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _init(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _save_worker(rank: int, world_size: int, port: int, path: str, done: Any) -> None:
    _init(rank, world_size, port)
    from lightning_shard.checkpoint import save_checkpoint
    from lightning_shard.engine import shard_model

    torch.manual_seed(0)
    model = GPT()
    shard_model(model, auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer)
    save_checkpoint(path, model, [optimizer], {"step": 1})
    done.put(rank)
    dist.destroy_process_group()


def _load_worker(rank: int, port: int, paths: list[str], repeats: int, out: Any) -> None:
    _init(rank, 2, port)
    from lightning_shard.checkpoint import load_checkpoint
    from lightning_shard.engine import shard_model
    from lightning_shard.testing_checkpoints import shard_files_read

    with torch.device("meta"):
        model = GPT()
    shard_model(model, auto_wrap_policy={Block})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    results: dict[str, Any] = {path: {"wall": [], "cpu": []} for path in paths}
    for _ in range(repeats):
        for path in paths:  # alternating: the machine's drift reaches every checkpoint alike
            directory = Path(path)
            dist.barrier()
            with shard_files_read() as shard_files:  # what the load read
                wall, cpu = time.perf_counter(), time.process_time()
                load_checkpoint(directory, model, [optimizer])
            results[path]["wall"].append(time.perf_counter() - wall)
            results[path]["cpu"].append(time.process_time() - cpu)
            files = shard_files[-1]
            results[path]["headers"], results[path]["pieces"] = len(files.headers_read), files.pieces_checked
    out.put((rank, results))
    dist.destroy_process_group()


def _save(world_size: int, path: Path) -> None:
    """A real save by ``world_size`` gloo ranks; done when every rank has reported its save (an abort in a rank's
    interpreter teardown afterwards does not matter here)."""
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    procs = [ctx.Process(target=_save_worker, args=(r, world_size, 29871, str(path), done)) for r in range(world_size)]
    for p in procs:
        p.start()
    saved = sorted(done.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    if saved != list(range(world_size)) or not (path / "index.json").is_file():
        raise SystemExit(f"the save by {world_size} ranks did not complete")


def _checkpoints(root: Path, worlds: list[int]) -> dict[int, Path]:
    from lightning_shard.testing_checkpoints import simulate_save

    torch.manual_seed(0)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer)
    paths = {}
    for world in worlds:
        paths[world] = root / f"w{world}"
        if world in REAL_WORLDS:
            _save(world, paths[world])
        else:
            simulate_save(paths[world], model, world, [optimizer], {"step": 1})
    return paths


def _load_times(paths: dict[int, Path], repeats: int) -> dict[int, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ordered = [str(paths[w]) for w in sorted(paths)]
    procs = [ctx.Process(target=_load_worker, args=(r, 29872, ordered, repeats, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    table = {}
    for world, path in paths.items():
        rank0, rank1 = results[0][str(path)], results[1][str(path)]
        slower = [max(a, b) for a, b in zip(rank0["wall"], rank1["wall"])]
        table[world] = {"wall": statistics.median(slower), "cpu": statistics.median(rank0["cpu"]),
                        "headers": rank0["headers"], "pieces": rank0["pieces"]}
    return table


def _index_sizes() -> list[tuple[str, int, int]]:
    from lightning_shard.testing_checkpoints import simulated_index

    d, layers, ctx, vocab = 2048, 20, 32, 512  # benchmarks/scaling.py's 1B GPT
    block = {"ln1.weight": (d,), "ln1.bias": (d,), "qkv.weight": (3 * d, d), "qkv.bias": (3 * d,),
             "proj.weight": (d, d), "proj.bias": (d,), "ln2.weight": (d,), "ln2.bias": (d,),
             "fc.weight": (4 * d, d), "fc.bias": (4 * d,), "out.weight": (d, 4 * d), "out.bias": (d,)}
    gpt_1b = {"wte.weight": (vocab, d), "wpe.weight": (ctx, d), "ln_f.weight": (d,), "ln_f.bias": (d,),
              "head.weight": (vocab, d)}
    gpt_1b |= {f"blocks.{n}.{k}": shape for n in range(layers) for k, shape in block.items()}
    h, i, v = 8192, 28672, 128256
    layer = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (1024, h),
             "self_attn.v_proj.weight": (1024, h), "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (i, h),
             "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
             "post_attention_layernorm.weight": (h,)}
    llama = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    llama |= {f"model.layers.{n}.{k}": shape for n in range(80) for k, shape in layer.items()}
    sizes = [(f"1B GPT ({len(gpt_1b)} parameters)", w, len(simulated_index(gpt_1b, w))) for w in (1024, 2048, 4096)]
    return sizes + [(f"Llama-70B ({len(llama)} parameters)", 4096, len(simulated_index(llama, 4096)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,8,64,256,1024", help="writer world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="loads of each checkpoint (median reported)")
    args = parser.parse_args()
    worlds = sorted(int(w) for w in args.worlds.split(","))
    from lightning_shard import inspect
    from lightning_shard.checkpoint.format import MAX_JSON_BYTES

    root = Path(tempfile.mkdtemp(prefix="checkpoint-scaling-"))
    try:
        paths = _checkpoints(root, worlds)
        loads = _load_times(paths, args.repeats)
        base = loads[8]["wall"] if 8 in loads else None
        print("| writer W | written | index.json | files | rank 0 read: headers, pieces checked | load on 2 ranks"
              " (wall, median) | rank 0 CPU | vs W=8 | `inspect` |")
        print("|---|---|---|---|---|---|---|---|---|")
        for world in worlds:
            path, load = paths[world], loads[world]
            started = time.perf_counter()
            assert inspect(path).problems == []
            inspected = time.perf_counter() - started
            how = "real, gloo" if world in REAL_WORLDS else "simulated"
            ratio = f"{load['wall'] / base:.2f}x" if base else "-"
            print(f"| {world} | {how} | {(path / 'index.json').stat().st_size / 1024:.1f} KiB"
                  f" | {len(list(path.iterdir()))} | {load['headers']}, {load['pieces']:,} | {load['wall']:.3f} s"
                  f" | {load['cpu']:.3f} s | {ratio} | {inspected:.1f} s |")
        print(f"\n| model | writer W | index.json | share of the {MAX_JSON_BYTES >> 20} MiB limit |")
        print("|---|---|---|---|")
        for model, world, size in _index_sizes():
            print(f"| {model} | {world} | {size / 2**20:.2f} MiB | {size / MAX_JSON_BYTES:.2%} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
