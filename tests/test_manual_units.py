"""Units named by hand: PyTorch's ``wrap(module)`` inside the strategies' sharded-model context (the Trainer's
``configure_model()``, Fabric's ``init_module()``) and ``lightning_shard.mark_unit(module)`` make ``module`` a unit
without wrapping it. A manually wrapped model trains exactly as the same model under the equivalent
``auto_wrap_policy`` and as DDP; markers that cannot be honoured, and models sharded by PyTorch's FSDP, are
refused with what to do."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.fsdp.wrap import wrap

from lightning_shard import ShardStrategy, mark_unit
from lightning_shard.engine import sharded_module_of
from lightning_shard.engine.planning import plan_units
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.wrapping import is_marked_unit
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.fits import full_params, full_params_shard, trainer_for
from tests.models import GPTBlock, LitModel, MLPBlock, MLPStack, TinyGPT, loader


def _unit_names(model: nn.Module, policy: Any = None) -> list[str]:
    return [name for name, _, _ in plan_units(model, resolve_wrap_policy(policy))]


# Marking #


def test_wrap_marks_the_module_itself_inside_both_front_ends_contexts_and_nothing_outside() -> None:
    contexts = {
        "Trainer model_sharded_context": ShardStrategy().model_sharded_context,
        "Fabric module_sharded_context": FabricShardStrategy().module_sharded_context,
        "Fabric module_init_context": FabricShardStrategy().module_init_context,
    }
    for where, context in contexts.items():
        with context():
            block = MLPBlock(4)
            assert wrap(block) is block, where  # no wrapper: the same object, so names and structure are unchanged
        assert is_marked_unit(block), where
        outside = MLPBlock(4)
        assert wrap(outside) is outside and not is_marked_unit(outside), where  # a no-op, as PyTorch's wrap() is


def test_mark_unit_returns_the_module_and_nested_fabric_init_contexts_still_mark() -> None:
    block = MLPBlock(4)
    assert mark_unit(block) is block and is_marked_unit(block)
    strategy = FabricShardStrategy()
    with strategy.module_init_context(), strategy.module_init_context():  # e.g. a builder calling init_module itself
        inner = wrap(MLPBlock(4))
    assert is_marked_unit(inner)


def test_wrap_with_settings_of_its_own_is_refused() -> None:
    with ShardStrategy().model_sharded_context():
        with pytest.raises(ValueError, match=r"wrap\(Linear, cpu_offload=\.\.\.\) gives one unit settings of its own"):
            wrap(nn.Linear(2, 2), cpu_offload=True)


# Planning #


def test_marked_modules_are_units_in_module_order_alone_and_with_a_policy() -> None:
    model = MLPStack(depth=3)
    mark_unit(model.blocks[2])
    mark_unit(model.blocks[0])
    assert _unit_names(model) == ["", "blocks.0", "blocks.2"]
    assert _unit_names(model, {MLPBlock}) == ["", "blocks.0", "blocks.1", "blocks.2"]  # the union, each once
    assert _unit_names(model, {nn.Linear}) == ["", "inp", "blocks.0", "blocks.0.up", "blocks.0.down", "blocks.1.up",
                                               "blocks.1.down", "blocks.2", "blocks.2.up", "blocks.2.down", "head"]


def test_a_size_policy_counts_the_parameters_of_marked_units_as_taken() -> None:
    model = MLPStack(width=12, depth=3)  # 636 parameters per block
    assert _unit_names(model, 1300) == ["", "blocks"]  # 3 blocks together reach the count
    mark_unit(model.blocks[0])
    mark_unit(model.blocks[1])
    assert _unit_names(model, 1300) == ["", "blocks.0", "blocks.1"]  # the one block left does not


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: mark_unit(MLPStack()), r"\(MLPStack\) is itself marked as a unit .* remove the wrap\(\)/mark_unit"),
        (lambda: _with_marked(_Listed(), "blocks"), r"blocks \(ModuleList\) is marked as a unit .* has no forward\(\)"),
        (lambda: _with_marked(_Attention(), "attn.out_proj"), r"attn\.out_proj is marked .* Mark the parent instead"),
    ],
    ids=["root", "container", "mha-out-proj"],
)
def test_a_marker_that_cannot_be_honoured_is_refused(build: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _unit_names(build())


class _Listed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(4), MLPBlock(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def _with_marked(model: nn.Module, name: str) -> nn.Module:
    mark_unit(model.get_submodule(name))
    return model


# Training: the Trainer #


class ConfiguredGPT(LitModel):
    """``LitModel("gpt")`` whose network is built in ``configure_model()`` (seeded, so that every strategy builds the
    same weights), with each block passed through PyTorch's ``wrap()`` when ``wrap_blocks``."""

    def __init__(self, wrap_blocks: bool) -> None:
        super().__init__("gpt")
        self.model = None
        self.wrap_blocks = wrap_blocks

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(0)
        model = TinyGPT()
        if self.wrap_blocks:
            model.blocks = nn.ModuleList([wrap(block) for block in model.blocks])
        self.model = model


