"""torch's Muon (hidden matrices) and AdamW (the rest), clipped by the user's own torch.nn.utils.clip_grad_norm_,
launched the way users launch it: a LightningModule with manual optimization under Lightning's subprocess launcher,
or a Fabric loop under torchrun:

    python tests/scripts/optimizer_fit.py --devices 2 --root /tmp/out
    torchrun --nproc-per-node 2 tests/scripts/optimizer_fit.py --front fabric --devices 2 --root /tmp/out

Each rank saves the trained parameters in full and the clipped norms as ROOT/shard-RANK.pt.
"""

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_shard import ShardStrategy  # noqa: E402
from tests.checkpoint_fits import module_full_state  # noqa: E402
from tests.models import GPTBlock, TinyGPT  # noqa: E402
from tests.optimizer_fits import (  # noqa: E402
    OptimizerRun,
    _batch,
    _loss,
    make_optimizers,
    newton_schulz_in_grad_dtype,
    sharded,
)

MAX_NORM = 0.05


class MuonModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = TinyGPT()
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = _batch(batch_idx, self.global_rank, self.trainer.world_size)
        loss = _loss(self.net, x, y)
        self.manual_backward(loss)
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)))
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):  # noqa: ANN201
        return make_optimizers(self.net, "muon")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=["trainer", "fabric"], default="trainer")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    newton_schulz_in_grad_dtype()
    if args.front == "fabric":  # the strategy creates the process group from torchrun's environment
        rank = int(os.environ["RANK"])
        result = sharded(rank, args.devices, OptimizerRun(optimizers="muon", steps=args.steps, clip=MAX_NORM))
        torch.save(result, args.root / f"shard-{rank}.pt")
        sys.exit(0)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=ShardStrategy(auto_wrap_policy={GPTBlock}),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    module = MuonModule()
    trainer.fit(module, DataLoader(list(range(args.steps)), batch_size=1))
    params = {name.removeprefix("net."): v for name, v in module_full_state(module, [])["params"].items()}
    torch.save({"params": params, "norms": module.norms}, args.root / f"shard-{trainer.global_rank}.pt")
