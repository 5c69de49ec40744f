"""What set-up tells the user about a model before it trains: modules whose meta-device parameters nothing initialises
(one warning, naming them), meta-device buffers (filled by their module's ``reset_parameters()``, or refused naming
each one), and activation checkpointing applied twice."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as torch_aac

from lightning_shard.engine.activation_checkpointing import apply_activation_checkpointing
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.testing import run_on_ranks
from tests.models import MLPBlock, MLPStack


class NoReset(nn.Module):
    """A layer that cannot initialise itself (like transformers' ``Conv1D``): no ``reset_parameters()``."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


class Rotary(nn.Module):
    """A rotary embedding's frequencies: a non-persistent buffer and no parameters, filled by ``reset_parameters()``."""

    def __init__(self, dim: int = 4, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=self.inv_freq.device) / self.dim
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / self.base**exponents)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, dim)
        angles = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)[:, None] * self.inv_freq  # (T, dim/2)
        return x * torch.cat([angles.cos(), angles.sin()], dim=-1)


class RotaryWithoutReset(Rotary):
    """The same table computed in ``__init__`` only: built on the meta device, nothing would ever fill it."""

    reset_parameters = None  # type: ignore[assignment]

    def __init__(self, dim: int = 4) -> None:
        nn.Module.__init__(self)
        self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)


def _net(rotary: type[nn.Module] = Rotary) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), rotary(), NoReset(), nn.Sequential(NoReset()))


def _shard(model: nn.Module, **kwargs: Any) -> tuple[Any, list[str]]:
    """``shard_model(model)`` on the CPU; with every warning it gave on this rank."""
    from lightning_shard.engine import shard_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = shard_model(model, device="cpu", **kwargs)
    return engine, [str(w.message) for w in caught]


# Parameters nothing initialises #


