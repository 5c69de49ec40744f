"""The buffer pool: a step's buffers come from memory the engine already holds, so that after the second step
training allocates no new unsharded, gradient, staging or receive buffer, without holding more unit buffers than
are gathered at once."""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shard.engine import collectives
from lightning_shard.engine.buffer_pool import BufferPool
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.mixed_precision import MixedPrecision
from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.sharded_module import shard_module
from lightning_shard.testing import run_on_ranks


def test_drain_and_fill_move_memory_under_every_view() -> None:
    pool = BufferPool()
    flat = torch.zeros(64, dtype=torch.uint8)
    view = flat[8:16].view(torch.float32)  # a face, as autograd would have saved it
    storage = flat.untyped_storage()
    pool.drain(storage)
    assert storage.nbytes() == 0 and pool.free_bytes == 64
    pool.fill(storage, 64)
    assert storage.nbytes() == 64 and pool.free_bytes == 0 and pool.allocations == 0  # the block it held
    flat[8:16].view(torch.float32).fill_(2.5)
    assert view.tolist() == [2.5, 2.5]
    pool.drain(storage)
    pool.fill(storage, 64)
    assert pool.allocations == 0


def test_a_block_given_back_is_taken_again() -> None:
    pool = BufferPool()
    first = pool.take(128, torch.device("cpu"))
    pool.give(first)
    again = pool.take(128, torch.device("cpu"))
    assert again.data_ptr() == first.data_ptr() and pool.allocations == 1
    assert pool.take(256, torch.device("cpu")).data_ptr() != first.data_ptr() and pool.allocations == 2


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(F.gelu(self.fc(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def steady_state(rank: int, world_size: int, strategy: str, precision: str, path: str) -> dict:
    torch.manual_seed(0)
    model = Tiny()
    mixed = None
    if precision == "bf16":
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    mesh = build_shard_mesh(ShardingStrategy.parse(strategy), None)
    fast_path = path == "point-to-point"
    with unittest.mock.patch.object(collectives, "exchanges_point_to_point", lambda *_: fast_path):
        engine = shard_module(model, mesh, ShardingStrategy.parse(strategy), resolve_wrap_policy({Block}),
                              torch.device("cpu"), mixed_precision=mixed)
        blocks = engine.units[1:]
        block_bytes = blocks[0].flat_unsharded.nbytes

        def blocks_held() -> int:  # block-sized unsharded buffers in use or kept free by the pool
            free = engine.pool._free.get((torch.device("cpu"), block_bytes), [])
            return sum(not u.is_sharded for u in blocks) + len(free)

        held_at_once, fill, drain = 0, engine.pool.fill, engine.pool.drain

        def watched_fill(storage: torch.UntypedStorage, nbytes: int) -> None:
            nonlocal held_at_once
            fill(storage, nbytes)
            held_at_once = max(held_at_once, blocks_held())

        def watched_drain(storage: torch.UntypedStorage) -> None:
            nonlocal held_at_once
            held_at_once = max(held_at_once, blocks_held())  # the unit still counts as gathered until drained
            drain(storage)

        engine.pool.fill, engine.pool.drain = watched_fill, watched_drain  # type: ignore[method-assign]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        allocations, grad_memory, held_after_backward = [], [], []
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            held_after_backward.append(blocks_held())
            grad_memory.append([p.sharded.grad.data_ptr() for p in engine.sharded_params()])
            optimizer.step()
            optimizer.zero_grad()
            allocations.append(engine.pool.allocations)
    return {
        "new_per_step": [b - a for a, b in zip(allocations, allocations[1:])],
        "grad_memory": grad_memory,
        "materializes": blocks[0].materializes,
        "held_at_once": held_at_once,
        "held_after_backward": held_after_backward,
    }


@pytest.mark.parametrize(
    ("strategy", "precision", "path", "materializes", "held_at_once", "held_after_backward"),
    [
        # gloo's exchange, received straight into the gradients' memory: two gathered units at most, the last
        # unit's block kept after backward
        ("FULL_SHARD", "fp32", "point-to-point", True, 2, 1),
        ("FULL_SHARD", "bf16", "point-to-point", True, 2, 1),  # cast staging for the gather, fp32 receive buffer
        # The path NCCL takes: the rank-major gather's staging has a unit buffer's size, so it counts as one more
        # block (in use during a gather, kept free in the pool afterwards).
        ("FULL_SHARD", "fp32", "rank-major", True, 3, 2),
        ("NO_SHARD", "fp32", "point-to-point", False, 0, 0),  # replicas only: the all-reduce buffer, no unit buffer
    ],
)
def test_steps_reuse_their_buffers_without_raising_the_peak(
    strategy: str, precision: str, path: str, materializes: bool, held_at_once: int, held_after_backward: int
) -> None:
    for result in run_on_ranks(steady_state, 2, strategy, precision, path):
        assert result["materializes"] is materializes
        # After the second step a step allocates no buffer but the one block given back for the end of backward.
        new = result["new_per_step"]
        assert new[1] == new[2] == (1 if materializes else 0), new
        # The shards' gradients are the same memory step after step (written in place after zero_grad()).
        assert result["grad_memory"][1] == result["grad_memory"][2] == result["grad_memory"][3]
        # Never more unit-sized blocks than the gathered units need, and only the last unit's when backward ends.
        assert result["held_at_once"] == held_at_once, result
        assert result["held_after_backward"] == [held_after_backward] * 4, result


def reductions_in_flight(rank: int, world_size: int, path: str) -> dict:
    torch.manual_seed(0)
    model = Tiny()
    mesh = build_shard_mesh(ShardingStrategy.FULL_SHARD, None)
    fast_path = path == "point-to-point"
    with unittest.mock.patch.object(collectives, "exchanges_point_to_point", lambda *_: fast_path):
        engine = shard_module(model, mesh, ShardingStrategy.FULL_SHARD, resolve_wrap_policy({Block}),
                              torch.device("cpu"))
        # When a unit's gradient is computed (the engine's hook runs first), is another unit's reduction, and so
        # its unsharded gradients, still in flight?
        overlapping, finished = [], 0
        for unit in engine.units:
            for p in unit.trainable:
                def check(_param: Tensor, unit=unit) -> None:  # noqa: ANN001
                    other = engine._pending_reduction is not None and engine._pending_reduction_unit is not unit
                    overlapping.append(other)
                p.unsharded.register_post_accumulate_grad_hook(check)
        finish = engine._finish_reduction

        def counted_finish() -> None:
            nonlocal finished
            finished += engine._pending_reduction is not None
            finish()

        engine._finish_reduction = counted_finish  # type: ignore[method-assign]
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
    return {"overlapping": sum(overlapping), "gradients": len(overlapping), "finished": finished}


@pytest.mark.parametrize("path", ["point-to-point", "rank-major"])
def test_a_reduction_finishes_before_the_next_units_gradients_pile_up(path: str) -> None:
    # A unit's reduction holds its gradients (on gloo, sent straight from autograd's tensors) until it completes.
    # It overlaps the start of the next unit's backward, but is finished at that unit's first gradient: a step
    # never holds two units' unsharded gradients at once (the peak of a large model's step on CPU).
    for result in run_on_ranks(reductions_in_flight, 2, path):
        assert result["gradients"] == 2 * (4 + 4 * 6), result  # each step: the root's 2 Linear, 4 blocks' 3 modules
        assert result["finished"] == 2 * 5, result  # every unit's reduction, each step (the root's too)
        assert result["overlapping"] == 0, result
