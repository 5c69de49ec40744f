"""Precision strings and sharded mixed precision: bf16 parity with DDP, half the all-gather bytes, fp16 loss
scaling agreed by all ranks, kept-fp32 modules, true half precision, YAML dtypes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_shard import MixedPrecision, ShardPrecision, ShardStrategy, collectives
from lightning_shard.testing import run_on_ranks
from tests.fits import cli_with_strategy_args, fit_ddp, fit_shard, trainer_for
from tests.models import GPTBlock, LitModel, loader


def test_bf16_mixed_matches_ddp_within_bf16_tolerance() -> None:
    for kind in ("mlp", "gpt"):
        ours = run_on_ranks(fit_shard, 2, kind, 10, {"precision": "bf16-mixed"})
        ddp = run_on_ranks(fit_ddp, 2, kind, 10, {"precision": "bf16-mixed"})
        for a, b in zip(ours, ddp):
            torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1.6e-2, atol=2e-2)
            assert all(t.dtype == torch.float32 for t in a["params"].values())  # fp32 master weights


def gathered_bytes(rank: int, world_size: int, precision: str) -> int:
    """All-gather bytes of one training step, counted where the engine issues its collectives."""
    total = 0
    original = collectives.all_gather_pieces

    def counting(outputs: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        nonlocal total
        total += sum(o.numel() * o.element_size() for o in outputs)
        return original(outputs, *args, **kwargs)

    L.seed_everything(0)
    module = LitModel("gpt")
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={GPTBlock}), world_size, steps=1, precision=precision)
    collectives.all_gather_pieces = counting
    try:
        trainer.fit(module, train_dataloaders=loader("gpt"))
    finally:
        collectives.all_gather_pieces = original
    assert total > 0
    return total


def test_bf16_mixed_all_gathers_about_half_the_bytes_of_fp32() -> None:
    fp32 = run_on_ranks(gathered_bytes, 2, "32-true")
    bf16 = run_on_ranks(gathered_bytes, 2, "bf16-mixed")
    for a, b in zip(fp32, bf16):
        assert a > 0 and b <= 0.55 * a, (a, b)


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


def test_bf16_true_matches_ddp_within_bf16_tolerance() -> None:
    ours = run_on_ranks(fit_shard, 2, "mlp", 10, {"precision": "bf16-true"})
    ddp = run_on_ranks(fit_ddp, 2, "mlp", 10, {"precision": "bf16-true"})
    for a, b in zip(ours, ddp):
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1.6e-2, atol=2e-2)


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
    from lightning_shard.engine import shard_module
    from lightning_shard.mesh import build_shard_mesh
    from lightning_shard.policies import ShardingStrategy

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
