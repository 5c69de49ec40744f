"""Every rank starts from rank 0's initial values, and only values that differ somewhere are broadcast (see [Note:
initial values agree with rank 0]). The checksum that decides it tells apart what differs, however it differs."""

from __future__ import annotations

import unittest.mock
from typing import Any

import pytest
import torch
from torch import nn

from lightning_shard.engine import collectives, shard_model
from lightning_shard.engine.initial_values import checksum
from lightning_shard.testing import run_on_ranks
from tests.models import GPTBlock, TinyGPT


def set_up(rank: int, world_size: int, meta: bool, differ: str | None) -> dict[str, Any]:
    """Shard a TinyGPT built alike on every rank (same seed), except that rank 1 changes the parameter named
    ``differ``; count the broadcasts of set-up and gather the full parameters."""
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = TinyGPT()
    else:
        model = TinyGPT()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    if differ is not None and rank == 1:
        with torch.no_grad():
            dict(model.named_parameters())[differ].add_(1.0)
    broadcast = collectives.broadcast_from_rank0
    sizes: list[int] = []

    def counted(tensor: torch.Tensor, group: Any = None) -> None:
        sizes.append(tensor.numel())
        broadcast(tensor, group)

    with unittest.mock.patch.object(collectives, "broadcast_from_rank0", counted):
        engine = shard_model(model, auto_wrap_policy={GPTBlock}, device="cpu")
    full = {p.fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params()}
    return {"broadcast_numel": sizes, "full": full, "original": original}


@pytest.mark.parametrize("meta", [False, True])
def test_ranks_seeded_alike_broadcast_no_parameter(meta: bool) -> None:
    ranks = run_on_ranks(set_up, 2, meta, None)
    assert ranks[0]["broadcast_numel"] == ranks[1]["broadcast_numel"] == []
    for name, value in ranks[0]["full"].items():
        torch.testing.assert_close(ranks[1]["full"][name], value, msg=name)


def test_only_a_parameter_that_differs_is_broadcast_and_every_rank_gets_rank_0s() -> None:
    ranks = run_on_ranks(set_up, 2, False, "blocks.1.fc.weight")
    differing = ranks[0]["original"]["blocks.1.fc.weight"]
    assert ranks[0]["broadcast_numel"] == ranks[1]["broadcast_numel"] == [differing.numel()]
    for rank in ranks:  # rank 0's value everywhere, rank 1's own change gone
        torch.testing.assert_close(rank["full"]["blocks.1.fc.weight"], differing)


def test_equal_bytes_give_equal_checksums_wherever_they_sit() -> None:
    t = torch.randn(37, 11)
    assert torch.equal(checksum(t), checksum(t.clone()))
    assert torch.equal(checksum(t.t().contiguous().t()), checksum(t))  # non-contiguous: its values in order
    shifted = torch.empty(t.numel() + 1)[1:].view(37, 11)  # 4 bytes into its storage: not 8-byte aligned
    shifted.copy_(t)
    assert torch.equal(checksum(shifted), checksum(t))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: t.flip(0), id="rows in another order"),
        pytest.param(lambda t: t.roll(1, 1), id="values shifted by one within rows"),
        pytest.param(lambda t: torch.where(t == t.flatten()[0], torch.tensor(-0.0), t), id="one value's sign"),
        pytest.param(lambda t: t.nextafter(torch.tensor(float("inf"))), id="every value by one ulp"),
    ],
)
def test_a_checksum_tells_apart_values_that_differ(change: Any) -> None:
    t = torch.randn(256, 64)
    t.view(-1)[0] = 0.0
    assert not torch.equal(checksum(change(t)), checksum(t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.bool])
def test_a_checksum_reads_every_byte_of_any_dtype_and_length(dtype: torch.dtype) -> None:
    t = torch.zeros(13, dtype=dtype)  # 13, 26 or 104 bytes: a tail shorter than one 8-byte word
    other = t.clone()
    other[-1] = 1
    assert not torch.equal(checksum(t), checksum(other))
    assert checksum(torch.zeros(0, dtype=dtype)).tolist() == [0, 0]
    assert checksum(nn.Parameter(torch.tensor(2.0))).shape == (2,)
