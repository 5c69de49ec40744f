"""``Trainer(num_nodes=2, devices=2)`` under two torchrun agents (two simulated nodes on this machine): the same fit
under DDP, FULL_SHARD and HYBRID_SHARD with its default mesh, one after the other on one process group.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29500 \\
        tests/scripts/multinode_fit.py --root /tmp/multinode &
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr 127.0.0.1 --master-port 29500 \\
        tests/scripts/multinode_fit.py --root /tmp/multinode

Each rank saves ``<root>/<strategy>-<rank>.pt``: its per-step losses, the full trained parameters, and for ours
the ``(replicas, shard_size)`` mesh it trained on.
"""

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard import ShardStrategy  # noqa: E402
from tests.fits import full_params_shard  # noqa: E402
from tests.models import block_class, lit_model, loader  # noqa: E402

KIND = "gpt"
STRATEGIES = ("ddp", "FULL_SHARD", "HYBRID_SHARD")


def fit(strategy_name: str) -> dict:
    L.seed_everything(0, verbose=False)
    module = lit_model(KIND)
    if strategy_name == "ddp":
        strategy: DDPStrategy | ShardStrategy = DDPStrategy()
    else:
        strategy = ShardStrategy(auto_wrap_policy={block_class(KIND)}, sharding_strategy=strategy_name)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=10, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader(KIND))
    if isinstance(strategy, ShardStrategy):
        mesh = (strategy.mesh.replicas, strategy.mesh.shard_size)
        return {"losses": module.losses, "params": full_params_shard(strategy), "mesh": mesh, "node": trainer.node_rank}
    params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "params": params, "mesh": None, "node": trainer.node_rank}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.root.mkdir(parents=True, exist_ok=True)
    for name in STRATEGIES:
        result = fit(name)
        torch.save(result, args.root / f"{name}-{torch.distributed.get_rank()}.pt")
