"""A Fabric job with ``ShardStrategy`` that trains a TinyGPT for ``--steps`` AdamW steps and saves with
``fabric.save``; with ``--resume``, it first loads that checkpoint with ``fabric.load`` (the model's and the
optimizer's rows in one read) and trains on from its step; with ``--save-first DIR``, it also saves after its first
step (to DIR) and trains on. Lightning's launcher starts the ranks; the strategy creates the process group.

    python tests/scripts/fabric_resume.py OUT --steps 3 --save-first FIRST
    python tests/scripts/fabric_resume.py OUT --steps 3 --resume FIRST
"""

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard.fabric import ShardStrategy  # noqa: E402
from tests.models import GPTBlock, TinyGPT, make_dataset  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--resume")
    parser.add_argument("--save-first")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardStrategy(auto_wrap_policy={GPTBlock}))
    fabric.launch()
    fabric.seed_everything(1 if args.resume else 0)  # resumed: every weight and moment must come from the checkpoint
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    x, y = make_dataset("gpt", n=4 * args.steps).tensors
    for step in range(state["step"], args.steps):
        logits = model(x[4 * step : 4 * step + 4])
        fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[4 * step : 4 * step + 4].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and args.save_first:
            fabric.save(args.save_first, {**state, "step": 1})
    state["step"] = args.steps
    fabric.save(args.out, state)
