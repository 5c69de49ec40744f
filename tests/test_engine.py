"""The engine without Lightning: geometry of shards, tied and frozen weights, unused parameters,
several forwards before one backward, no_grad forwards, meta-device init, collective counts."""

from __future__ import annotations

import math
import unittest.mock
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shard import collectives
from lightning_shard.engine import shard_module
from lightning_shard.mesh import build_shard_mesh
from lightning_shard.policies import ShardingStrategy, resolve_wrap_policy
from lightning_shard.testing import run_on_ranks
from lightning_shard.unit import UnitState


class Odd(nn.Module):
    """Parameters of awkward shapes: fewer rows than ranks, 0-dim, 3-D, one row."""

    def __init__(self) -> None:
        super().__init__()
        self.few_rows = nn.Parameter(torch.randn(3, 5))
        self.scalar = nn.Parameter(torch.tensor(0.7))
        self.cube = nn.Parameter(torch.randn(6, 2, 3))
        self.one = nn.Parameter(torch.randn(1))
        self.unused = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 5)
        h = x @ self.few_rows.t() * self.scalar + self.one  # (B, 3)
        return h.sum(-1, keepdim=True) * self.cube.sum()


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = Odd()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.odd(self.lin(x))


def _shard(model: nn.Module, strategy: str = "FULL_SHARD", policy: object = None):  # noqa: ANN202
    mesh = build_shard_mesh(ShardingStrategy.parse(strategy), None)
    return shard_module(model, mesh, ShardingStrategy.parse(strategy), resolve_wrap_policy(policy), torch.device("cpu"))


def _reference_grads(model: nn.Module, x: Tensor, world_size: int) -> dict[str, Tensor]:
    """DDP's gradients: the mean over ranks of each rank's local gradient."""
    out = model(x).square().mean()
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(out, list(model.parameters()), allow_unused=True)
    return dict(zip(names, _ddp_average([g for g in grads], world_size)))


def _ddp_average(grads: list[Tensor | None], world_size: int) -> list[Tensor | None]:
    averaged = []
    for g in grads:
        if g is not None:
            g = g.clone()  # autograd may hand out expanded (overlapping) gradients
            dist.all_reduce(g)
            g.div_(world_size)
        averaged.append(g)
    return averaged


def odd_shapes_roundtrip(rank: int, world_size: int, strategy: str) -> None:
    torch.manual_seed(0)
    reference = Wrapper()
    model = Wrapper()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    expected_grads = _reference_grads(reference, x, world_size)
    engine = _shard(model, strategy, {Odd})
    for p in engine.sharded_params():
        full = dict(reference.named_parameters())[p.fqn]
        assert p.sharded.shape[1:] == full.shape[1:] if full.dim() > 0 else p.sharded.dim() == 1
        torch.testing.assert_close(engine.gather_full(p, p.sharded), full.detach())
        got_rows = p.sharded.shape[0] if full.dim() > 0 else p.sharded.numel()
        assert got_rows == p.local_rows
    expected_rows = {2: {"odd.few_rows": [2, 1], "odd.one": [1, 0]}, 4: {"odd.few_rows": [1, 1, 1, 0]}}
    for name, rows in expected_rows.get(world_size, {}).items():
        if strategy == "FULL_SHARD":
            assert dict(model.named_parameters())[name].shape[0] == rows[rank], name
    model(x).square().mean().backward()
    for p in engine.sharded_params():
        expected = expected_grads[p.fqn]
        if expected is None:
            assert p.sharded.grad is None, f"{p.fqn} unused on every rank keeps grad None, as with DDP"
            continue
        full_grad = engine.gather_full(p, p.sharded.grad)
        torch.testing.assert_close(full_grad, expected, msg=p.fqn)
    assert all(u.state is UnitState.SHARDED for u in engine.units)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_odd_shapes_shard_gather_and_reduce(world_size: int, strategy: str) -> None:
    run_on_ranks(odd_shapes_roundtrip, world_size, strategy)


