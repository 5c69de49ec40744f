"""Buffers (BatchNorm running statistics) under ShardStrategy: on every rank, the numbers DDP gives.

Lightning's ``DDPStrategy`` (``broadcast_buffers``, in torch 2.13 ``forward_sync_buffers``, on by default)
overwrites every rank's buffers with rank 0's at the start of a forward that follows a forward with gradients
enabled outside ``no_sync()`` (see [Note: buffers follow DDP] in ``lightning_shard/engine/buffers.py``). The Lightning
tests train the same BatchNorm model on the same per-rank data under both strategies and compare, rank by rank,
every buffer after every training batch and every validation output. The engine tests count the broadcasts
and check gradients against ``DistributedDataParallel`` itself. Checkpoints are checked against the run they
interrupt.

Run with ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_buffers.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import MixedPrecision, ShardStrategy
from lightning_shard.engine import collectives
from lightning_shard.engine.mesh import build_shard_mesh
from lightning_shard.engine.option_choices import ShardingStrategy
from lightning_shard.engine.policies import resolve_wrap_policy
from lightning_shard.engine.sharded_module import ShardedModule, shard_module
from lightning_shard.testing import run_on_ranks

WORLD_SIZE = 2
BATCH = 4  # per rank
STEPS = 6
VAL_BATCHES = 2  # per rank


class NormBlock(nn.Module):
    """Linear -> BatchNorm1d -> ReLU: one sharding unit with float buffers and an int64 ``num_batches_tracked``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.norm = nn.BatchNorm1d(n_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.norm(self.linear(x)))


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(NormBlock(7, 12), NormBlock(12, 12))
        self.head = nn.Linear(12, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))


class NormLit(L.LightningModule):
    """Records on this rank: the loss of every training batch, every buffer after every training batch, and the
    outputs of every validation batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = NormNet()
        self.losses: list[float] = []
        self.buffers_after_batch: list[dict[str, Tensor]] = []
        self.val_outputs: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.buffers_after_batch.append({k: b.detach().clone() for k, b in self.named_buffers()})

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.val_outputs.append(self(batch[0]).detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def record(self) -> dict[str, Any]:
        return {"losses": self.losses, "buffers": self.buffers_after_batch, "val": self.val_outputs}


def _loader(seed: int, batches_per_rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    n = WORLD_SIZE * BATCH * batches_per_rank
    data = TensorDataset(3 * torch.randn(n, 7, generator=g) + 1, torch.randint(0, 5, (n,), generator=g))
    return DataLoader(data, batch_size=BATCH, shuffle=False)  # Lightning gives each rank its own samples


def _strategy(use_ddp: bool, kwargs: dict[str, Any]) -> Any:
    return DDPStrategy(**kwargs) if use_ddp else ShardStrategy(auto_wrap_policy={"NormBlock"}, **kwargs)


def _trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    return L.Trainer(**(options | kwargs))


def fit(
    rank: int, world_size: int, use_ddp: bool, strategy_kwargs: dict[str, Any], trainer_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Six training batches with validation after the third and the sixth (and a one-batch sanity check)."""
    L.seed_everything(0)
    module = NormLit()
    options = dict(max_steps=STEPS, val_check_interval=3, limit_val_batches=VAL_BATCHES, num_sanity_val_steps=1)
    trainer = _trainer(_strategy(use_ddp, strategy_kwargs), **(options | trainer_kwargs))
    with _cpu_sync_batchnorm() if trainer_kwargs.get("sync_batchnorm") else contextlib.nullcontext():
        trainer.fit(module, _loader(1, STEPS), _loader(2, VAL_BATCHES))
    return module.record()


_FITS: dict[tuple, list[dict[str, Any]]] = {}


def _fits(use_ddp: bool, strategy_kwargs: dict[str, Any] | None = None, **trainer_kwargs: Any) -> list[dict[str, Any]]:
    """Every rank's record of ``fit`` (each configuration fitted once per test session)."""
    strategy_kwargs = strategy_kwargs or {}
    key = (use_ddp, tuple(sorted(strategy_kwargs.items())), tuple(sorted(trainer_kwargs.items())))
    if key not in _FITS:
        _FITS[key] = run_on_ranks(fit, WORLD_SIZE, use_ddp, strategy_kwargs, trainer_kwargs)
    return _FITS[key]


