"""Tensor parallelism with sharding from a plain PyTorch script, as a user runs it under torchrun (4 processes):

    torchrun --nproc-per-node 4 tests/scripts/tensor_parallel_torchrun.py

The script creates the process group and the ("data_parallel", "tensor_parallel") mesh, applies a Colwise/Rowwise
plan, shards with ``shard_model(..., tensor_parallel_size=2)``, and trains three clipped AdamW steps. Each rank
checks its losses, clipping norms and the whole weights (``summon_full_params``) against the unsharded model on the
global batch at ``assert_close`` defaults; the exit status says whether they agree.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_shard.engine import clip_grad_norm_, shard_model, summon_full_params

TP = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), Block(), Block(), nn.Linear(8, 1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference, model = build(), build()
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("data_parallel", "tensor_parallel"))
    for block in (model[1], model[2]):
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    shard_model(model, auto_wrap_policy={Block}, tensor_parallel_size=TP, device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    data_parallel, mine = world // TP, rank // TP
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4 * data_parallel, 5, generator=g), torch.randn(4 * data_parallel, 1, generator=g)
        loss = nn.functional.mse_loss(model(x[4 * mine : 4 * mine + 4]), y[4 * mine : 4 * mine + 4])
        loss.backward()
        norm = clip_grad_norm_(model, 0.3)
        optimizer.step()
        optimizer.zero_grad()
        per_rank = [nn.functional.mse_loss(reference(x[4 * d : 4 * d + 4]), y[4 * d : 4 * d + 4])
                    for d in range(data_parallel)]  # fmt: skip
        expected = sum(per_rank) / data_parallel
        expected.backward()  # type: ignore[union-attr]
        torch.testing.assert_close(loss, per_rank[mine])
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    with summon_full_params(model):
        for name, p in model.named_parameters():
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            torch.testing.assert_close(whole, dict(reference.named_parameters())[name].detach(), msg=name)
    dist.destroy_process_group()
