"""Gradient accumulation (both grad_sync modes), clipping by norm (the 2-norm and the inf-norm, one or two optimizers)
and by value, and activation checkpointing: fp32 parity with DDPStrategy at assert_close defaults."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from lightning_shard import ShardingStrategy, ShardStrategy
from lightning_shard.engine import collectives
from lightning_shard.engine.activation_checkpointing import apply_activation_checkpointing
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.sharded_module import shard_module
from lightning_shard.testing import run_on_ranks
from tests.fits import fit_ddp, fit_shard, full_params_shard, trainer_for
from tests.models import LitModel, MLPStack, SGDLitModel, block_class, loader
from tests.test_parity import assert_same_training


@functools.cache
def ddp(kind: str, world_size: int, **trainer_kwargs: object) -> list[dict]:
    return run_on_ranks(fit_ddp, world_size, kind, 10, trainer_kwargs)


def shard(kind: str, world_size: int, trainer_kwargs: dict, **strategy_kwargs: object) -> list[dict]:
    return run_on_ranks(fit_shard, world_size, kind, 10, trainer_kwargs, **strategy_kwargs)


@pytest.mark.parametrize("grad_sync", ["microbatch", "step"])
@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_gradient_accumulation_matches_ddp(grad_sync: str, sharding: str) -> None:
    ours = shard("gpt", 2, {"accumulate_grad_batches": 3}, grad_sync=grad_sync, sharding_strategy=sharding)
    assert_same_training(ours, ddp("gpt", 2, accumulate_grad_batches=3))


@pytest.mark.parametrize(("algorithm", "value"), [("norm", 0.05), ("value", 0.001)])
@pytest.mark.parametrize(("world_size", "sharding", "mesh"), [(2, "FULL_SHARD", None), (4, "HYBRID_SHARD", (2, 2))])
def test_gradient_clipping_matches_ddp(
    algorithm: str, value: float, world_size: int, sharding: str, mesh: tuple[int, int] | None
) -> None:
    kwargs = {"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}
    strategy_kwargs = {"sharding_strategy": sharding} | ({"device_mesh": mesh} if mesh else {})
    ours = shard("mlp", world_size, kwargs, **strategy_kwargs)
    reference = ddp("mlp", world_size, **kwargs)
    assert_same_training(ours, reference)
    unclipped = ddp("mlp", world_size)
    assert not torch.allclose(torch.tensor(reference[0]["losses"]), torch.tensor(unclipped[0]["losses"]))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_activation_checkpointing_matches_ddp(kind: str) -> None:
    block = {"mlp": "MLPBlock", "gpt": "GPTBlock"}[kind]
    ours = shard(kind, 2, {}, activation_checkpointing_policy=[block])
    assert_same_training(ours, ddp(kind, 2))


class NormLogger(LitModel):
    """Records the total gradient norm before each optimizer step, the way each strategy exposes it."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, ShardStrategy):
            norm = strategy.clip_grad_norm_()  # max_norm=inf: only measures
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), float("inf"))
        self.norms.append(norm.item())


def logged_norms(rank: int, world_size: int, use_ddp: bool, strategy_kwargs: dict) -> list[float]:
    L.seed_everything(0)
    module = NormLogger("gpt")
    strategy = DDPStrategy() if use_ddp else ShardStrategy(auto_wrap_policy={"GPTBlock"}, **strategy_kwargs)
    trainer_for(strategy, world_size, steps=5).fit(module, train_dataloaders=loader("gpt"))
    return module.norms


@pytest.mark.parametrize(("world_size", "kwargs"), [(2, {}), (4, {"sharding_strategy": "HYBRID_SHARD",
                                                                   "device_mesh": (2, 2)})])