def _assert_rank_by_rank(ours: list[dict[str, Any]], references: list[dict[str, Any]], field: str) -> None:
    """``field`` of every rank's record equals the reference's on the same rank."""
    for rank, (mine, reference) in enumerate(zip(ours, references)):
        assert len(mine[field]) == len(reference[field]) > 0, f"rank {rank}, {field}"
        torch.testing.assert_close(mine[field], reference[field], msg=_prefixed(f"rank {rank}, {field}"))


def _prefixed(where: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}"


# --------------------------------------------------------------------------------------------------
# Training and validation against DDPStrategy
# --------------------------------------------------------------------------------------------------


def test_buffers_on_every_rank_after_every_training_batch_equal_ddp() -> None:
    ours, ddp = _fits(False), _fits(True)
    assert not torch.equal(ddp[0]["buffers"][1]["net.blocks.0.norm.running_mean"],
                           ddp[1]["buffers"][1]["net.blocks.0.norm.running_mean"])  # the ranks saw different data
    _assert_rank_by_rank(ours, ddp, "buffers")


def test_validation_outputs_on_every_rank_equal_ddp() -> None:
    _assert_rank_by_rank(_fits(False), _fits(True), "val")


def test_accumulated_micro_batches_broadcast_buffers_when_ddp_does() -> None:
    """DDP's ``no_sync()`` micro-batches leave the next forward without a broadcast; here with ``grad_sync``
    ``"microbatch"`` the gradients are reduced anyway, but the buffers must still follow DDP."""
    kwargs: dict[str, Any] = dict(accumulate_grad_batches=2, max_steps=3, limit_val_batches=0)
    _assert_rank_by_rank(_fits(False, **kwargs), _fits(True, **kwargs), "buffers")


def test_accumulated_micro_batches_with_grad_sync_step_broadcast_buffers_when_ddp_does() -> None:
    kwargs: dict[str, Any] = dict(accumulate_grad_batches=2, max_steps=3, limit_val_batches=0)
    _assert_rank_by_rank(_fits(False, {"grad_sync": "step"}, **kwargs), _fits(True, **kwargs), "buffers")


def test_broadcast_buffers_false_keeps_each_ranks_statistics_as_ddp_without_forward_sync() -> None:
    ours, ddp = _fits(False, {"broadcast_buffers": False}), _fits(True, {"forward_sync_buffers": False})
    _assert_rank_by_rank(ours, ddp, "buffers")
    _assert_rank_by_rank(ours, ddp, "val")


def fit_then_validate(rank: int, world_size: int, use_ddp: bool, strategy_kwargs: dict[str, Any]) -> list[Tensor]:
    """Five training batches (the last two after the validation at the third, so the ranks' statistics differ at
    the end), then a second Trainer validates the same model; returns that validation's outputs."""
    L.seed_everything(0)
    module = NormLit()
    trainer = _trainer(_strategy(use_ddp, strategy_kwargs), max_steps=5, val_check_interval=3,
                       limit_val_batches=VAL_BATCHES, num_sanity_val_steps=0)
    trainer.fit(module, _loader(1, STEPS), _loader(2, VAL_BATCHES))
    module.val_outputs.clear()
    _trainer(_strategy(use_ddp, strategy_kwargs)).validate(module, _loader(2, VAL_BATCHES), verbose=False)
    return module.val_outputs


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "no-broadcast"])
def test_a_second_trainer_validates_on_every_rank_as_ddp(broadcast: bool) -> None:
    """DDP's ``validate`` starts from rank 0's buffers (set-up synchronises them), whether or not it broadcasts in
    forward; so does a second Trainer on the model this strategy sharded before."""
    ours = run_on_ranks(fit_then_validate, WORLD_SIZE, False, {"broadcast_buffers": broadcast})
    ddp = run_on_ranks(fit_then_validate, WORLD_SIZE, True, {"forward_sync_buffers": broadcast})
    _assert_rank_by_rank([{"val": v} for v in ours], [{"val": v} for v in ddp], "val")


@pytest.mark.parametrize("value", [1, "true", None])
def test_broadcast_buffers_must_be_a_bool(value: Any) -> None:
    with pytest.raises(TypeError, match="broadcast_buffers must be True or False"):
        ShardStrategy(broadcast_buffers=value)


# --------------------------------------------------------------------------------------------------
# Trainer(sync_batchnorm=True)
# --------------------------------------------------------------------------------------------------
#
# SyncBatchNorm refuses CPU inputs (and DDP refuses SyncBatchNorm on CPU), and PyTorch has no CPU kernels for the
# five operators it calls. For the duration of a fit the tests give it CPU kernels (the arithmetic of BatchNorm
# over the global batch, checked against nn.BatchNorm1d below) and lift the two device checks, for DDP and
# ShardStrategy alike.


