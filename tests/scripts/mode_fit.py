"""One user-facing mode, run the way a user runs it: a fresh script where ``ShardStrategy`` itself creates the process
group (nothing distributed ran before it in the process), then the same fit under DDP in the same process as the
reference. Under Lightning's own launcher (run with ``python``; for two nodes, once per node with ``NODE_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` set) or under torchrun:

    python tests/scripts/mode_fit.py --front fabric --devices 4 --sharding HYBRID_SHARD --mesh 2,2 --root /tmp/m
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500 \\
        tests/scripts/mode_fit.py --front trainer --devices 2 --num-nodes 2 --sharding HYBRID_SHARD --root /tmp/m

Each rank saves ``<root>/shard-<rank>.pt`` and ``<root>/ddp-<rank>.pt``: its per-step losses, the full trained
parameters, and for ours the ``(replicas, shard_size)`` mesh it trained on and whether the strategy created the
process group.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning_shard  # noqa: E402
import lightning_shard.fabric  # noqa: E402
from lightning_shard.engine import sharded_module_of  # noqa: E402
from tests.fabric_fits import optimizer_for  # noqa: E402
from tests.fits import full_params  # noqa: E402
from tests.models import GPTBlock, TinyGPT, block_class, lit_model, loader, make_dataset  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 8


def shard_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"sharding_strategy": args.sharding}
    if args.mesh != "default":
        kwargs["device_mesh"] = tuple(int(n) for n in args.mesh.split(","))
    return kwargs


def trainer_fit(args: argparse.Namespace, ours: bool) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = lit_model("gpt")
    strategy: Any
    if ours:
        strategy = lightning_shard.ShardStrategy(auto_wrap_policy={block_class("gpt")}, **shard_kwargs(args))
    else:
        strategy = "ddp"
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    created = not dist.is_initialized()
    trainer.fit(module, train_dataloaders=loader("gpt", batch_size=GLOBAL_BATCH // trainer.world_size))
    if ours:
        mesh = (strategy.mesh.replicas, strategy.mesh.shard_size)
        return {"losses": module.losses, "params": full_params(strategy.engine), "mesh": mesh, "created": created}
    return {"losses": module.losses, "params": {n: p.detach().clone() for n, p in module.named_parameters()}}


def fabric_fit(args: argparse.Namespace, ours: bool) -> dict[str, Any]:
    strategy: Any
    if ours:
        strategy = lightning_shard.fabric.ShardStrategy(auto_wrap_policy={GPTBlock}, **shard_kwargs(args))
    else:
        strategy = "ddp"
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
    created = not dist.is_initialized()
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup_module(TinyGPT())
    optimizer = fabric.setup_optimizers(optimizer_for(model))
    data = make_dataset("gpt", n=STEPS * GLOBAL_BATCH)
    local = GLOBAL_BATCH // fabric.world_size
    losses = []
    for step in range(STEPS):
        start = step * GLOBAL_BATCH + fabric.global_rank * local
        x, y = data[start : start + local]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if ours:
        engine = sharded_module_of(model.module)
        assert engine is not None
        mesh = (strategy.mesh.replicas, strategy.mesh.shard_size)
        return {"losses": losses, "params": full_params(engine), "mesh": mesh, "created": created}
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=["trainer", "fabric"], required=True)
    parser.add_argument("--sharding", default="HYBRID_SHARD")
    parser.add_argument("--mesh", default="default", help="'default' or 'replicas,shard_size'")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fit = trainer_fit if args.front == "trainer" else fabric_fit
    ours = fit(args, ours=True)  # first: the strategy creates the process group
    reference = fit(args, ours=False)
    rank = dist.get_rank()
    args.root.mkdir(parents=True, exist_ok=True)
    torch.save(ours, args.root / f"shard-{rank}.pt")
    torch.save(reference, args.root / f"ddp-{rank}.pt")
