"""Pipeline parallelism run the way a user runs it: a fresh script under Lightning's launcher (``python``), where
``ShardStrategy`` itself creates the process group::

    python tests/scripts/pipeline_parallel_fit.py --role reference --devices 1 --root /tmp/pp   # DDP, the oracle
    python tests/scripts/pipeline_parallel_fit.py --role pipeline --devices 2 --root /tmp/pp    # two stages
    python tests/scripts/pipeline_parallel_fit.py --role resume --devices 1 --root /tmp/pp      # their save, P=1

Trains the test suite's causal language model (its embedding tied to its head) with
``ShardStrategy(pipeline_parallel_size=2)`` (1F1B, 2 microbatches, the stages split at its repeated blocks) for 10
steps in fp32 under the Trainer (clipped by the global norm) and saves it, then 3 steps under Fabric (GPipe),
where each rank also trains the unsplit model in plain PyTorch on the same batches. Every rank writes
``<root>/<role>-<rank>.pt``: the losses and the trained weights (the pipelined weights gathered from both stages).
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning_shard  # noqa: E402
from lightning_shard.engine.sharded_module import sharded_module_of  # noqa: E402
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy  # noqa: E402
from tests.context_parallel_models import Block, CausalLM, LitCausalLM, lm_loss, token_loader  # noqa: E402
from tests.fits import full_params  # noqa: E402


def whole_model_weights(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Both stages' weights, gathered to every rank."""
    engine = sharded_module_of(model)
    assert engine is not None
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, full_params(engine))
    return {name.removeprefix(prefix): value for part in parts for name, value in part.items()}


def oracle(steps: int) -> dict[str, Any]:
    """The unsplit model in plain PyTorch, on the batches ``fabric_fit`` trains on."""
    L.seed_everything(0, verbose=False)
    model = CausalLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for (x, y, pos), _ in zip(token_loader(batch=4), range(steps)):
        loss = lm_loss(model, x, y, pos)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def trainer_fit(role: str, devices: int, root: Path) -> dict[str, Any]:
    """The tied-embedding model, split at its repeated blocks (no auto_wrap_policy), saved at the end; the role
    ``resume`` loads that save without pipeline parallelism."""
    L.seed_everything(0, verbose=False)
    module = LitCausalLM(tied=True)
    if role == "reference":
        strategy: Any = DDPStrategy()
    else:
        strategy = lightning_shard.ShardStrategy(pipeline_parallel_size=2 if role == "pipeline" else 1,
                                                 microbatches=2)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=10, logger=False,
                        gradient_clip_val=0.5, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(module, train_dataloaders=token_loader(batch=4),
                ckpt_path=str(root / "pipeline.ckpt") if role == "resume" else None)  # fmt: skip
    if role == "reference":
        named = module.model.named_parameters(remove_duplicate=False)
        return {"losses": module.losses, "params": {n: p.detach().clone() for n, p in named}}
    if role == "pipeline":
        trainer.save_checkpoint(root / "pipeline.ckpt")
    return {"losses": module.losses, "params": whole_model_weights(module, prefix="model.")}


def fabric_fit(devices: int) -> dict[str, Any]:
    strategy = FabricShardStrategy(auto_wrap_policy={Block}, pipeline_parallel_size=2, pipeline_schedule="gpipe")
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    module = fabric.setup_module(CausalLM())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9))
    losses = []
    for (x, y, pos), _ in zip(token_loader(batch=4), range(3)):
        loss = lm_loss(module, x, y, pos)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": whole_model_weights(module.module)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["reference", "pipeline", "resume"], required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    created = not dist.is_initialized()
    result = {"trainer": trainer_fit(args.role, args.devices, args.root), "created": created}
    if args.role == "pipeline":
        result["fabric"], result["oracle"] = fabric_fit(args.devices), oracle(3)
    args.root.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.root / f"{args.role}-{dist.get_rank()}.pt")