def _channel_dims(t: Tensor) -> list[int]:
    return [0, *range(2, t.dim())]


def _per_channel(v: Tensor, like: Tensor) -> Tensor:
    return v.reshape(1, -1, *([1] * (like.dim() - 2)))


def _stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dims = _channel_dims(x)
    return x.mean(dims), torch.rsqrt(x.var(dims, unbiased=False) + eps)


def _gather_stats(
    x: Tensor, means: Tensor, invstds: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    momentum: float, eps: float, counts: Tensor,
) -> tuple[Tensor, Tensor]:
    counts = counts.to(means.dtype).reshape(-1, 1)
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    var = (counts * (invstds.pow(-2) - eps + (means - mean).pow(2))).sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(momentum * mean)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_(momentum * var * total / (total - 1))
    return mean, torch.rsqrt(var + eps)


def _elemt(x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, invstd: Tensor, eps: float) -> Tensor:
    out = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        out = out * _per_channel(weight, x)
    return out + _per_channel(bias, x) if bias is not None else out


def _backward_reduce(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, input_g: bool, weight_g: bool,
    bias_g: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dims = _channel_dims(x)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(dims)
    return sum_dy, sum_dy_xmu, sum_dy_xmu * invstd, sum_dy.clone()


def _backward_elemt(
    dy: Tensor, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, sum_dy: Tensor, sum_dy_xmu: Tensor,
    count: Tensor,
) -> Tensor:
    total = count.sum().to(x.dtype)
    scale = invstd if weight is None else invstd * weight
    xmu = x - _per_channel(mean, x)
    inner = dy - _per_channel(sum_dy / total, x) - xmu * _per_channel(invstd.pow(2) * sum_dy_xmu / total, x)
    return inner * _per_channel(scale, x)


@contextlib.contextmanager
def _cpu_sync_batchnorm() -> Iterator[None]:
    library = torch.library.Library("aten", "IMPL")
    kernels = {
        "batch_norm_stats": _stats, "batch_norm_gather_stats_with_counts": _gather_stats,
        "batch_norm_elemt": _elemt, "batch_norm_backward_reduce": _backward_reduce,
        "batch_norm_backward_elemt": _backward_elemt,
    }
    for name, kernel in kernels.items():
        library.impl(name, kernel, "CPU")
    # SyncBatchNorm accepts the device type of the private-use backend: let that name be "cpu". DDP's only check of
    # SyncBatchNorm layers refuses them on CPU modules: skip it.
    ddp_check = mock.patch.object(nn.parallel.DistributedDataParallel, "_passing_sync_batchnorm_handle")
    try:
        with mock.patch.object(torch._C, "_get_privateuse1_backend_name", return_value="cpu"), ddp_check:
            yield
    finally:
        library._destroy()


def sync_batchnorm_against_global_batchnorm(rank: int, world_size: int) -> dict[str, Tensor]:
    torch.manual_seed(0)
    reference = nn.BatchNorm1d(3)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-1, 1)
    synced = nn.SyncBatchNorm(3)
    synced.load_state_dict(reference.state_dict())
    xs = [torch.randn(4 + r, 3) * (r + 1) + r for r in range(world_size)]  # unequal batch sizes
    x_all = torch.cat(xs).requires_grad_()
    weights = torch.randn(x_all.shape[0], 3)
    (reference(x_all) * weights).sum().backward()
    x = xs[rank].clone().requires_grad_()
    with _cpu_sync_batchnorm():
        out = synced(x)
        (out * weights[sum(len(t) for t in xs[:rank]):][: len(x)]).sum().backward()
    assert synced.weight.grad is not None and reference.weight.grad is not None
    grad_weight = synced.weight.grad.clone()
    dist.all_reduce(grad_weight)
    offset = sum(len(t) for t in xs[:rank])
    assert x_all.grad is not None and x.grad is not None
    assert synced.running_mean is not None and reference.running_mean is not None
    assert synced.running_var is not None and reference.running_var is not None
    return {
        "running_mean": synced.running_mean - reference.running_mean,
        "running_var": synced.running_var - reference.running_var,
        "grad_input": x.grad - x_all.grad[offset: offset + len(x)],
        "grad_weight": grad_weight - reference.weight.grad,
    }


def test_cpu_sync_batchnorm_kernels_equal_batchnorm_over_the_global_batch() -> None:
    for differences in run_on_ranks(sync_batchnorm_against_global_batchnorm, WORLD_SIZE):
        for name, difference in differences.items():
            torch.testing.assert_close(difference, torch.zeros_like(difference), msg=name)