class Chain(nn.Module):
    def __init__(self, n: int = 3, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(n)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = F.gelu(layer(h))
        return self.head(h)


def several_forwards_one_backward(rank: int, world_size: int, strategy: str) -> None:
    torch.manual_seed(0)
    reference, model = Chain(), Chain()
    model.load_state_dict(reference.state_dict())
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]

    def loss_of(m: nn.Module) -> Tensor:
        with torch.no_grad():  # an evaluation forward in between must not disturb the training graph
            m(xs[0])
        return m(xs[0]).pow(2).mean() + m(xs[1]).abs().mean()

    ref_grads = _ddp_average(list(torch.autograd.grad(loss_of(reference), list(reference.parameters()))), world_size)
    engine = _shard(model, strategy, {nn.Linear})
    loss_of(model).backward()
    for (name, _), g in zip(reference.named_parameters(), ref_grads):
        p = next(sp for sp in engine.sharded_params() if sp.fqn == name)
        torch.testing.assert_close(engine.gather_full(p, p.sharded.grad), g, msg=name)
    assert all(u.is_sharded for u in engine.units)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_several_forwards_before_one_backward(strategy: str) -> None:
    run_on_ranks(several_forwards_one_backward, 2, strategy)


def count_collectives(rank: int, world_size: int) -> dict:
    """Every collective the engine issues goes through ``lightning_shard.collectives``: count calls and bytes there
    (all-gathers by their output, reductions by their input)."""
    torch.manual_seed(0)
    model = Chain(n=4, width=16)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = _shard(model, "FULL_SHARD", {nn.Linear})
    calls: dict[str, list[int]] = {"all_gather": [], "reduce": []}
    kinds = {"all_gather_flat": "all_gather", "all_gather_pieces": "all_gather", "reduce_scatter_sum": "reduce",
             "reduce_scatter_exchange": "reduce", "all_reduce_sum": "reduce"}

    def nbytes(tensors: object) -> int:
        return sum(t.numel() * t.element_size() for t in (tensors if isinstance(tensors, list) else [tensors]))

    def counting(name: str) -> Callable[..., Any]:
        original = getattr(collectives, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[kinds[name]].append(args[3] if name == "reduce_scatter_exchange" else nbytes(args[0]))
            return original(*args, **kwargs)

        return wrapper

    x = torch.randn(2, 4)
    with unittest.mock.patch.multiple(collectives, **{name: counting(name) for name in kinds}):
        out = model(x).sum()
        forward_gathers = len(calls["all_gather"])
        out.backward()
    return {
        "units": len(engine.units),
        "forward_gathers": forward_gathers,
        "backward_gathers": len(calls["all_gather"]) - forward_gathers,
        "reductions": len(calls["reduce"]),
        "bytes": sum(calls["all_gather"]) + sum(calls["reduce"]),
        "model_bytes": model_bytes,
    }


def test_full_shard_collective_counts_and_bytes() -> None:
    for stats in run_on_ranks(count_collectives, 2):
        units = stats["units"]
        assert units == 7  # embed, 4 layers, head, and the (empty) root
        assert stats["forward_gathers"] == units - 1  # the root holds no parameters: nothing to gather
        assert stats["backward_gathers"] == units - 2  # the last unit of forward is not gathered again
        assert stats["reductions"] == units - 1
        assert stats["bytes"] <= 3 * stats["model_bytes"], stats


class TiedAcrossUnits(nn.Module):
    """The same Linear used by two blocks, and an embedding tied to the head: stored once each."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(6, 6)
        self.emb = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList([nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Tanh())])
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def tied_weights(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference, model = TiedAcrossUnits(), TiedAcrossUnits()
    model.load_state_dict(reference.state_dict())
    idx = torch.randint(0, 10, (3, 5), generator=torch.Generator().manual_seed(rank))
    ref_grads = _ddp_average(list(torch.autograd.grad(reference(idx).logsumexp(-1).mean(),
                                                      list(reference.parameters()))), world_size)
    engine = _shard(model, "FULL_SHARD", {nn.Sequential, nn.Embedding})
    assert len(list(model.parameters())) == len(list(reference.parameters())) == 3  # tied ones stored once
    model(idx).logsumexp(-1).mean().backward()
    for (name, _), g in zip(reference.named_parameters(), ref_grads):
        p = next(sp for sp in engine.sharded_params() if name in sp.fqns)
        torch.testing.assert_close(engine.gather_full(p, p.sharded.grad), g, msg=name)
    owners = {sp.fqn: engine.units.index(u) for u in engine.units for sp in u.params}
    assert owners["emb.weight"] == 0  # shared by emb and head: the root, their lowest common unit
    assert owners["blocks.0.0.weight"] == 0


def test_tied_and_shared_weights_are_stored_once_and_reduced_once() -> None:
    run_on_ranks(tied_weights, 2)


class MetaInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.norm = nn.LayerNorm(16)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def meta_device_init(rank: int, world_size: int) -> dict:
    with torch.device("meta"):
        model = MetaInit()
    torch.manual_seed(5)
    engine = _shard(model, "FULL_SHARD", {nn.Linear})
    peak_unsharded = max(u.flat_unsharded.nbytes for u in engine.units)
    full = {p.fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params()}
    assert all(not p.sharded.is_meta for p in engine.sharded_params())
    return {"full": full, "largest_unit_bytes": peak_unsharded,
            "model_bytes": sum(p.numel * p.dtype.itemsize for p in engine.sharded_params())}


def test_meta_device_init_through_reset_parameters() -> None:
    results = run_on_ranks(meta_device_init, 2)
    for name, t in results[0]["full"].items():
        torch.testing.assert_close(t, results[1]["full"][name])  # every rank initialised the same full tensor
        if name.endswith("weight") and t.dim() == 2:
            bound = 1 / math.sqrt(16)
            assert t.abs().max() <= bound and t.std() > bound / 4, name  # nn.Linear's kaiming-uniform init ran
    assert results[0]["full"]["norm.weight"].eq(1).all()
    assert results[0]["largest_unit_bytes"] < results[0]["model_bytes"] / 2  # never the whole model at once


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


def meta_without_reset(rank: int, world_size: int) -> str:
    with torch.device("meta"):
        model = nn.Sequential(NoReset())
    try:
        _shard(model)
    except TypeError as err:
        return str(err)
    return ""


def test_meta_module_without_reset_parameters_is_named() -> None:
    for message in run_on_ranks(meta_without_reset, 2):
        assert "0 (NoReset)" in message and "reset_parameters()" in message


def partly_meta(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    kept = model[0].weight.detach().clone()
    with torch.device("meta"):
        model[1] = nn.Linear(4, 4)
    engine = _shard(model, "FULL_SHARD")  # one unit holding real and meta-device parameters
    first = engine.root_unit.params[0]
    return {"kept": kept, "gathered": engine.gather_full(first, first.sharded)}


def test_parameters_not_on_meta_keep_their_values_when_the_unit_is_initialised() -> None:
    for r in run_on_ranks(partly_meta, 2):
        torch.testing.assert_close(r["gathered"], r["kept"])


class TiedInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ZeroEmbedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


class ZeroEmbedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def tied_meta_init(rank: int, world_size: int) -> bool:
    with torch.device("meta"):
        model = TiedInit()
    engine = _shard(model)
    p = engine.root_unit.params[0]
    return bool(engine.gather_full(p, p.sharded).eq(0).all())


def test_a_tied_weight_takes_its_first_owners_initialisation() -> None:
    assert run_on_ranks(tied_meta_init, 2) == [True, True]


def unseeded_ranks(rank: int, world_size: int, strategy: str, meta: bool) -> dict:
    torch.manual_seed(100 + rank)  # every rank draws different initial weights
    if meta:
        with torch.device("meta"):
            model = Chain()
    else:
        model = Chain()
    original = {n: p.detach().clone() for n, p in model.named_parameters()} if not meta else {}
    engine = _shard(model, strategy, {nn.Linear})
    return {"full": {p.fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params()}, "original": original}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("meta", [False, True])
def test_every_rank_starts_from_rank_0s_weights(strategy: str, meta: bool) -> None:
    results = run_on_ranks(unseeded_ranks, 2, strategy, meta)
    for name, t in results[0]["full"].items():
        torch.testing.assert_close(results[1]["full"][name], t, msg=name)  # replicas agree, shards fit together
        if not meta:
            torch.testing.assert_close(t, results[0]["original"][name], msg=name)  # rank 0's, as DDP does


def originals_freed_without_cycle_collection(rank: int, world_size: int) -> list[bool]:
    import gc
    import weakref

    torch.manual_seed(0)
    model = Chain(n=4, width=16)
    originals = [weakref.ref(p) for p in model.parameters()]
    gc.disable()  # only reference counting: nothing in sharding may keep the full parameters in a cycle
    try:
        _shard(model, "FULL_SHARD", {nn.Linear})
        return [ref() is None for ref in originals]
    finally:
        gc.enable()


def test_sharding_frees_the_original_full_parameters_at_once() -> None:
    for freed in run_on_ranks(originals_freed_without_cycle_collection, 2):
        assert freed and all(freed)


class UsedOnRankZeroOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.always = nn.Linear(4, 4)
        self.sometimes = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: Tensor, use_sometimes: bool) -> Tensor:
        out = self.always(x)
        return out + (x @ self.sometimes.t()).sum() if use_sometimes else out


def partly_unused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference, model = UsedOnRankZeroOnly(), UsedOnRankZeroOnly()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    local = torch.autograd.grad(reference(x, rank == 0).square().mean(), list(reference.parameters()),
                                allow_unused=True)
    local = [g if g is not None else torch.zeros_like(p) for g, p in zip(local, reference.parameters())]
    expected = dict(zip([n for n, _ in reference.named_parameters()], _ddp_average(local, world_size)))
    engine = _shard(model, "FULL_SHARD", None)
    model(x, rank == 0).square().mean().backward()
    for p in engine.sharded_params():
        assert p.sharded.grad is not None, f"{p.fqn} was used on rank 0, so every rank gets its gradient"
        torch.testing.assert_close(engine.gather_full(p, p.sharded.grad), expected[p.fqn], msg=p.fqn)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_parameter_used_on_one_rank_only_gets_the_averaged_gradient_everywhere(world_size: int) -> None:
    run_on_ranks(partly_unused, world_size)


def on_collective_path(rank: int, world_size: int, check: Callable[..., None], *args: object) -> dict[str, int]:
    """Run ``check`` with the path NCCL takes (flat all-gather + copy, rank-major reduce-scatter) instead of gloo's
    point-to-point exchanges; gloo runs those collectives on CPU too. Returns how often each of them ran."""
    calls = {"all_gather_flat": 0, "reduce_scatter_sum": 0}

    def counting(name: str) -> Callable[..., collectives.Pending]:
        original = getattr(collectives, name)

        def wrapper(*a: Any, **k: Any) -> collectives.Pending:
            calls[name] += 1
            return original(*a, **k)

        return wrapper

    with unittest.mock.patch.multiple(
        collectives,
        exchanges_point_to_point=lambda backend, device: False,
        all_gather_flat=counting("all_gather_flat"),
        reduce_scatter_sum=counting("reduce_scatter_sum"),
    ):
        check(rank, world_size, *args)
    return calls


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_collective_path_nccl_takes_gives_the_same_gradients(world_size: int) -> None:
    for check, args in ((odd_shapes_roundtrip, ("FULL_SHARD",)), (partly_unused, ())):
        for calls in run_on_ranks(on_collective_path, world_size, check, *args):
            assert calls["all_gather_flat"] > 0 and calls["reduce_scatter_sum"] > 0, calls
