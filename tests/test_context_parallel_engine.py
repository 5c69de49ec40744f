"""The engine with context parallelism, on pooled gloo ranks: Ulysses attention over a sequence split with the
causal load balance, the whole sequence's cross-entropy, parameters sharded over data x context ranks; steps
against the whole model on the global batch (what DDP computes), alone and composed with a tensor-parallel plan;
and what is refused. Under the strategies in fresh processes: tests/test_context_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shard.engine import clip_grad_norm_, shard_model, summon_full_params
from lightning_shard.engine.parallel import ContextParallel, ContextParallelError, ParallelDims
from lightning_shard.testing import RankFailure, run_on_ranks
from tests.context_parallel_models import HEADS, Block, CausalLM, lm_loss, tensor_parallel_plan, token_batches

BATCH = 2  # per data-parallel rank


def _whole(model: nn.Module) -> dict[str, Tensor]:
    from torch.distributed.tensor import DTensor

    with summon_full_params(model):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters()}  # fmt: skip


def _sharded(world_size: int, context: int, tensor: int) -> tuple[CausalLM, CausalLM, ContextParallel, int]:
    """The model sharded over data x context ranks (its plan applied first), an unsharded copy, and this rank's
    data-parallel rank."""
    from torch.distributed.tensor.parallel import parallelize_module

    dims = ParallelDims.of_world(world_size, context, tensor, rank=torch.distributed.get_rank())
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    reference, model = CausalLM(), CausalLM()
    model.load_state_dict(reference.state_dict())
    if tensor > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tensor_parallel"], tensor_parallel_plan())
    shard_model(model, auto_wrap_policy={Block}, tensor_parallel_size=tensor, device="cpu")
    return model, reference, ContextParallel.of(mesh["context_parallel"]), dims.data_parallel_rank


def steps_against_the_whole_model(rank: int, world_size: int, context: int, tensor: int) -> dict[str, Any]:
    model, reference, cp, dp_rank = _sharded(world_size, context, tensor)
    data = world_size // (context * tensor)
    # SGD: AdamW divides by the gradient's own size, so gradients at rounding level (summed in another order over
    # four ranks) would move weights by its learning rate; SGD moves them by what the gradients are
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for x, y, pos in token_batches(3, BATCH * data):
        mine = slice(BATCH * dp_rank, BATCH * (dp_rank + 1))
        bx, by, bpos = cp.split((x[mine], y[mine], pos[mine]))
        with cp.step(model):
            loss = lm_loss(model, bx, by, bpos)
        loss.backward()
        parts = [lm_loss(reference, x[BATCH * d : BATCH * (d + 1)], y[BATCH * d : BATCH * (d + 1)],
                         pos[BATCH * d : BATCH * (d + 1)]) for d in range(data)]  # fmt: skip
        (sum(parts) / data).backward()  # type: ignore[operator]
        losses.append(loss.detach())
        ref_losses.append(parts[dp_rank].detach())
        norms.append(clip_grad_norm_(model, 0.5))
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
            "params": _whole(model), "reference": {n: p.detach() for n, p in reference.named_parameters()}}  # fmt: skip


@pytest.mark.parametrize(
    ("world_size", "context", "tensor"),
    [(2, 2, 1), (4, 2, 1), (4, 4, 1), (4, 2, 2)],
    ids=["context2", "data2-context2", "context4", "context2-tensor2"],
)
def test_steps_equal_the_whole_model_on_the_global_batch(world_size: int, context: int, tensor: int) -> None:
    """Per-step losses (each the whole sequence's, on every context-parallel rank), clipping norms and the trained
    weights equal the unsharded model's on the global batch, averaged over the data-parallel ranks as DDP does."""
    for rank, result in enumerate(run_on_ranks(steps_against_the_whole_model, world_size, context, tensor)):
        torch.testing.assert_close(result["losses"], result["ref_losses"], msg=f"losses, rank {rank}")
        torch.testing.assert_close(result["norms"], result["ref_norms"], msg=f"norms, rank {rank}")
        assert result["params"].keys() == result["reference"].keys()
        for name, value in result["reference"].items():
            torch.testing.assert_close(result["params"][name], value, msg=f"{name}, rank {rank}")


def test_the_load_balance_gives_each_rank_an_early_and_a_late_chunk() -> None:
    """Rank ``i`` of ``C`` holds chunks ``i`` and ``2C - 1 - i`` of ``2C``; together the ranks hold every position
    once."""
    cps = [ContextParallel(None, 4, rank) for rank in range(4)]  # type: ignore[arg-type]
    assert cps[0].positions(16).tolist() == [0, 1, 14, 15]
    assert cps[3].positions(16).tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat([cp.positions(16) for cp in cps]).tolist()) == list(range(16))
    causal_work = [sum(p + 1 for p in cp.positions(16).tolist()) for cp in cps]  # keys each query attends to
    assert len(set(causal_work)) == 1


def test_split_takes_this_ranks_positions_of_every_sequence_tensor() -> None:
    cp = ContextParallel(None, 2, 1)  # type: ignore[arg-type]
    tokens = torch.arange(16).view(2, 8)
    batch = {"input_ids": tokens, "label": torch.tensor([3, 4]), "mask": torch.ones(2, 8, 5)}
    split = cp.split(batch)
    assert split["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert split["label"].tolist() == [3, 4] and split["mask"].shape == (2, 4, 5)


@pytest.mark.parametrize(
    ("batch", "message"),
    [((torch.zeros(2, 6), torch.zeros(2, 6)), "sequence length 6 .* not divisible by 2 \\* context_parallel_size = 4"),
     ((torch.zeros(2, 8), torch.zeros(2, 4)), "different lengths")],
    ids=["not-divisible", "different-lengths"],
)
def test_a_batch_that_cannot_split_is_refused(batch: Any, message: str) -> None:
    with pytest.raises(ContextParallelError, match=message):
        ContextParallel(None, 2, 0).split(batch)  # type: ignore[arg-type]


class _EagerAttention(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return (x @ x.transpose(-1, -2)).softmax(-1) @ x


class _Manual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(4, 4), _EagerAttention())

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


def refusals(rank: int, world_size: int, case: str) -> None:
    cp = ContextParallel.of(ParallelDims.of_world(world_size, world_size).build_mesh("cpu")["context_parallel"])
    if case == "no-attention":
        with cp.step(_Manual()):
            _Manual()(torch.zeros(1, 4, 4))
    q = torch.zeros(1, HEADS - 1 if case == "heads" else HEADS, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool) if case == "mask" else None
    with cp.step(nn.Identity()):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize(
    ("case", "message"),
    [("no-attention", "no torch.nn.functional.scaled_dot_product_attention call ran.*layer.1 \\(_EagerAttention\\)"),
     ("heads", "3 query heads, which context_parallel_size=2 does not divide"),
     ("mask", "attn_mask of shape \\(4, 4\\)")],
)
def test_attention_the_strategy_cannot_split_is_refused_naming_it(case: str, message: str) -> None:
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(refusals, 2, case)
