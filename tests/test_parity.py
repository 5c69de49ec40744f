"""fp32 parity with DDPStrategy: per-step losses and final parameters at assert_close defaults."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from lightning_shard.testing import run_on_ranks
from tests.fits import fit_ddp, fit_shard
from tests.models import UnevenMLP

CASES = [
    (2, "FULL_SHARD", None),
    (2, "SHARD_GRAD_OP", None),
    (2, "NO_SHARD", None),
    (4, "FULL_SHARD", None),
    (4, "SHARD_GRAD_OP", None),
    (4, "NO_SHARD", None),
    (4, "HYBRID_SHARD", (2, 2)),
]


@functools.cache
def ddp_reference(kind: str, world_size: int) -> list[dict]:
    return run_on_ranks(fit_ddp, world_size, kind)


def _prefixed(prefix: str) -> Callable[[str], str]:
    """An ``assert_close`` message: ``prefix`` followed by what it found."""
    return lambda found: f"{prefix}: {found}"


def assert_same_training(ours: list[dict], reference: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(ours, reference)):
        assert len(a["losses"]) == len(b["losses"]) >= 10
        torch.testing.assert_close(
            torch.tensor(a["losses"]), torch.tensor(b["losses"]), msg=_prefixed(f"losses, rank {rank}")
        )
        assert a["params"].keys() == b["params"].keys()
        for name, expected in b["params"].items():
            torch.testing.assert_close(a["params"][name], expected, msg=_prefixed(f"{name}, rank {rank}"))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize(("world_size", "sharding", "mesh"), CASES)
def test_matches_ddp(kind: str, world_size: int, sharding: str, mesh: tuple[int, int] | None) -> None:
    kwargs = {"sharding_strategy": sharding} | ({"device_mesh": mesh} if mesh else {})
    ours = run_on_ranks(fit_shard, world_size, kind, **kwargs)
    assert_same_training(ours, ddp_reference(kind, world_size))


def test_training_changes_parameters() -> None:
    """Guards the parity test against comparing two runs that never trained."""
    untrained = run_on_ranks(fit_shard, 2, "gpt", steps=0)
    trained = ddp_reference("gpt", 2)
    assert not torch.equal(untrained[0]["params"]["model.wte.weight"], trained[0]["params"]["model.wte.weight"])
    assert trained[0]["losses"][-1] < trained[0]["losses"][0]


def uneven_shapes_at(world_size: int) -> dict[str, torch.Size]:
    """The parameters of the uneven model whose rows ``world_size`` ranks do not divide, with their shapes."""
    return {n: p.shape for n, p in UnevenMLP().named_parameters() if (p.shape[0] if p.dim() else 1) % world_size}


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_three_ranks_with_shapes_they_do_not_divide_match_ddp(sharding: str) -> None:
    uneven = uneven_shapes_at(3)
    assert len(uneven) == len(list(UnevenMLP().parameters()))  # no parameter splits evenly
    assert {"head.weight", "head.bias", "scale"} <= {n for n, s in uneven.items() if (s[0] if s else 1) < 3}
    ours = run_on_ranks(fit_shard, 3, "uneven", sharding_strategy=sharding)
    assert_same_training(ours, ddp_reference("uneven", 3))