def test_sync_batchnorm_buffers_losses_and_validation_on_every_rank_equal_ddp() -> None:
    ours, ddp = _fits(False, sync_batchnorm=True), _fits(True, sync_batchnorm=True)
    for field in ("buffers", "losses", "val"):
        _assert_rank_by_rank(ours, ddp, field)


# --------------------------------------------------------------------------------------------------
# The broadcast itself (engine level)
# --------------------------------------------------------------------------------------------------


class SharedBuffer(nn.Module):
    """Two modules holding one buffer tensor (as two attention layers can share one mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        scale = torch.ones(3)
        self.a.register_buffer("scale", scale)
        self.b.register_buffer("scale", scale)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) * self.a.scale) * self.b.scale


def _shard(model: nn.Module, policy: Any, mixed_precision: MixedPrecision | None = None) -> ShardedModule:
    mesh = build_shard_mesh(ShardingStrategy.FULL_SHARD, None)
    return shard_module(model, mesh, ShardingStrategy.FULL_SHARD, resolve_wrap_policy(policy), torch.device("cpu"),
                        mixed_precision)


def count_broadcasts(rank: int, world_size: int) -> dict[str, Any]:
    """The bytes of every broadcast issued in each of six forwards (gradients on or off), and with a model
    without buffers."""
    torch.manual_seed(0)
    model = NormNet()
    _shard(model, {NormBlock})
    calls: list[int] = []
    real = collectives.broadcast_from_rank0

    def counted(t: Tensor, group: Any = None) -> None:
        calls.append(t.numel() * t.element_size())
        real(t, group)

    sequence = ["grad", "grad", "no_grad", "no_grad", "grad", "grad"]
    per_forward = []
    with mock.patch.object(collectives, "broadcast_from_rank0", counted):
        for i, kind in enumerate(sequence):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * rank + i))
            before = len(calls)
            with torch.set_grad_enabled(kind == "grad"):
                out = model(x)
            if kind == "grad":
                out.sum().backward()
            per_forward.append(calls[before:])
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    no_buffers = nn.Sequential(nn.Linear(7, 4), nn.ReLU(), nn.Linear(4, 2))
    _shard(no_buffers, {nn.Linear})
    with mock.patch.object(collectives, "broadcast_from_rank0", counted):
        before = len(calls)
        for _ in range(2):
            no_buffers(torch.randn(3, 7)).sum().backward()
    return {"per_forward": per_forward, "buffer_bytes": buffer_bytes, "without_buffers": calls[before:]}


def test_one_broadcast_of_every_buffer_byte_per_forward_that_ddp_would_sync() -> None:
    for result in run_on_ranks(count_broadcasts, WORLD_SIZE):
        # Two BatchNorm1d(12): running_mean and running_var (12 fp32 each) and num_batches_tracked (int64).
        expected = 2 * (12 * 4 + 12 * 4 + 8)
        assert result["buffer_bytes"] == expected
        # grad, grad, no_grad, no_grad, grad, grad: DDP broadcasts before the first forward and after each forward
        # with gradients enabled.
        assert result["per_forward"] == [[expected], [expected], [expected], [], [], [expected]]
        assert result["without_buffers"] == []


def shared_buffer(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SharedBuffer()
    with torch.no_grad():
        model.a.get_buffer("scale").fill_(1.0 + rank)  # rank 0's value must win
    _shard(model, {nn.Linear}, MixedPrecision(buffer_dtype="bfloat16"))
    a, b = model.a.get_buffer("scale"), model.b.get_buffer("scale")
    tied_after_setup = a is b
    with torch.no_grad():
        a.add_(rank)  # diverge again: the next training forward broadcasts rank 0's
    model(torch.randn(2, 3)).sum().backward()
    model(torch.randn(2, 3)).sum().backward()
    a, b = model.a.get_buffer("scale"), model.b.get_buffer("scale")
    return {"tied_after_setup": tied_after_setup, "tied": a is b, "a": a.clone(), "b": b.clone()}


def test_a_buffer_held_by_two_modules_stays_one_tensor_with_rank_0s_values() -> None:
    for result in run_on_ranks(shared_buffer, WORLD_SIZE):
        assert result["tied_after_setup"] and result["tied"]
        torch.testing.assert_close(result["a"], torch.ones(3, dtype=torch.bfloat16))
        torch.testing.assert_close(result["b"], torch.ones(3, dtype=torch.bfloat16))


def forwards_before_backward(rank: int, world_size: int, train: bool) -> list[Tensor]:
    """Two forwards with gradients, then one backward; with DDP, then sharded. Returns the weight gradients."""
    torch.manual_seed(0)
    reference, model = NormNet(), NormNet()
    model.load_state_dict(reference.state_dict())
    xs = [torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    ddp = nn.parallel.DistributedDataParallel(reference)
    for m in (reference, model):
        m.train(train)
    (ddp(xs[0]).pow(2).mean() + ddp(xs[1]).abs().mean()).backward()
    engine = _shard(model, {NormBlock})
    (model(xs[0]).pow(2).mean() + model(xs[1]).abs().mean()).backward()
    grads = []
    for name, p in reference.named_parameters():
        sp = next(s for s in engine.sharded_params() if s.fqn == name)
        assert p.grad is not None and sp.sharded.grad is not None
        grads.append(engine.gather_full(sp, sp.sharded.grad) - p.grad)
    return grads


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_broadcast_between_forwards_leaves_the_first_forwards_backward_as_ddp(train: bool) -> None:
    """The second forward broadcasts (the first had gradients enabled) while the first one's graph still holds the
    BatchNorm statistics (in eval mode they are saved for backward): backward works and gives DDP's gradients."""
    for differences in run_on_ranks(forwards_before_backward, WORLD_SIZE, train):
        for difference in differences:
            torch.testing.assert_close(difference, torch.zeros_like(difference))


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def checkpointed_fit(
    rank: int, world_size: int, ckpt_dir: str, epochs: int, layout: Literal["sharded", "full"], resume: str | None
) -> dict[str, Any]:
    """Epochs of three training batches, validation after every second epoch, a checkpoint at the end of every
    epoch: the one after the first epoch is written while the ranks' statistics differ."""
    L.seed_everything(0)
    module = NormLit()
    strategy = ShardStrategy(auto_wrap_policy={"NormBlock"}, state_dict_type=layout)
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True)
    trainer = _trainer(
        strategy, max_epochs=epochs, check_val_every_n_epoch=2, limit_val_batches=VAL_BATCHES, num_sanity_val_steps=0,
        enable_checkpointing=True, callbacks=[checkpoints],
    )
    trainer.fit(module, _loader(1, 3), _loader(2, VAL_BATCHES), ckpt_path=resume)
    return module.record() | {"final": {k: b.clone() for k, b in module.named_buffers()}}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted two-epoch run, and the checkpoint after its first epoch in each layout."""
    root = tmp_path_factory.mktemp("buffers")
    runs = {layout: run_on_ranks(checkpointed_fit, WORLD_SIZE, str(root / layout), 2, layout, None)
            for layout in ("sharded", "full")}
    return {"root": root, "runs": runs}


@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_resume_on_every_rank_equals_the_uninterrupted_run(interrupted: dict[str, Any], layout: str) -> None:
    uninterrupted = interrupted["runs"][layout]
    ckpt = interrupted["root"] / layout / "epoch=0.ckpt"
    resumed = run_on_ranks(checkpointed_fit, WORLD_SIZE, str(interrupted["root"] / f"again-{layout}"), 2, layout,
                           str(ckpt))
    expected = [{"losses": r["losses"][3:], "buffers": r["buffers"][3:], "val": r["val"], "final": r["final"]}
                for r in uninterrupted]
    for field in ("losses", "buffers", "final", "val"):
        _assert_rank_by_rank(resumed, expected, field)


def test_checkpoints_hold_rank_0s_buffers(interrupted: dict[str, Any]) -> None:
    """DDP checkpoints hold rank 0's module state; so do both layouts here (read back through safetensors)."""
    from lightning_shard.checkpoint.io.index import iter_index_tensors, read_index
    from lightning_shard.checkpoint.io.reader import read_tensor

    for layout, run in interrupted["runs"].items():
        directory = interrupted["root"] / layout / "epoch=0.ckpt"
        index = read_index(directory)
        stored = {key.removeprefix("model/"): entry for key, entry in iter_index_tensors(index, "model/")}
        rank0 = run[0]["buffers"][2]  # after the last batch of the first epoch
        key = "net.blocks.0.norm.running_mean"
        assert not torch.equal(rank0[key], run[1]["buffers"][2][key])  # rank 1's differ: whose is saved shows
        for name, value in rank0.items():
            entry = stored[name]
            saved = read_tensor(entry).reshape(value.shape)
            torch.testing.assert_close(saved, value, msg=f"{layout}: {name}")
