"""What the compatibility tests share: two-rank runs, small models in the spirit of Lightning's own tests, and errors
turned into data so that a rank reports them instead of failing the whole group."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.wrappers import _FabricModule
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from lightning_shard import ShardStrategy
from lightning_shard.engine import sharded_module_of
from lightning_shard.testing import run_on_ranks
from tests.checkpoint_fits import module_full_state
from tests.fits import full_params

WORLD_SIZE = 2


def on_ranks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """``fn(rank, WORLD_SIZE, *args, **kwargs)`` on every rank; the results in rank order."""
    return run_on_ranks(fn, WORLD_SIZE, *args, timeout=240.0, **kwargs)


def raised(fn: Callable[[], Any]) -> str:
    """``"ExceptionType: message"`` if ``fn()`` raises, ``""`` if it returns. Use it only where every rank raises
    alike (a refusal made on every rank), so that no rank is left waiting in a collective."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type and message are what the tests check
        return f"{type(err).__name__}: {err}"
    return ""


@contextmanager
def recorded_warnings() -> Iterator[list[str]]:
    """The messages of every warning raised inside (each once)."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield messages
    messages.extend(dict.fromkeys(str(w.message) for w in caught))


def trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer on ``WORLD_SIZE`` processes: two steps, two batches per evaluation loop, no logger."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": WORLD_SIZE,
        "strategy": strategy,
        "max_steps": 2,
        "limit_val_batches": 2,
        "limit_test_batches": 2,
        "limit_predict_batches": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(kwargs)
    return L.Trainer(**settings)


def fabric(strategy: Any, precision: str = "32-true") -> L.Fabric:
    """A launched CPU Fabric on ``WORLD_SIZE`` processes."""
    f = L.Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision=precision)  # type: ignore[arg-type]
    f.launch()
    return f


class SeqModel(BoringModel):
    """Lightning's test model for FSDP: ``Sequential(Linear(32, 32), ReLU(), Linear(32, 2))``, AdamW, and a test loss
    logged across ranks (so two test runs of the same weights can be compared)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("test_loss", self.step(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class NormModel(SeqModel):
    """``SeqModel`` with a BatchNorm, for ``sync_batchnorm``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))


class CountingBlock(nn.Linear):
    """A linear layer that counts its forward calls in its class (a recomputation in backward counts too)."""

    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        type(self).calls += 1
        return super().forward(x)


class OtherCountingBlock(CountingBlock):
    """A subclass of ``CountingBlock``, counted on its own."""

    calls = 0


class FeedForward(nn.Module):
    """The model of Lightning's ModelParallel tests: a gated MLP of three linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """``actual`` equals ``expected`` exactly: tensors element for element (``torch.equal``) with the same dtype, in
    nested dicts (the same keys, in any order), lists and tuples; anything else by ``==``."""
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        actual, expected = _local(actual), _local(expected)
        assert actual.dtype == expected.dtype and torch.equal(actual.cpu(), expected.cpu()), f"{where} differs"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: keys {sorted(actual)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: {actual!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local part (as a plain tensor); any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def plain_module(module: nn.Module) -> nn.Module:
    """The module Fabric's wrapper holds (``fabric.setup`` returns a wrapper), or ``module`` itself."""
    return module.module if isinstance(module, _FabricModule) else module


def full_weights(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter of a sharded ``module`` in full, by name (collective: call it on every rank)."""
    module = plain_module(module)
    engine = sharded_module_of(module)
    assert engine is not None, "the module is not sharded"
    return full_params(engine)


def unit_names(module: nn.Module) -> list[str]:
    """The names of the sharding units of a sharded ``module`` below its root, in module order."""
    module = plain_module(module)
    engine = sharded_module_of(module)
    assert engine is not None, "the module is not sharded"
    names = {id(m): name for name, m in module.named_modules()}
    return [names[id(unit.module)] for unit in engine.units if unit.module is not module]


def ddp_checkpoint_into_shard_strategy(
    rank: int, world_size: int, tmp: str, min_num_params: int, model_class: type[L.LightningModule] | None = None
) -> dict[str, Any]:
    """Fit under DDP and save its ``.ckpt``; resume it under ShardStrategy with a size policy. Both states in full."""
    model_class = model_class or SeqModel
    L.seed_everything(0)
    model = model_class()
    t = trainer(DDPStrategy())
    t.fit(model)
    path = t.strategy.broadcast(f"{tmp}/ddp.ckpt")
    t.save_checkpoint(path)
    names = {id(p): n for n, p in model.named_parameters()}
    moments = t.optimizers[0].state.items()
    expected = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": {f"0/{names[id(p)]}/{k}": v.clone() for p, state in moments for k, v in state.items()},
    }
    restored = model_class()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    t = trainer(ShardStrategy(auto_wrap_policy=policy))
    t.fit(restored, ckpt_path=path)  # max_steps already reached: loads and stops
    return {"expected": expected, "restored": module_full_state(restored, t.optimizers), "step": t.global_step}
