"""Wrap policies and sharding-strategy/mesh validation: single-process, no collectives."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.parallel.dims import mesh_shape
from lightning_shard.engine.policies import (
    CallableWrapPolicy,
    ModuleClassWrapPolicy,
    SizeWrapPolicy,
    resolve_wrap_policy,
    select_unit_modules,
)
from tests.models import GPTBlock, TinyGPT


def _names(model: nn.Module, spec: object) -> list[str]:
    return [name for name, _ in select_unit_modules(model, resolve_wrap_policy(spec))]


def test_classes_class_names_and_callables_select_the_same_blocks() -> None:
    model = TinyGPT()
    expected = ["blocks.0", "blocks.1"]
    assert _names(model, {GPTBlock}) == expected
    assert _names(model, ["GPTBlock"]) == expected
    assert _names(model, "GPTBlock") == expected
    assert _names(model, lambda m, name: isinstance(m, GPTBlock)) == expected
    assert isinstance(resolve_wrap_policy(lambda m, n: False), CallableWrapPolicy)
    assert resolve_wrap_policy(None) is None


def test_size_policy_wraps_bottom_up_and_skips_containers() -> None:
    model = TinyGPT()  # a block: fc 1088 + out 1040 + the rest 1104 parameters; the ModuleList is never called
    assert _names(model, 3000) == ["blocks.0", "blocks.1"]
    # fc and out become units; what remains of each block (1104) still reaches 1000, so the block does too
    expected = ["blocks.0", "blocks.0.fc", "blocks.0.out", "blocks.1", "blocks.1.fc", "blocks.1.out"]
    assert _names(model, 1000) == expected
    assert "blocks" not in _names(model, 100)
    with pytest.raises(ValueError, match=">= 1"):
        SizeWrapPolicy(0)


def test_unknown_class_name_lists_the_classes_present() -> None:
    with pytest.raises(ValueError, match=r"GPT2Block.*Module classes present: .*GPTBlock.*TinyGPT"):
        _names(TinyGPT(), {"GPT2Block"})


def test_selecting_a_container_is_refused() -> None:
    with pytest.raises(ValueError, match="ModuleList, which has no forward"):
        _names(TinyGPT(), {nn.ModuleList})


def test_bad_policy_types_are_refused() -> None:
    with pytest.raises(TypeError, match="not a bool"):
        resolve_wrap_policy(True)
    with pytest.raises(TypeError, match="nn.Module classes or class names"):
        resolve_wrap_policy([3.5])
    assert resolve_wrap_policy({"A", GPTBlock}) == ModuleClassWrapPolicy(frozenset({"A", GPTBlock}))


@pytest.mark.parametrize("name", ["FULL_SHARD", "full_shard", ShardingStrategy.FULL_SHARD])
def test_sharding_strategy_parses_names_and_enums(name: object) -> None:
    assert ShardingStrategy.parse(name) is ShardingStrategy.FULL_SHARD


@pytest.mark.parametrize(
    ("strategy", "world", "mesh", "shape"),
    [("FULL_SHARD", 4, None, (1, 4)), ("SHARD_GRAD_OP", 4, None, (1, 4)), ("NO_SHARD", 4, None, (4, 1)),
     ("HYBRID_SHARD", 4, (2, 2), (2, 2)), ("HYBRID_SHARD", 8, (4, 2), (4, 2)), ("FULL_SHARD", 4, (1, 4), (1, 4))],
)
def test_mesh_shapes(strategy: str, world: int, mesh: tuple[int, int] | None, shape: tuple[int, int]) -> None:
    assert mesh_shape(ShardingStrategy.parse(strategy), world, mesh) == shape


@pytest.mark.parametrize(
    ("strategy", "mesh", "message"),
    [("HYBRID_SHARD", (3, 2), "covers 6 ranks but the world size is 4"),
     ("HYBRID_SHARD", None, "needs device_mesh"),
     ("FULL_SHARD", (2, 2), "only HYBRID_SHARD does"),
     ("HYBRID_SHARD", (2, 0), "pair of positive ints")],
)
def test_bad_meshes_explain_themselves(strategy: str, mesh: tuple[int, int] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mesh_shape(ShardingStrategy.parse(strategy), 4, mesh)


def test_the_size_policy_never_splits_multihead_attention() -> None:
    """``nn.MultiheadAttention`` reads its ``out_proj``'s weights without calling it: a unit there would never be
    gathered. Its parameters count as its own, as in PyTorch's size-based wrap policy."""
    model = nn.Sequential(nn.MultiheadAttention(32, 4), nn.Linear(32, 32))
    assert _names(model, 100) == ["0", "1"]  # out_proj alone (1056 parameters) would have qualified
