"""Forwards out of the usual forward-backward order, each against a DDP-style reference (the plain model, its
gradients averaged over ranks with ``all_reduce``): an evaluation forward between a forward and its backward,
a forward that never gets a backward, what a forward without gradients leaves behind, and a validation run in
the middle of a ``grad_sync="step"`` accumulation window under the Trainer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

from lightning_shard import ShardStrategy
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.sharded_module import ShardedModule, shard_module
from lightning_shard.engine.unit import BackwardState, UnitState
from lightning_shard.testing import run_on_ranks
from tests.fits import full_params_shard, trainer_for
from tests.models import LitModel, MLPBlock, loader
from tests.test_parity import assert_same_training


class Chain(nn.Module):
    """Linear units in a row; ``skip_middle`` leaves the middle layer out (a forward whose order differs)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor, skip_middle: bool = False) -> Tensor:  # x: (B, 4)
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if not (skip_middle and i == 1):
                h = torch.tanh(layer(h))
        return self.head(h)


def _sharded_twin(strategy: str) -> tuple[Chain, Chain, ShardedModule]:
    """A plain reference model and a sharded copy of it (each Linear a unit)."""
    torch.manual_seed(0)
    reference, model = Chain(), Chain()
    model.load_state_dict(reference.state_dict())
    parsed = ShardingStrategy.parse(strategy)
    mesh = build_shard_mesh(parsed, None)
    engine = shard_module(model, mesh, parsed, resolve_wrap_policy({nn.Linear}), torch.device("cpu"))
    return reference, model, engine


def _batch(rank: int, step: int) -> Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(out: Tensor) -> Tensor:
    return out.square().mean()


def _ddp_grads(reference: nn.Module, xs: list[Tensor], world_size: int, **kwargs: bool) -> dict[str, Tensor]:
    """The reference: this rank's gradient of ``_loss`` summed over the micro-batches ``xs``, averaged over
    ranks; parameters that took no part have none."""
    params = list(reference.parameters())
    grads = torch.autograd.grad(sum(_loss(reference(x, **kwargs)) for x in xs), params, allow_unused=True)
    averaged = {}
    for (name, _), g in zip(reference.named_parameters(), grads):
        if g is not None:
            g = g.clone()
            dist.all_reduce(g)
            averaged[name] = g / world_size
    return averaged


def _assert_grads(engine: ShardedModule, expected: dict[str, Tensor]) -> None:
    for p in engine.sharded_params():
        if p.fqn not in expected:
            assert p.sharded.grad is None, f"{p.fqn} took no part in the step: no gradient, as with DDP"
            continue
        assert p.sharded.grad is not None, p.fqn
        torch.testing.assert_close(engine.gather_full(p, p.sharded.grad), expected[p.fqn], msg=_named(p.fqn))


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def _warm_up(model: nn.Module, rank: int) -> None:
    """Two plain training steps (gradients cleared afterwards): the engine has recorded the forward order, so
    what comes next prefetches along it."""
    for step in (-2, -1):
        _loss(model(_batch(rank, step))).backward()
    for p in model.parameters():
        p.grad = None


@contextmanager
def _evaluating(model: nn.Module, mode: Callable[[], AbstractContextManager]) -> Iterator[None]:
    """``model.eval()`` and a grad-free mode for the duration, as Lightning's validation loop does."""
    model.eval()
    try:
        with mode():
            yield
    finally:
        model.train()


NO_GRAD_MODES: dict[str, Callable[[nn.Module], AbstractContextManager]] = {
    "no_grad": lambda model: torch.no_grad(),
    "eval_no_grad": lambda model: _evaluating(model, torch.no_grad),
    "inference_mode": lambda model: _evaluating(model, torch.inference_mode),
}


# --------------------------------------------------------------------------------------------------
# A forward without gradients between a forward and its backward
# --------------------------------------------------------------------------------------------------