def meta_model_warnings(rank: int, world_size: int, param_init: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = _net()
    engine, messages = _shard(model, param_init=param_init, auto_wrap_policy={NoReset})
    return {"warnings": messages, "uninitialized": sorted(engine.uninitialized)}


def test_modules_whose_meta_parameters_nothing_initialises_are_named_once_at_setup() -> None:
    ranks = run_on_ranks(meta_model_warnings, 2, "reset_parameters")
    warned = ranks[0]["warnings"]
    assert len(warned) == 1 and ranks[1]["warnings"] == []  # one warning, from global rank 0
    assert warned[0].startswith(  # Lightning's words first (each class once), for log searches written for them
        "Parameter initialization incomplete. The following modules have parameters or buffers with uninitialized"
        " memory because they don't define a `reset_parameters()` method for re-initialization: NoReset. ")
    assert "nothing initialises them: 2 (NoReset), 3.0 (NoReset)." in warned[0]
    assert "0 (Linear)" not in warned[0]  # nn.Linear initialised itself
    for fix in ("load_safetensors_into()", "fabric.load_raw()", "reset_parameters()", "param_init='empty'"):
        assert fix in warned[0]
    assert ranks[0]["uninitialized"] == ["2.w", "3.0.w"]  # the forward still refuses them until loaded
    empty = run_on_ranks(meta_model_warnings, 2, "empty")  # deliberate: the load is expected to fill everything
    assert [r["warnings"] for r in empty] == [[], []]
    assert empty[0]["uninitialized"] == ["0.bias", "0.weight", "2.w", "3.0.w"]


# Meta-device buffers #


def meta_buffers_filled(rank: int, world_size: int, param_init: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Rotary())
    _shard(model, param_init=param_init)
    out = model(torch.ones(1, 3, 4)) if param_init == "reset_parameters" else None
    finite = out is None or bool(out.isfinite().all())
    return {"inv_freq": model[1].inv_freq, "expected": Rotary().inv_freq, "finite": finite}


@pytest.mark.parametrize("param_init", ["reset_parameters", "empty"])
def test_a_meta_buffer_of_a_module_without_parameters_is_filled_by_its_reset_parameters(param_init: str) -> None:
    for r in run_on_ranks(meta_buffers_filled, 2, param_init):
        assert not r["inv_freq"].is_meta and r["finite"]
        torch.testing.assert_close(r["inv_freq"], r["expected"])
        torch.testing.assert_close(r["inv_freq"][1], torch.tensor(1.0 / math.sqrt(10000.0)))


def meta_buffers_refused(rank: int, world_size: int, case: str) -> dict[str, Any]:
    from lightning_shard.engine import sharded_module_of

    with torch.device("meta"):
        model = _net(RotaryWithoutReset) if case == "no-reset" else nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    try:
        _shard(model, param_init="empty" if case == "batchnorm-empty" else "reset_parameters")
        message = "<not raised>"
    except TypeError as err:
        message = str(err)
    untouched = sharded_module_of(model) is None and all(p.is_meta for p in model.parameters())
    return {"message": message, "untouched": untouched}


def test_a_meta_buffer_nothing_fills_is_refused_at_setup_naming_it_and_the_fix() -> None:
    for r in run_on_ranks(meta_buffers_refused, 2, "no-reset"):
        assert "nothing gives them values: 1.inv_freq (RotaryWithoutReset: no reset_parameters())." in r["message"]
        assert "Build them on a real device" in r["message"] and "reset_parameters()" in r["message"]
        assert r["untouched"]  # refused before any unit was materialised or sharded
    for r in run_on_ranks(meta_buffers_refused, 2, "batchnorm-empty"):
        assert "1.running_mean (BatchNorm1d: param_init='empty' runs no reset_parameters()" in r["message"]
        assert "1.num_batches_tracked" in r["message"] and r["untouched"]


# Activation checkpointing applied twice #


def test_a_model_torch_already_checkpoints_gets_a_warning_when_the_policy_checkpoints_it_too() -> None:
    policy = resolve_wrap_policy({MLPBlock})
    plain = MLPStack()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_activation_checkpointing(plain, policy)  # checkpointed once: nothing to say
    model = MLPStack(depth=2)
    torch_aac(model, check_fn=lambda m: isinstance(m, MLPBlock))
    expected = (r"^FSDP checkpointing is configured, but the model already contains checkpointed layers\. "  # theirs
                r".*already checkpointed by PyTorch's checkpoint_wrapper .* at blocks\.0, blocks\.1, and")
    with pytest.warns(UserWarning, match=expected):
        apply_activation_checkpointing(model, policy)


def test_a_unit_inside_torchs_checkpoint_wrapper_is_refused_and_the_wrapper_itself_may_be_the_unit() -> None:
    from lightning_shard.engine.planning import plan_units

    model = MLPStack(depth=2)
    torch_aac(model, check_fn=lambda m: isinstance(m, MLPBlock))
    with pytest.raises(ValueError, match=r"inside PyTorch's checkpoint_wrapper: blocks\.0\._checkpoint_wrapped_module "
                       r"\(inside blocks\.0\), blocks\.1\._checkpoint_wrapped_module \(inside blocks\.1\)\. .*"
                       r"pass activation_checkpointing_policy"):
        plan_units(model, resolve_wrap_policy({MLPBlock}))
    units = [name for name, _, _ in plan_units(model, resolve_wrap_policy({"CheckpointWrapper"}))]
    assert units == ["", "blocks.0", "blocks.1"]


def checkpoint_wrapper_units_grads(rank: int, world_size: int) -> dict[str, Any]:
    """Two forward/backward passes of an MLPStack whose blocks torch checkpoints, the wrappers being the units and
    the policy checkpointing the blocks again; the full gradients, and an unsharded copy's."""
    import copy

    from lightning_shard.engine import shard_model

    torch.manual_seed(0)
    model = MLPStack(depth=2)
    reference = copy.deepcopy(model)
    torch_aac(model, check_fn=lambda m: isinstance(m, MLPBlock))
    engine = shard_model(model, auto_wrap_policy={"CheckpointWrapper"}, device="cpu")
    with warnings.catch_warnings(record=True):
        apply_activation_checkpointing(model, resolve_wrap_policy({MLPBlock}))
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    for net in (model, reference, model, reference):
        net(x).square().mean().backward()
    grads = {p.fqn.replace("_checkpoint_wrapped_module.", ""): engine.gather_full(p, p.sharded.grad)
             for p in engine.sharded_params()}
    return {"grads": grads, "reference": {n: p.grad for n, p in reference.named_parameters()}}


def test_torchs_checkpoint_wrappers_as_units_train_as_the_unsharded_model() -> None:
    for r in run_on_ranks(checkpoint_wrapper_units_grads, 2):
        assert r["grads"].keys() == r["reference"].keys()
        for name, grad in r["reference"].items():
            torch.testing.assert_close(r["grads"][name], grad, msg=name)
