"""The engine without Lightning: which rows each rank holds, tied and frozen weights, parameters unused on some
ranks (in the root and in other units), several forwards before one backward, meta-device init, the collective
path NCCL takes (on gloo), and the errors every rank raises. Per-strategy collective counts and bytes are in
``test_communication.py``."""

from __future__ import annotations

import math
import unittest.mock
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shard.engine import collectives
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.sharded_module import ShardedModule, shard_module
from lightning_shard.engine.unit import UnitState
from lightning_shard.testing import run_on_ranks


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
        torch.testing.assert_close(engine.gather_full(p, p.sharded), dict(reference.named_parameters())[p.fqn])
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


# Rows each rank holds under FULL_SHARD: ceil(rows / N) per rank in rank order, the last ranks short or empty; a
# 0-dim parameter is one row. Written out rather than computed, for every parameter of ``Wrapper``.
ROWS_PER_RANK = {
    "lin.weight": {1: [5], 2: [3, 2], 3: [2, 2, 1], 4: [2, 2, 1, 0]},  # (5, 5)
    "lin.bias": {1: [5], 2: [3, 2], 3: [2, 2, 1], 4: [2, 2, 1, 0]},  # (5,)
    "odd.few_rows": {1: [3], 2: [2, 1], 3: [1, 1, 1], 4: [1, 1, 1, 0]},  # (3, 5): fewer rows than 4 ranks
    "odd.scalar": {1: [1], 2: [1, 0], 3: [1, 0, 0], 4: [1, 0, 0, 0]},  # 0-dim
    "odd.cube": {1: [6], 2: [3, 3], 3: [2, 2, 2], 4: [2, 2, 2, 0]},  # (6, 2, 3)
    "odd.one": {1: [1], 2: [1, 0], 3: [1, 0, 0], 4: [1, 0, 0, 0]},  # (1,)
    "odd.unused": {1: [4], 2: [2, 2], 3: [2, 2, 0], 4: [1, 1, 1, 1]},  # (4,)
}


def held_rows(rank: int, world_size: int, strategy: str) -> dict[str, tuple[torch.Size, Tensor, Tensor]]:
    """What the model holds after sharding, as the optimizer sees it (``named_parameters()``), with the full
    tensor it came from."""
    torch.manual_seed(0)
    model = Wrapper()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    _shard(model, strategy, {Odd})
    return {n: (p.shape, p.detach().clone(), full[n]) for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_each_rank_holds_its_ceil_rows_slice_of_every_parameter(world_size: int, strategy: str) -> None:
    results = run_on_ranks(held_rows, world_size, strategy)
    for rank, held in enumerate(results):
        assert held.keys() == ROWS_PER_RANK.keys()
        for name, (shape, values, full) in held.items():
            rows = full.reshape(-1, *full.shape[1:])  # a 0-dim parameter is one row
            if strategy == "NO_SHARD":  # every rank holds every row
                first, count = 0, len(rows)
            else:
                counts = ROWS_PER_RANK[name][world_size]
                first, count = sum(counts[:rank]), counts[rank]
            assert shape == (count, *full.shape[1:]), (name, rank, shape)
            torch.testing.assert_close(values, rows[first : first + count], msg=f"{name}, rank {rank}")


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
    """A layer that cannot initialise itself (like transformers' Conv1D): no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 2))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w


def meta_without_reset(rank: int, world_size: int, path: str) -> dict:
    """Shard a meta-device model with a NoReset unit; forward before and after loading its weights from a file."""
    from safetensors.torch import save_file

    from lightning_shard import load_safetensors_into

    weights = {"1.w": torch.arange(6.0).reshape(3, 2)}
    if rank == 0:
        save_file(weights, path)
    dist.barrier()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), NoReset())
    engine = _shard(model, "FULL_SHARD", {NoReset, nn.Linear})  # no longer refused at setup
    x = torch.ones(1, 2)
    try:
        model(x)
        before = ""
    except RuntimeError as err:
        before = str(err)
    load_safetensors_into(model, path, strict=False)
    out = model(x)
    p = next(sp for sp in engine.sharded_params() if sp.fqn == "1.w")
    return {"before": before, "loaded": engine.gather_full(p, p.sharded), "weights": weights["1.w"],
            "finite": bool(out.isfinite().all()), "left": dict(engine.uninitialized)}


def test_a_meta_module_without_reset_parameters_is_refused_at_forward_until_loaded(tmp_path: Path) -> None:
    for message_and_state in run_on_ranks(meta_without_reset, 2, str(tmp_path / "w.safetensors")):
        before = message_and_state["before"]
        assert "1.w (1: NoReset)" in before and "reset_parameters()" in before and "load_safetensors_into" in before
        assert "0.weight" not in before  # nn.Linear initialised itself
        torch.testing.assert_close(message_and_state["loaded"], message_and_state["weights"])
        assert message_and_state["finite"] and message_and_state["left"] == {}


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


class Gate(nn.Module):
    """A unit whose only parameter some ranks skip: there its output is its input, which needs no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor, use: bool) -> Tensor:
        return x + self.shift if use else x


class UnusedInUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.inner = UsedOnRankZeroOnly()  # a unit (not the root) with a parameter only some ranks use
        self.out = nn.Linear(4, 2)  # the root's own parameters

    def forward(self, x: Tensor, use_gate: bool, use_sometimes: bool) -> Tensor:
        return self.out(self.inner(self.gate(x, use_gate), use_sometimes))


def unused_in_units(rank: int, world_size: int, gate_everywhere: bool) -> None:
    torch.manual_seed(0)
    reference, model = UnusedInUnits(), UnusedInUnits()
    model.load_state_dict(reference.state_dict())
    use = rank % 2 == 0  # rank 0 at 2 ranks, ranks 0 and 2 at 3
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))

    def run(m: nn.Module) -> Tensor:
        return m(x, use or gate_everywhere, use).square().mean()

    local = torch.autograd.grad(run(reference), list(reference.parameters()), allow_unused=True)
    local = [g if g is not None else torch.zeros_like(p) for g, p in zip(local, reference.parameters())]
    expected = dict(zip([n for n, _ in reference.named_parameters()], _ddp_average(local, world_size)))
    engine = _shard(model, "FULL_SHARD", {Gate, UsedOnRankZeroOnly})
    owners = {p.fqn: u.name for u in engine.units for p in u.params}
    assert owners["inner.sometimes"] == "inner" and owners["gate.shift"] == "gate"
    for _ in range(2):  # the second step prefetches along the order recorded in the first
        for p in engine.sharded_params():
            p.sharded.grad = None
        run(model).backward()
        for p in engine.sharded_params():
            assert p.sharded.grad is not None, f"{p.fqn} was used on rank 0, so every rank gets its gradient"
            torch.testing.assert_close(engine.gather_full(p, p.sharded.grad), expected[p.fqn], msg=p.fqn)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_parameter_unused_on_some_ranks_inside_a_unit_gets_the_averaged_gradient(world_size: int) -> None:
    run_on_ranks(unused_in_units, world_size, True, timeout=60)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_unit_whose_parameters_some_ranks_skip_gets_the_averaged_gradients(world_size: int) -> None:
    """There the unit's output is its input, which needs no gradient: that rank's backward never reaches the unit
    on its own, yet it must gather and reduce it with the others."""
    run_on_ranks(unused_in_units, world_size, False, timeout=60)


def on_collective_path(rank: int, world_size: int, check: Callable[..., None], *args: object) -> dict[str, int]:
    """Run ``check`` with the path NCCL takes (flat all-gather + copy, rank-major reduce-scatter) instead of gloo's
    point-to-point exchanges; gloo runs those collectives on CPU too. Returns how often forward and backward called
    each collective function: the test's own ``gather_full`` calls, which always use the flat all-gather, are not
    counted."""
    calls = dict.fromkeys(["all_gather_flat", "reduce_scatter_sum", "all_gather_pieces", "reduce_scatter_exchange",
                           "all_reduce_sum"], 0)
    in_gather_full = [False]

    def counting(name: str) -> Callable[..., collectives.Pending | None]:
        original = getattr(collectives, name)

        def wrapper(*a: Any, **k: Any) -> collectives.Pending | None:
            if not in_gather_full[0]:
                calls[name] += 1
            return original(*a, **k)

        return wrapper

    gather_full = ShardedModule.gather_full

    def uncounted_gather_full(self: ShardedModule, p: ShardedParam, local: Tensor) -> Tensor:
        in_gather_full[0] = True
        try:
            return gather_full(self, p, local)
        finally:
            in_gather_full[0] = False

    with (
        unittest.mock.patch.multiple(
            collectives, exchanges_point_to_point=lambda backend, device: False, **{n: counting(n) for n in calls}
        ),
        unittest.mock.patch.object(ShardedModule, "gather_full", uncounted_gather_full),
    ):
        check(rank, world_size, *args)
    return calls


# (check, its arguments, flat all-gathers and reduce-scatters that its forwards and backwards issue)
NCCL_PATH_CHECKS = [
    # units: the root (holding lin) and odd; both gathered in forward and kept for backward (the root until its end,
    # odd as the last unit of forward); both reduced
    (odd_shapes_roundtrip, ("FULL_SHARD",), 2, 2),
    (partly_unused, (), 1, 1),  # one unit, the root
    # two steps of: root, gate and inner gathered in forward, gate again in backward; all three reduced
    (unused_in_units, (False,), 8, 6),
]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_collective_path_nccl_takes_gives_the_same_gradients(world_size: int) -> None:
    for check, args, gathers, reduce_scatters in NCCL_PATH_CHECKS:
        for calls in run_on_ranks(on_collective_path, world_size, check, *args, timeout=120):
            expected = {"all_gather_flat": gathers, "reduce_scatter_sum": reduce_scatters, "all_gather_pieces": 0,
                        "reduce_scatter_exchange": 0, "all_reduce_sum": 0}
            assert calls == expected, (check.__name__, calls)


