"""Train the character-level GPT with Lightning Fabric and ``ShardStrategy``; save, then resume on another
number of processes.

Run from the repository root, one command after the other:

    python examples/fabric_train_gpt.py --devices 2 --steps 20 --out /tmp/fabric_run
    python examples/fabric_train_gpt.py --devices 3 --steps 40 --out /tmp/fabric_run --resume

The model is built on the meta device under ``fabric.init_module(empty_init=True)``, so no process ever
holds it in full: ``fabric.setup_module`` materialises and initialises it one block at a time and keeps
only this rank's shard. Each optimizer step accumulates ``--accumulate`` micro-batches (the gradients of all
but the last stay unreduced under ``fabric.no_backward_sync``) and clips by the global gradient norm. The
checkpoint written by ``fabric.save`` is a directory of safetensors shards and JSON that loads on any number
of processes. The data comes from a ``GlobalBatchLoader``: every optimizer step trains on the same 48 sequences
whatever the number of processes, and the loader's position is saved with the model, so the resumed run trains
on exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from train_gpt import DATA_PATH, GPT, Block, CharDataset

from lightning_shard import GlobalBatchLoader
from lightning_shard.fabric import ShardStrategy

GLOBAL_BATCH = 48  # sequences per optimizer step, over all processes and micro-batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="train until this optimizer step")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", default="/tmp/fabric_run")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    args = parser.parse_args()
    if GLOBAL_BATCH % (args.devices * args.accumulate):
        raise SystemExit(f"--devices x --accumulate must divide the global batch of {GLOBAL_BATCH}")
    torch.set_num_threads(1)

    strategy = ShardStrategy(auto_wrap_policy={Block}, grad_sync="step")  # reduce once per optimizer step
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(1337)

    dataset = CharDataset(DATA_PATH.read_text(encoding="utf-8"), block_size=64)
    # One loader batch is one micro-batch of every process together: GLOBAL_BATCH // accumulate sequences. Iterated
    # as it is (not through fabric.setup_dataloaders, whose wrapper restarts the epoch count at 0 in a new process).
    loader = GlobalBatchLoader(dataset, global_batch_size=GLOBAL_BATCH // args.accumulate, seed=1337)

    with fabric.init_module(empty_init=True):  # meta device: nothing is allocated yet
        model = GPT(dataset.vocab_size, block_size=64, n_layer=2, n_embd=64, n_head=4)
    model = fabric.setup_module(model)  # materialised and sharded one block at a time
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))

    checkpoint = Path(args.out) / "checkpoint"
    state = {"model": model, "optimizer": optimizer, "data": loader, "step": 0}
    if args.resume:
        fabric.load(checkpoint, state)  # on any number of processes: each reads only its rows; the loader its position
    fabric.print(f"starting at step {state['step']}")

    batches = endless(loader)
    while state["step"] < args.steps:
        for micro in range(args.accumulate):
            x, y = fabric.to_device(next(batches))
            last = micro == args.accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                fabric.backward(loss / args.accumulate)
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm, the same on every rank
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        if state["step"] % 5 == 0 or state["step"] == args.steps:
            fabric.print(f"step {state['step']}: loss {loss.item():.4f}, grad norm {norm.item():.3f}")

    fabric.save(checkpoint, state)  # every rank writes its own rows
    fabric.print(f"saved {checkpoint}")


def endless(loader: GlobalBatchLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches epoch after epoch, from where it is (after fabric.load, mid-epoch)."""
    for epoch in itertools.count(loader.epoch):
        loader.set_epoch(epoch)  # the epoch it is at keeps its position; a new one starts from its beginning
        yield from loader


if __name__ == "__main__":
    main()
