"""Precision strings and sharded mixed precision: every sharding strategy in bf16/fp16 mixed precision and bf16-true
against PyTorch's ``fully_shard``, all-gather bytes in closed form from the shapes, fp16 loss scaling agreed by all
ranks, kept-fp32 modules, true half precision, YAML dtypes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard import MixedPrecision, ShardPrecision, ShardStrategy
from lightning_shard.engine import collectives
from lightning_shard.testing import run_on_ranks
from tests.fits import cli_with_strategy_args, trainer_for
from tests.lightning_fits import fit_shard_in_precision, step_gathers, units_of
from tests.models import GPTBlock, LitModel, TinyGPT, loader
from tests.test_fully_shard_oracle import check_same_fit, fit_fully_shard

# [Note: how close sharded mixed precision is to fully_shard]
# Under "bf16-mixed" and "16-mixed" both keep fp32 master shards, all-gather them cast to half precision, compute
# under the same autocast, reduce the half-precision gradients in fp32 and step fp32 shards; the numerics are the
# same operations in the same order. Gradient averaging sums two terms per collective (one rounding, the same
# whichever rank adds) and divides by a power of two (exact), so on 2 ranks and on the 2x2 mesh they agree to
# the bit; the tests compare at assert_close's fp32 defaults. The loss scaler's decisions are compared for equality.
# DDP is no reference here: it keeps fp32 weights and autocast casts them per op, so its gradients are fp32
# before the reduction, where ours (and fully_shard's) are rounded to half precision first.
MIXED_CASES = [
    *[
        ("gpt", sharding, precision)
        for precision in ("bf16-mixed", "16-mixed")
        for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
    ],
    ("mlp", "FULL_SHARD", "bf16-mixed"),  # float inputs, which neither side casts (autocast does, per op)
]


@pytest.mark.parametrize(("kind", "sharding", "precision"), MIXED_CASES)
def test_mixed_precision_matches_fully_shard(kind: str, sharding: str, precision: str) -> None:
    world_size, mesh = (4, (2, 2)) if sharding == "HYBRID_SHARD" else (2, None)
    ours = run_on_ranks(fit_shard_in_precision, world_size, kind, precision, sharding, mesh)
    reference = run_on_ranks(fit_fully_shard, world_size, kind, 10, precision, sharding, mesh)
    for a, b in zip(ours, reference):
        assert a["scales"] == b["scales"]  # the same steps skipped, the same scale at every step
        assert len(a["losses"]) == 10
        check_same_fit(a, b)
        assert all(t.dtype == torch.float32 for t in a["params"].values())  # fp32 master weights
    if precision == "16-mixed":
        # The first step overflows at the default initial scale: a skipped step is among those compared.
        assert len(set(reference[0]["scales"])) > 1, reference[0]["scales"]
        assert all(r["scales"] == ours[0]["scales"] for r in ours)  # every rank agrees


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_bf16_true_matches_fully_shard_bit_for_bit(kind: str) -> None:
    """Both compute in bf16 and reduce bf16 gradients (two terms summed, one rounding, then halved exactly), so
    losses and bf16 parameters are the same bits; bf16's own assert_close default (rtol 1.6e-2) would let a
    different rounding anywhere through."""
    ours = run_on_ranks(fit_shard_in_precision, 2, kind, "bf16-true")
    reference = run_on_ranks(fit_fully_shard, 2, kind, 10, "bf16-true")
    for a, b in zip(ours, reference):
        assert len(a["losses"]) == 10
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for name, value in a["params"].items():
            assert value.dtype == torch.bfloat16
            torch.testing.assert_close(value, b["params"][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def gathered_bytes(rank: int, world_size: int, precision: str, mixed: MixedPrecision | None) -> list[int]:
    """Bytes of each all-gather of one training step of the GPT, counted where the engine issues its collectives."""
    calls: list[int] = []
    pieces, flat = collectives.all_gather_pieces, collectives.all_gather_flat

    def counting_pieces(outputs: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        calls.append(sum(o.nbytes for o in outputs))
        return pieces(outputs, *args, **kwargs)

    def counting_flat(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(output.nbytes)
        return flat(output, *args, **kwargs)

    L.seed_everything(0)
    module = LitModel("gpt")
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, mixed_precision=mixed)
    trainer = trainer_for(strategy, world_size, steps=1, precision=precision)
    with (
        mock.patch.object(collectives, "all_gather_pieces", counting_pieces),
        mock.patch.object(collectives, "all_gather_flat", counting_flat),
    ):
        trainer.fit(module, train_dataloaders=loader("gpt"))
    return calls


def expected_gathers(world_size: int, itemsize: Callable[[nn.Module], int]) -> list[int]:
    """``step_gathers`` of the test GPT, each parameter in ``itemsize(owning module)`` bytes an element."""
    with torch.device("meta"):
        model = TinyGPT()
    owner = {
        f"{m_name}.{p_name}".lstrip("."): m
        for m_name, m in model.named_modules()
        for p_name, _ in m.named_parameters(recurse=False)
    }
    return step_gathers(units_of(model, GPTBlock), world_size, lambda name: itemsize(owner[name]))


def test_bf16_mixed_all_gathers_half_the_bytes_of_fp32_plus_padding() -> None:
    # Each parameter is padded to ceil(rows / 2) rows per rank in both (37 vocabulary rows: 19 and 18 real ones).
    fp32 = expected_gathers(2, lambda m: 4)
    for calls in run_on_ranks(gathered_bytes, 2, "32-true", None):
        assert calls == fp32
    for calls in run_on_ranks(gathered_bytes, 2, "bf16-mixed", None):
        assert calls == [b // 2 for b in fp32]


def test_keep_fp32_modules_are_all_gathered_in_fp32_bytes() -> None:
    mixed = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32", keep_fp32=("LayerNorm",))
    expected = expected_gathers(2, lambda m: 4 if isinstance(m, nn.LayerNorm) else 2)
    for calls in run_on_ranks(gathered_bytes, 2, "32-true", mixed):
        assert calls == expected


class InfOnOneRank(LitModel):
    """fp16 loss scaling; at step 3 rank 1 plants an inf in one of its gradient shards."""

    def __init__(self) -> None:
        super().__init__("mlp")
        self.params_before: list[dict[str, torch.Tensor]] = []
        self.scales: list[float] = []

    def on_after_backward(self) -> None:  # before the scaler's inf check
        if self.global_step == 3 and self.global_rank == 1:
            grad = next(p.grad for p in self.parameters() if p.grad is not None and p.grad.numel() > 0)
            grad.view(-1)[0] = float("inf")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.params_before.append({n: p.detach().clone() for n, p in self.named_parameters()})
        self.scales.append(self.trainer.precision_plugin.scaler.get_scale())


def fp16_inf_skip(rank: int, world_size: int) -> dict[str, Any]:
    L.seed_everything(0)
    module = InfOnOneRank()
    strategy = ShardStrategy(auto_wrap_policy={"MLPBlock"})
    trainer = trainer_for(strategy, world_size, steps=6, plugins=[ShardPrecision("16-mixed")])
    trainer.fit(module, train_dataloaders=loader("mlp"))
    steps = [module.params_before[i] for i in range(len(module.params_before))]
    unchanged = [all(torch.equal(steps[i][n], steps[i + 1][n]) for n in steps[i]) for i in range(len(steps) - 1)]
    return {"unchanged": unchanged, "scales": module.scales, "losses": module.losses,
            "scaler_state": trainer.precision_plugin.state_dict()}


def test_fp16_inf_on_one_rank_makes_every_rank_skip_that_step() -> None:
    results = run_on_ranks(fp16_inf_skip, 2)
    for r in results:
        # The optimizer step after batch 3 is skipped on both ranks (no parameter changed), and only that one.
        assert r["unchanged"][3] is True, r["unchanged"]
        assert not any(r["unchanged"][i] for i in (0, 1, 2, 4))
        assert r["scales"][4] == r["scales"][3] / 2  # the scale backs off once, identically
        assert len(r["losses"]) == 6  # and training went on
        assert "scale" in r["scaler_state"]  # the scaler's state goes into checkpoints
    assert results[0]["scales"] == results[1]["scales"]


def dtypes_of_faces(rank: int, world_size: int, precision: str, mixed: MixedPrecision | None) -> dict[str, Any]:
    L.seed_everything(0)
    module = LitModel("gpt")
    strategy = ShardStrategy(auto_wrap_policy={GPTBlock}, mixed_precision=mixed)
    trainer_for(strategy, world_size, steps=2, precision=precision).fit(module, train_dataloaders=loader("gpt"))
    params = {p.fqn: p for p in strategy.engine.sharded_params()}
    return {
        "shard": {n: p.sharded.dtype for n, p in params.items()},
        "compute": {n: p.unsharded.dtype for n, p in params.items()},
        "grad": {n: p.sharded.grad.dtype for n, p in params.items() if p.sharded.grad is not None},
        "losses": module.losses,
    }


def test_keep_fp32_modules_are_gathered_in_their_own_dtype() -> None:
    mixed = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32", keep_fp32=("LayerNorm",))
    for r in run_on_ranks(dtypes_of_faces, 2, "32-true", mixed):
        assert r["compute"]["model.blocks.0.ln1.weight"] == torch.float32
        assert r["compute"]["model.ln_f.bias"] == torch.float32
        assert r["compute"]["model.blocks.0.fc.weight"] == torch.bfloat16
        assert set(r["shard"].values()) == {torch.float32} == set(r["grad"].values())


def test_true_half_precision_keeps_shards_in_half() -> None:
    for precision, dtype in (("bf16-true", torch.bfloat16), ("16-true", torch.float16)):
        for r in run_on_ranks(dtypes_of_faces, 2, precision, None):
            assert set(r["shard"].values()) == {dtype} == set(r["compute"].values())
            assert torch.isfinite(torch.tensor(r["losses"][0]))  # (pure fp16 Adam may overflow later, as with DDP)


def test_mixed_precision_from_yaml_with_dtype_names(tmp_path: Path) -> None:
    by_name = {"param_dtype": "bfloat16", "reduce_dtype": "float32", "keep_fp32": ["LayerNorm"]}
    cli = cli_with_strategy_args(tmp_path, {"auto_wrap_policy": ["GPTBlock"], "mixed_precision": by_name})
    mixed = cli.trainer.strategy.mixed_precision
    assert mixed == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_fp32=("LayerNorm",))


def test_unknown_precision_names_the_supported_ones() -> None:
    try:
        ShardPrecision("64-true")  # type: ignore[arg-type]
    except ValueError as err:
        assert "bf16-mixed" in str(err) and "16-true" in str(err)
    else:
        raise AssertionError("64-true was accepted")


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset


def mixed_options(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_shard.engine.mesh import build_shard_mesh
    from lightning_shard.engine.option_choices import ShardingStrategy
    from lightning_shard.engine.sharded_module import shard_module

    torch.manual_seed(0)
    model = WithBuffer()
    mixed = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32", buffer_dtype="bfloat16",
                           output_dtype="float32", cast_forward_inputs=True)
    strategy = ShardingStrategy.FULL_SHARD
    engine = shard_module(model, build_shard_mesh(strategy, None), strategy, None, torch.device("cpu"), mixed)
    out = model(torch.randn(2, 4))  # fp32 input, no autocast: cast to bf16 on the way in
    out.sum().backward()
    weight = engine.root_unit.params[0]
    return {"out": out.dtype, "buffer": model.offset.dtype, "compute": weight.unsharded.dtype,
            "master": weight.sharded.dtype, "grad": weight.sharded.grad.dtype}


def test_buffer_output_and_input_dtypes() -> None:
    for r in run_on_ranks(mixed_options, 2):
        assert r == {"out": torch.float32, "buffer": torch.bfloat16, "compute": torch.bfloat16,
                     "master": torch.float32, "grad": torch.float32}


# Lightning's demo Transformer, as Lightning's FSDP guide trains it #


class DemoTransformer(L.LightningModule):
    """``lightning.pytorch.demos.Transformer`` (``nn.Transformer`` inside, its positional encoding added in fp32)
    built in ``configure_model``, as Lightning's FSDP guide has it, on random tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from lightning.pytorch.demos import Transformer

        if self.model is None:
            self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        assert self.model is not None
        output = self.model(inputs, target)
        loss = torch.nn.functional.nll_loss(output, target.view(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_demo_transformer(rank: int, world_size: int, precision: str, sharded: bool) -> list[float]:
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0)
    tokens = torch.randint(0, 64, (48, 9), generator=torch.Generator().manual_seed(3))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    layers = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    strategy = ShardStrategy(auto_wrap_policy=layers) if sharded else DDPStrategy()
    module = DemoTransformer()
    trainer_for(strategy, world_size, steps=6, precision=precision).fit(module, data)
    return module.losses


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightnings_demo_transformer_trains_as_under_ddp(precision: str) -> None:
    """bf16-mixed used to fail in the layer norms on CPU (an fp32 residual with bf16 weights): see [Note:
    normalization inputs on CPU]."""
    ours = run_on_ranks(fit_demo_transformer, 2, precision, True)
    ddp = run_on_ranks(fit_demo_transformer, 2, precision, False)
    for rank, (a, b) in enumerate(zip(ours, ddp)):
        if precision == "32-true":
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), msg=f"rank {rank}")
        else:
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1.6e-2, atol=0, msg=f"rank {rank}")
