"""torch.compile per block under ShardStrategy: compiled blocks train like eager ones under both front ends, compile
once (no graph is compiled after the second step), keep the eager parameter names, and compiling the whole
LightningModule is refused with an error that says to compile per block.

[Note: the tolerance of compiled against eager]
Compiled kernels compute the same functions as eager ones, but not in the same order: inductor fuses
operations and reorders floating-point reductions (layer norm, softmax, the matmul epilogues), so results
agree to rounding, not bit for bit, and rounding differences grow over optimizer steps. The bound is the
issue's: losses (and, at the end, parameters) within an absolute 1e-4 of the eager run, in fp32; a sharding
error (a unit computing on stale or unreduced weights, a gradient averaged over the wrong ranks) moves the
losses by far more. Under bf16-mixed, the compared values are rounded to bf16 and compared at bf16's default
tolerances, as the precision tests do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_shard.testing import run_on_ranks
from tests.compile_fits import CompileRun, fabric_compiled_fit, shard_model_of_compiled_model, trainer_compiled_fit

COMPILED_ATOL = 1e-4  # see [Note: the tolerance of compiled against eager]


def _assert_close_to_eager(compiled: list[float], eager: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=0, atol=COMPILED_ATOL)


def _assert_compiles_only_in_the_first_two_steps(graphs: list[int]) -> None:
    """``graphs[i]``: graphs compiled by the end of step ``i``. Some were, and none after the second step."""
    assert graphs[0] > 0, graphs
    assert graphs[1:] == [graphs[1]] * (len(graphs) - 1), graphs


def test_blocks_compiled_in_configure_model_train_like_eager_in_the_trainer() -> None:
    """``block.compile()`` with inductor's generated kernels, fp32, 2 ranks."""
    eager = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="none"))
    compiled = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="blocks", backend="inductor"))
    for e, c in zip(eager, compiled):
        _assert_compiles_only_in_the_first_two_steps(c["graphs"])
        assert c["graph_breaks"] == 0  # each block is whole: the hooks of the modules inside it are not traced
        _assert_close_to_eager(c["losses"], e["losses"])
        assert c["params"].keys() == e["params"].keys()
        for name, value in e["params"].items():
            torch.testing.assert_close(c["params"][name], value, rtol=0, atol=COMPILED_ATOL, msg=name)


def test_blocks_compiled_in_bf16_mixed_train_like_eager() -> None:
    eager = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="none", precision="bf16-mixed"))
    compiled = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="blocks", precision="bf16-mixed"))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(
            torch.tensor(c["losses"], dtype=torch.bfloat16), torch.tensor(e["losses"], dtype=torch.bfloat16)
        )
        _assert_compiles_only_in_the_first_two_steps(c["graphs"])


def test_compiled_blocks_with_activation_checkpointing_train_like_eager() -> None:
    """The compiled forward recomputed in backward, after the unit was gathered again."""
    eager = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="none", checkpointing=True))
    compiled = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="blocks", checkpointing=True))
    for e, c in zip(eager, compiled):
        assert c["blocks"] > 0 and c["checkpointed"] == c["blocks"] and e["checkpointed"] == e["blocks"], (e, c)
        _assert_close_to_eager(c["losses"], e["losses"])
        _assert_compiles_only_in_the_first_two_steps(c["graphs"])


def test_a_compiled_module_holding_the_blocks_trains_like_eager() -> None:
    """The model under the LightningModule compiled as a whole: a graph break at every block's hooks."""
    eager = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="none"))
    compiled = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="stack"))
    for e, c in zip(eager, compiled):
        _assert_close_to_eager(c["losses"], e["losses"])
        _assert_compiles_only_in_the_first_two_steps(c["graphs"])


def test_torch_compiled_blocks_train_in_fabric_and_checkpoint_under_the_eager_names(tmp_path: Path) -> None:
    """``torch.compile(block)`` in place of each block under ``fabric.init_module()``: the same losses as eager, the
    eager parameter names (no ``_orig_mod.``), and a checkpoint that an eager model loads strictly."""
    eager = run_on_ranks(fabric_compiled_fit, 2, CompileRun(compiled="none", steps=6))
    ckpt = str(tmp_path / "compiled")
    compiled = run_on_ranks(fabric_compiled_fit, 2, CompileRun(steps=3), ckpt)
    resumed = run_on_ranks(fabric_compiled_fit, 2, CompileRun(compiled="none", steps=3, first_step=3), None, ckpt)
    for e, c, r in zip(eager, compiled, resumed):
        assert c["names"] == e["names"]
        _assert_close_to_eager(c["losses"], e["losses"][:3])
        _assert_compiles_only_in_the_first_two_steps(c["graphs"])
        _assert_close_to_eager(r["losses"], e["losses"][3:])  # the compiled run's weights and optimizer state


def test_a_whole_model_compiled_in_fabric_trains_like_eager() -> None:
    """``fabric.setup_module(torch.compile(model))``: Fabric compiles its wrapper around the sharded model; a graph
    break at every unit's hooks."""
    eager = run_on_ranks(fabric_compiled_fit, 2, CompileRun(compiled="none"))
    compiled = run_on_ranks(fabric_compiled_fit, 2, CompileRun(compiled="model"))
    for e, c in zip(eager, compiled):  # names: Fabric's own wrapper adds its `_orig_mod.`, as under any strategy
        _assert_close_to_eager(c["losses"], e["losses"])
        _assert_compiles_only_in_the_first_two_steps(c["graphs"])


def test_compiling_the_lightning_module_is_refused_on_every_rank() -> None:
    results = run_on_ranks(trainer_compiled_fit, 2, CompileRun(compiled="root"))
    for r in results:
        assert "compile per block" in r["error"], r
        assert "CompiledGPT" in r["error"], r


def test_shard_model_refuses_a_torch_compiled_model() -> None:
    for message in run_on_ranks(shard_model_of_compiled_model, 2):
        assert "compile per block" in message, message