def fit_configured_gpt(rank: int, world_size: int, how: str, steps: int = 4) -> dict[str, Any]:
    """``how``: "wrap" (ShardStrategy, blocks wrapped in configure_model), "policy" (auto_wrap_policy={GPTBlock}), or
    "ddp" (DDPStrategy; the blocks wrapped too, which outside a sharded context changes nothing)."""
    L.seed_everything(0)
    module = ConfiguredGPT(wrap_blocks=how in ("wrap", "ddp"))
    if how == "ddp":
        strategy: Any = DDPStrategy()
    else:
        strategy = ShardStrategy(auto_wrap_policy={GPTBlock} if how == "policy" else None)
    trainer = trainer_for(strategy, world_size, steps)
    trainer.fit(module, train_dataloaders=loader("gpt"))
    assert module.model is not None
    result: dict[str, Any] = {"losses": module.losses, "marked": [is_marked_unit(b) for b in module.model.blocks]}
    if how == "ddp":
        result["params"] = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    else:
        result["params"] = full_params_shard(trainer.strategy)
        result["units"] = [unit.name for unit in trainer.strategy.engine.units]
    return result


def test_blocks_wrapped_in_configure_model_train_as_the_equivalent_policy_and_as_ddp() -> None:
    manual = run_on_ranks(fit_configured_gpt, 2, "wrap")
    policy = run_on_ranks(fit_configured_gpt, 2, "policy")
    ddp = run_on_ranks(fit_configured_gpt, 2, "ddp")
    for rank in range(2):
        assert manual[rank]["units"] == policy[rank]["units"] == ["", "model.blocks.0", "model.blocks.1"]
        assert manual[rank]["marked"] == [True, True] and ddp[rank]["marked"] == [False, False]
        assert manual[rank]["params"].keys() == ddp[rank]["params"].keys()  # no wrapper in any parameter name
        for reference in (policy[rank], ddp[rank]):
            torch.testing.assert_close(torch.tensor(manual[rank]["losses"]), torch.tensor(reference["losses"]))
            for name, value in reference["params"].items():
                torch.testing.assert_close(manual[rank]["params"][name], value, msg=name)


# Training: Fabric and plain PyTorch #


def fabric_marked_units(rank: int, world_size: int, steps: int = 3) -> dict[str, Any]:
    """The same TinyGPT twice on one Fabric without a policy: blocks wrapped under ``init_module()`` (units), and not
    (one unit); the losses of each step."""
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=FabricShardStrategy())
    fabric.launch()
    results: dict[str, Any] = {}
    for how in ("wrap", "plain"):
        torch.manual_seed(0)
        with fabric.init_module():
            model = TinyGPT()
            if how == "wrap":
                model.blocks = nn.ModuleList([wrap(block) for block in model.blocks])
        raw = model
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(rank))
        losses = []
        for _ in range(steps):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        engine = sharded_module_of(raw)
        assert engine is not None
        results[how] = {"units": [u.name for u in engine.units], "losses": losses, "params": full_params(engine)}
    return results


def test_blocks_wrapped_under_fabric_init_module_are_units_and_train_as_the_unwrapped_model() -> None:
    for r in run_on_ranks(fabric_marked_units, 2):
        assert r["wrap"]["units"] == ["", "blocks.0", "blocks.1"] and r["plain"]["units"] == [""]
        torch.testing.assert_close(torch.tensor(r["wrap"]["losses"]), torch.tensor(r["plain"]["losses"]))
        assert r["wrap"]["params"].keys() == r["plain"]["params"].keys()
        for name, value in r["plain"]["params"].items():
            torch.testing.assert_close(r["wrap"]["params"][name], value, msg=name)


def engine_units_and_foreign_wrappers(rank: int, world_size: int) -> dict[str, Any]:
    """``shard_model`` of a model with ``mark_unit`` blocks; then models holding FSDP1 and FSDP2 modules."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_shard.engine import shard_model

    marked = MLPStack()
    mark_unit(marked.blocks[1])
    units = [u.name for u in shard_model(marked, device="cpu").units]
    errors: dict[str, str] = {}
    fsdp1 = MLPStack()
    fsdp1.blocks[0] = _fsdp1_instance(fsdp1.blocks[0])
    fsdp2 = MLPStack()
    fully_shard(fsdp2.blocks[2], mesh=init_device_mesh("cpu", (world_size,)))
    for name, model in (("fsdp1", fsdp1), ("fsdp2", fsdp2)):
        try:
            shard_model(model, device="cpu", auto_wrap_policy={MLPBlock})
        except TypeError as err:
            errors[name] = str(err)
        assert sharded_module_of(model) is None  # refused before anything was sharded
    return {"units": units, "errors": errors}


def _fsdp1_instance(module: nn.Module) -> nn.Module:
    """A ``FullyShardedDataParallel`` holding ``module``, as the check sees one. Built without FSDP's constructor,
    which refuses to run without a GPU."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper._fsdp_wrapped_module = module
    return wrapper


def test_mark_unit_works_in_plain_pytorch_and_models_sharded_by_pytorch_fsdp_are_refused() -> None:
    for r in run_on_ranks(engine_units_and_foreign_wrappers, 2):
        assert r["units"] == ["", "blocks.1"]
        assert "already sharded by PyTorch's FSDP: blocks.0 (FullyShardedDataParallel)" in r["errors"]["fsdp1"]
        assert "already sharded by PyTorch's FSDP: blocks.2 (fully_shard)" in r["errors"]["fsdp2"]
        for message in r["errors"].values():
            assert "pass the plain module" in message and "mark_unit" in message