def test_clip_grad_norm_returns_the_global_norm_on_every_rank(world_size: int, kwargs: dict) -> None:
    ours = run_on_ranks(logged_norms, world_size, False, kwargs)
    reference = run_on_ranks(logged_norms, world_size, True, {})
    for norms in ours:
        assert norms == ours[0]  # identical on every rank
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(reference[0]))


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        def block() -> torch.nn.Module:  # activations inside a block dominate what a block saves
            return torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())])

        self.layers = torch.nn.Sequential(*[block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def saved_activations(rank: int, world_size: int, checkpointing: bool) -> dict:
    torch.manual_seed(0)
    model = Chain()
    mesh = build_shard_mesh(ShardingStrategy.FULL_SHARD, None)
    policy = resolve_wrap_policy({torch.nn.Sequential})
    engine = shard_module(model.layers, mesh, ShardingStrategy.FULL_SHARD, policy, torch.device("cpu"))
    if checkpointing:
        apply_activation_checkpointing(model.layers, policy)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel()
        return t

    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(rank))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    grads = {p.fqn: engine.gather_full(p, p.sharded.grad) for p in engine.sharded_params()}
    return {"saved": saved, "grads": grads}


def test_activation_checkpointing_drops_saved_activations_and_keeps_gradients() -> None:
    plain = run_on_ranks(saved_activations, 2, False)
    checkpointed = run_on_ranks(saved_activations, 2, True)
    for a, b in zip(plain, checkpointed):
        assert b["saved"] < a["saved"] / 2, (a["saved"], b["saved"])
        for name, g in a["grads"].items():
            torch.testing.assert_close(b["grads"][name], g, msg=name)


def reductions_per_step(rank: int, world_size: int, grad_sync: str) -> dict:
    counted = {"reduce_bytes": 0, "peak_held_grad_bytes": 0}

    class Probe(LitModel):
        def on_after_backward(self) -> None:  # gradients still held on the unsharded weights
            engine = self.trainer.strategy.engine
            held = sum(p.unsharded.grad.nbytes for p in engine.sharded_params() if p.unsharded.grad is not None)
            counted["peak_held_grad_bytes"] = max(counted["peak_held_grad_bytes"], held)

    L.seed_everything(0)
    module = Probe("gpt")
    strategy = ShardStrategy(auto_wrap_policy={"GPTBlock"}, grad_sync=grad_sync)
    trainer = trainer_for(strategy, world_size, steps=2, accumulate_grad_batches=4)
    before = collectives.STATS.reduce_bytes  # every gradient reduction the engine issues, whatever the backend's path
    trainer.fit(module, train_dataloaders=loader("gpt"))
    counted["reduce_bytes"] = collectives.STATS.reduce_bytes - before
    counted["trainable_bytes"] = sum(p.numel * 4 for p in strategy.engine.sharded_params() if p.requires_grad)
    return counted


def test_grad_sync_step_reduces_once_per_step_and_holds_full_gradients() -> None:
    micro = run_on_ranks(reductions_per_step, 2, "microbatch")[0]
    step = run_on_ranks(reductions_per_step, 2, "step")[0]
    # 2 optimizer steps of 4 micro-batches: "microbatch" reduces 4x as often.
    assert step["reduce_bytes"] > 0 and micro["reduce_bytes"] == 4 * step["reduce_bytes"]
    assert micro["peak_held_grad_bytes"] == 0  # reduced right away: nothing full-size is held
    assert step["peak_held_grad_bytes"] == step["trainable_bytes"]  # every trainable parameter's full gradient


# Clipping by the inf-norm #

INF_CLIP = 0.2  # most steps have a larger |gradient| (and are clipped), a few a smaller one (and are not)


class InfNormClipped(SGDLitModel):
    """Clips every optimizer step by the inf-norm (the largest |gradient| element) from the Trainer's clipping hook:
    through ``ShardStrategy.clip_grad_norm_`` on shards, ``torch.nn.utils.clip_grad_norm_`` under DDP. SGD, so that
    the clip coefficient shows in the parameters. Records the norm each clip returned."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.norms: list[float] = []

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        assert gradient_clip_val is not None and gradient_clip_algorithm == "norm"
        params = [p for group in optimizer.param_groups for p in group["params"]]
        strategy = self.trainer.strategy
        if isinstance(strategy, ShardStrategy):
            norm = strategy.clip_grad_norm_(params, gradient_clip_val, norm_type=float("inf"))
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, gradient_clip_val, norm_type=float("inf"))
        self.norms.append(norm.item())


def fit_inf_norm_clipped(rank: int, world_size: int, kind: str, use_ddp: bool, strategy_kwargs: dict) -> dict:
    L.seed_everything(0)
    module = InfNormClipped(kind)
    strategy = DDPStrategy() if use_ddp else ShardStrategy(auto_wrap_policy={block_class(kind)}, **strategy_kwargs)
    trainer = trainer_for(strategy, world_size, 10, gradient_clip_val=INF_CLIP, gradient_clip_algorithm="norm")
    trainer.fit(module, train_dataloaders=loader(kind))
    if use_ddp:
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    else:
        params = full_params_shard(strategy)
    return {"losses": module.losses, "params": params, "norms": module.norms}


@pytest.mark.parametrize(
    ("world_size", "kind", "kwargs"),
    [(3, "uneven", {}), (2, "mlp", {"sharding_strategy": "SHARD_GRAD_OP"})],
    ids=["3-ranks-uneven-full-shard", "2-ranks-shard-grad-op"],
)
def test_inf_norm_clipping_matches_ddp(world_size: int, kind: str, kwargs: dict) -> None:
    ours = run_on_ranks(fit_inf_norm_clipped, world_size, kind, False, kwargs)
    reference = run_on_ranks(fit_inf_norm_clipped, world_size, kind, True, {})
    assert sum(n > INF_CLIP for n in reference[0]["norms"]) >= 5  # the clip was active
    for a in ours:
        assert a["norms"] == ours[0]["norms"], (a["norms"], ours[0]["norms"])  # bit for bit on every rank
    torch.testing.assert_close(torch.tensor(ours[0]["norms"]), torch.tensor(reference[0]["norms"]))
    assert_same_training(ours, reference)


# Clipping with two optimizers #

BODY_CLIP, HEAD_CLIP = 0.3, 0.1


class TwoOptimizersClipped(L.LightningModule):
    """Manual optimization with two SGD optimizers over disjoint parameters: the input layer and blocks, and the head
    (the input layer and the head share the root unit). Each step's gradients are clipped by the norm of that
    optimizer's own gradients while the other optimizer's gradients are present too (``zero_grad`` clears only its
    own). Records the norm of each optimizer's gradients before its clip."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = MLPStack()
        self.losses: list[float] = []
        self.norms: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        for opt, clip in zip(self.optimizers(), (BODY_CLIP, HEAD_CLIP)):
            loss = F.cross_entropy(self.model(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            self.norms.append(self._grad_norm(opt))
            self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")
            opt.step()
            self.losses.append(loss.item())

    def _grad_norm(self, optimizer: torch.optim.Optimizer) -> float:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        strategy = self.trainer.strategy
        if isinstance(strategy, ShardStrategy):
            return strategy.clip_grad_norm_(params).item()  # max_norm=inf: only measures
        return torch.nn.utils.clip_grad_norm_(params, float("inf")).item()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        head = list(self.model.head.parameters())
        body = [p for n, p in self.model.named_parameters() if not n.startswith("head.")]
        return [torch.optim.SGD(body, lr=0.1, momentum=0.9), torch.optim.SGD(head, lr=0.1, momentum=0.9)]


def fit_two_optimizers_clipped(rank: int, world_size: int, use_ddp: bool) -> dict:
    L.seed_everything(0)
    module = TwoOptimizersClipped()
    strategy = DDPStrategy() if use_ddp else ShardStrategy(auto_wrap_policy={"MLPBlock"})
    trainer_for(strategy, world_size, steps=10).fit(module, train_dataloaders=loader("mlp"))
    if use_ddp:
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    else:
        params = full_params_shard(strategy)
    return {"losses": module.losses, "params": params, "norms": module.norms}


def test_two_optimizers_each_clip_by_the_norm_of_their_own_gradients_as_ddp() -> None:
    ours = run_on_ranks(fit_two_optimizers_clipped, 2, False)
    reference = run_on_ranks(fit_two_optimizers_clipped, 2, True)
    body, head = reference[0]["norms"][0::2], reference[0]["norms"][1::2]
    assert min(body) > BODY_CLIP and min(head) > HEAD_CLIP  # every clip was active
    for a, b in zip(ours, reference):
        torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]))
    assert_same_training(ours, reference)