@contextmanager
def _held(engine: ShardedModule, hold: bool) -> Iterator[None]:
    """Gradients left unreduced on the unsharded faces while ``hold`` (``grad_sync="step"`` inside an accumulation
    window, as ``ShardStrategy.block_backward_sync`` does)."""
    engine.hold_gradients(hold)
    try:
        yield
    finally:
        engine.hold_gradients(False)


def _first_micro_batch(model: nn.Module, engine: ShardedModule, rank: int, window: str) -> list[Tensor]:
    """With ``window="held"``, a micro-batch whose gradients stay unreduced (the step ends later); the batches
    it ran, for the reference."""
    if window != "held":
        return []
    x = _batch(rank, 3)
    with _held(engine, True):
        _loss(model(x)).backward()
    return [x]


def eval_forward_before_backward(rank: int, world_size: int, strategy: str, mode: str, window: str) -> None:
    reference, model, engine = _sharded_twin(strategy)
    _warm_up(model, rank)
    before = _first_micro_batch(model, engine, rank, window)
    x = _batch(rank, 1)
    expected = _ddp_grads(reference, [*before, x], world_size)
    loss = _loss(model(x))
    with NO_GRAD_MODES[mode](model):
        model(_batch(rank, 2))
    loss.backward()
    _assert_grads(engine, expected)