# --------------------------------------------------------------------------------------------------
# Errors: raised on every rank, each rank's own message naming what to fix
# --------------------------------------------------------------------------------------------------


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
        self.head = nn.Linear(4, 2)


def mixed_dtype_unit(rank: int, world_size: int) -> str:
    try:
        _shard(MixedDtypes(), "FULL_SHARD", {nn.Sequential})
    except ValueError as err:
        return str(err)
    return ""


def test_a_unit_mixing_parameter_dtypes_is_refused_on_every_rank() -> None:
    for message in run_on_ranks(mixed_dtype_unit, 2):
        assert "'block'" in message and "torch.float32" in message and "torch.float64" in message, message


def reshard_under_another_layout(rank: int, world_size: int) -> str:
    model = Chain()
    _shard(model, "FULL_SHARD", {nn.Linear})  # mesh (1, 2)
    try:
        _shard(model, "NO_SHARD", {nn.Linear})  # mesh (2, 1): the shards do not fit
    except ValueError as err:
        return str(err)
    return ""


def test_reusing_a_sharded_model_under_another_mesh_layout_is_refused_on_every_rank() -> None:
    for rank, message in enumerate(run_on_ranks(reshard_under_another_layout, 2)):
        assert f"(1, 2) on rank {rank}" in message and f"(2, 1) on rank {rank}" in message, message


class Stats(nn.Module):
    """Holds a buffer and no parameters: nothing calls a reset_parameters() that would initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_total", torch.zeros(4))


class WithStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stats = Stats()


def meta_buffer_left(rank: int, world_size: int) -> str:
    with torch.device("meta"):
        model = WithStats()
    try:
        _shard(model, "FULL_SHARD")
    except TypeError as err:
        return str(err)
    return ""


def test_a_buffer_left_on_the_meta_device_is_named_on_every_rank() -> None:
    for message in run_on_ranks(meta_buffer_left, 2):
        assert "stats.running_total (Stats: no reset_parameters())" in message and "meta device" in message, message


class AttentionBlock(nn.Module):
    """``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``, and initialises itself with a
    private ``_reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x + self.attn(x, x, x, need_weights=False)[0])


class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([AttentionBlock() for _ in range(2)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def attention_by_size(rank: int, world_size: int) -> list[str]:
    """The size policy on attention blocks: gradients as DDP's; returns the unit names."""
    torch.manual_seed(0)
    reference, model = AttentionNet(), AttentionNet()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(rank))
    expected = _reference_grads(reference, x, world_size)
    engine = _shard(model, "FULL_SHARD", 300)  # below one attention module's 1088 parameters
    model(x).square().mean().backward()
    for p in engine.sharded_params():
        torch.testing.assert_close(engine.gather_full(p, p.sharded.grad), expected[p.fqn], msg=p.fqn)
    return [unit.name for unit in engine.units]


def test_the_size_policy_keeps_multihead_attention_whole_and_trains_it_as_ddp() -> None:
    names = run_on_ranks(attention_by_size, 2)[0]
    assert "blocks.0.attn" in names and not any(name.endswith("out_proj") for name in names), names


def attention_on_meta(rank: int, world_size: int) -> dict[str, Tensor]:
    with torch.device("meta"):
        model = AttentionNet()
    torch.manual_seed(3)
    engine = _shard(model, "FULL_SHARD", {AttentionBlock})
    model(torch.randn(2, 5, 16)).sum().backward()  # refused if anything were left uninitialised
    return {p.fqn: engine.gather_full(p, p.sharded) for p in engine.sharded_params()}


def test_multihead_attention_built_on_the_meta_device_initialises_itself() -> None:
    results = run_on_ranks(attention_on_meta, 2)
    for name, t in results[0].items():
        torch.testing.assert_close(t, results[1][name])
    full = results[0]
    bound = math.sqrt(6 / (16 + 3 * 16))  # xavier-uniform over the (3 * 16, 16) input projection
    in_proj = full["blocks.0.attn.in_proj_weight"]
    assert in_proj.abs().max() <= bound and in_proj.std() > bound / 4
    assert full["blocks.0.attn.in_proj_bias"].eq(0).all() and full["blocks.0.attn.out_proj.bias"].eq(0).all()
    assert full["blocks.0.attn.out_proj.weight"].std() > 0