@pytest.mark.parametrize("window", ["one_batch", "held"])
@pytest.mark.parametrize("mode", ["no_grad", "eval_no_grad", "inference_mode"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_an_evaluation_forward_between_forward_and_backward_keeps_the_gradients(
    strategy: str, mode: str, window: str
) -> None:
    run_on_ranks(eval_forward_before_backward, 2, strategy, mode, window)


# --------------------------------------------------------------------------------------------------
# A forward that never gets a backward
# --------------------------------------------------------------------------------------------------


def _sgd_step(optimizer: torch.optim.SGD, reference: nn.Module, expected: dict[str, Tensor]) -> None:
    """One step of ``optimizer`` (plain SGD) on the sharded model and the same step on the reference, with the
    reference gradients."""
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.add_(expected[name], alpha=-optimizer.param_groups[0]["lr"])


def abandoned_forward(rank: int, world_size: int, strategy: str, window: str) -> None:
    reference, model, engine = _sharded_twin(strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # over the sharded faces, as set up for training
    _warm_up(model, rank)
    if window == "held":  # abandoned inside an accumulation window, between two micro-batches
        before = _first_micro_batch(model, engine, rank, window)
        with _held(engine, True):
            abandoned = _loss(model(_batch(rank, 1)))  # kept alive, never backpropagated
    else:  # abandoned after a step's backward, before its optimizer step: the next forward sees the new weights
        before, x0 = [], _batch(rank, 0)
        _loss(model(x0)).backward()
        abandoned = _loss(model(_batch(rank, 1)))
        _sgd_step(optimizer, reference, _ddp_grads(reference, [x0], world_size))
    x = _batch(rank, 2)
    expected = _ddp_grads(reference, [*before, x], world_size)
    _loss(model(x)).backward()
    _assert_grads(engine, expected)
    del abandoned


@pytest.mark.parametrize("window", ["one_batch", "held"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_a_forward_without_backward_leaves_nothing_in_the_next_steps_gradients(strategy: str, window: str) -> None:
    run_on_ranks(abandoned_forward, 2, strategy, window)


# --------------------------------------------------------------------------------------------------
# What a forward without gradients leaves behind
# --------------------------------------------------------------------------------------------------


def _gathered(engine: ShardedModule) -> Iterator[str]:
    """Units not back to SHARDED, or whose unsharded buffer still holds memory."""
    for unit in engine.units:
        holds = unit.materializes and unit.flat_unsharded.untyped_storage().size() != 0
        if unit.state is not UnitState.SHARDED or holds:
            yield f"{unit.name or '<root>'}: {unit.state.name}, unsharded storage {holds and 'kept' or 'freed'}"


def no_grad_forward_reshards(rank: int, world_size: int, strategy: str, mode: str, forward: str) -> list[str]:
    _, model, engine = _sharded_twin(strategy)
    _warm_up(model, rank)
    x = _batch(rank, 1)
    with NO_GRAD_MODES[mode](model):
        match forward:
            case "same_order":
                model(x)
            case "unit_skipped":  # the unit after layers.0 in the recorded order does not run
                model(x, skip_middle=True)
            case "one_unit_alone":  # a unit called outside the root's forward
                model.layers[0](model.embed(x))
    return list(_gathered(engine))


@pytest.mark.parametrize("forward", ["same_order", "unit_skipped", "one_unit_alone"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_a_forward_without_gradients_leaves_every_unit_sharded_and_freed(
    strategy: str, mode: str, forward: str
) -> None:
    for left in run_on_ranks(no_grad_forward_reshards, 2, strategy, mode, forward):
        assert left == []


def step_skipping_a_unit(rank: int, world_size: int, strategy: str) -> list[str]:
    reference, model, engine = _sharded_twin(strategy)
    _warm_up(model, rank)  # the recorded order has every unit
    x = _batch(rank, 1)
    expected = _ddp_grads(reference, [x], world_size, skip_middle=True)
    assert "layers.1.weight" not in expected
    _loss(model(x, skip_middle=True)).backward()
    _assert_grads(engine, expected)
    return list(_gathered(engine))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_a_step_that_skips_a_unit_gets_the_reference_gradients_and_leaves_every_unit_sharded(strategy: str) -> None:
    for left in run_on_ranks(step_skipping_a_unit, 2, strategy):
        assert left == []


# --------------------------------------------------------------------------------------------------
# Validation inside an accumulation window (Trainer)
# --------------------------------------------------------------------------------------------------


class Validated(LitModel):
    """Records the validation losses too, and whether gradients were held unreduced when each validation began."""

    def __init__(self) -> None:
        super().__init__("mlp")
        self.val_losses: list[float] = []
        self.held_at_validation: list[bool] = []

    def on_validation_start(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, ShardStrategy):
            self.held_at_validation.append(any(u.backward_state is BackwardState.HELD for u in strategy.engine.units))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(F.cross_entropy(self(x), y).item())


# Six optimizer steps of two micro-batches; validation after every third batch: after the first micro-batch of a
# window (batches 3 and 9) and after the last one (batches 6 and 12).
_MID_WINDOW = {"accumulate_grad_batches": 2, "val_check_interval": 3, "limit_val_batches": 2,
               "num_sanity_val_steps": 0}


def validation_mid_window(rank: int, world_size: int, use_ddp: bool) -> dict:
    L.seed_everything(0)
    module = Validated()
    shard = None if use_ddp else ShardStrategy(auto_wrap_policy={MLPBlock}, grad_sync="step")
    trainer = trainer_for(shard or DDPStrategy(), world_size, steps=6, **_MID_WINDOW)
    trainer.fit(module, train_dataloaders=loader("mlp"), val_dataloaders=loader("mlp"))
    if shard is not None:
        params = full_params_shard(shard)
    else:
        params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return {"losses": module.losses, "val_losses": module.val_losses, "params": params,
            "held_at_validation": module.held_at_validation}


def test_validation_inside_a_step_accumulation_window_matches_ddp() -> None:
    ours = run_on_ranks(validation_mid_window, 2, False)
    reference = run_on_ranks(validation_mid_window, 2, True)
    assert_same_training(ours, reference)
    for a, b in zip(ours, reference):
        assert a["held_at_validation"] == [True, False, True, False]  # two of the four validations are mid-window
        assert len(a["val_losses"]) == len(b["val_losses"]) == 4 * 2
        torch.testing.assert_close(torch.tensor(a["val_losses"]), torch.tensor(b["val_losses"]))
