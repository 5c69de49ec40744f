"""``lightning_shard.fabric.ShardStrategy``: Fabric training matches Fabric's DDPStrategy step for step, checkpoints
save and load at any world size and across front ends, and misuse is refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_shard.testing import run_on_ranks
from tests.fabric_fits import (
    FabricRun,
    fabric_fit,
    fabric_lit_module,
    fabric_load_raw_of_torch_save_files,
    fabric_refusals,
    fabric_surface,
    fabric_with_another_checkpoint_io,
    trainer_twin,
)


def _fp32(values: list[float]) -> torch.Tensor:
    """Losses and norms were computed in fp32: compare them at fp32's default tolerances."""
    return torch.tensor(values, dtype=torch.float32)


def _global(results: list[dict]) -> dict:
    first = {k: results[0][k] for k in ("losses", "norms")}
    for r in results[1:]:
        assert {k: r[k] for k in first} == first  # every rank reports the same global numbers
    return first


@pytest.mark.parametrize(
    ("kind", "world_size", "strategy_kwargs"),
    [
        ("gpt", 2, {}),
        ("gpt", 4, {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}),
        ("hf_gpt2", 2, {}),
        ("hf_gpt2", 4, {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}),
    ],
)
def test_fabric_training_matches_ddp(kind: str, world_size: int, strategy_kwargs: dict) -> None:
    """6 optimizer steps of 2 micro-batches each, through no_backward_sync and clip_gradients(max_norm=1.0)."""
    ddp = _global(run_on_ranks(fabric_fit, world_size, FabricRun(kind=kind, strategy="ddp")))
    shard = _global(run_on_ranks(fabric_fit, world_size, FabricRun(kind=kind, strategy_kwargs=strategy_kwargs)))
    assert len(shard["losses"]) == 6
    torch.testing.assert_close(_fp32(shard["losses"]), _fp32(ddp["losses"]))
    torch.testing.assert_close(_fp32(shard["norms"]), _fp32(ddp["norms"]))


def test_registered_name_trains_like_ddp() -> None:
    """``Fabric(strategy="shard")`` after ``import lightning_shard``: the whole model is one unit."""
    import lightning_shard  # noqa: F401 - registers the names

    ddp = _global(run_on_ranks(fabric_fit, 2, FabricRun(strategy="ddp", steps=3)))
    shard = _global(run_on_ranks(fabric_fit, 2, FabricRun(strategy="name:shard", steps=3)))
    torch.testing.assert_close(_fp32(shard["losses"]), _fp32(ddp["losses"]))


def test_save_on_2_ranks_load_on_3_continues_the_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = _global(run_on_ranks(fabric_fit, 2, FabricRun(steps=6)))
    ckpt = str(tmp_path / "step-3")
    run_on_ranks(fabric_fit, 2, FabricRun(steps=3, save_to=ckpt))
    resumed = _global(run_on_ranks(fabric_fit, 3, FabricRun(first_step=3, steps=3, resume_from=ckpt)))
    torch.testing.assert_close(_fp32(resumed["losses"]), _fp32(uninterrupted["losses"][3:]), rtol=0, atol=1e-5)


def test_trainer_checkpoint_loads_into_fabric_and_fabric_checkpoint_resumes_in_the_trainer(tmp_path: Path) -> None:
    from tests.checkpoint_fits import fit

    trained = run_on_ranks(fit, 2, str(tmp_path / "trainer"), 1)[0]["end"]
    results = run_on_ranks(fabric_lit_module, 3, str(tmp_path / "trainer" / "last.ckpt"), 2, str(tmp_path / "fab"))
    for r in results:  # model and optimizer state equal at load, on every rank
        for section in ("params", "optimizer"):
            assert r["loaded"][section].keys() == trained[section].keys()
            for name, t in trained[section].items():
                torch.testing.assert_close(r["loaded"][section][name], t, msg=name)
        assert {"epoch", "global_step", "loops"} <= set(r["remainder"])  # the Trainer's own state comes back as values
    fabric_end = results[0]["end"]
    resumed = run_on_ranks(fit, 2, str(tmp_path / "again"), 1, str(tmp_path / "fab"))
    for section in ("params", "optimizer"):
        for name, t in fabric_end[section].items():
            torch.testing.assert_close(resumed[0]["start"][section][name], t, msg=name)


def test_meta_init_joint_setup_collectives_other_methods_and_load_raw(tmp_path: Path) -> None:
    results = run_on_ranks(fabric_surface, 2, str(tmp_path))
    for r in results:
        assert r["on_meta"]  # init_module(empty_init=True) builds on the meta device
        assert r["largest_unit_bytes"] < r["model_bytes"] / 2  # never the whole model at once
        assert r["optimizer_holds_shards"]  # fabric.setup(model, optimizer) pointed the optimizer at the shards
        torch.testing.assert_close(r["by_hand"], r["by_forward"])  # blocks called outside forward gather themselves
        assert r["gathered"] == [0.0, 1.0] and r["reduced"] == 1.0 and r["broadcast"] == "from rank 1"
        for name, t in r["trained"].items():  # load_raw of the consolidated file: the trained weights, exactly
            torch.testing.assert_close(r["reloaded"][name], t, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(results[0]["trained"], results[1]["trained"])


def test_misuse_is_refused_on_every_rank_with_what_to_do() -> None:
    expected = {
        "stepped optimizer": "already hold state",
        "foreign optimizer": "Create the optimizer after fabric.setup_module",
        "nonfinite norm": "non-finite",
        "load without state": "pass the state with the set-up model",
        "two modules": "exactly one module",
    }
    for rank, messages in enumerate(run_on_ranks(fabric_refusals, 2)):
        for name, fragment in expected.items():
            assert fragment in messages.get(name, "<not raised>"), (rank, name, messages.get(name))
        assert messages["unchanged"] == "True", rank  # error_if_nonfinite: raised before any change


def test_load_raw_reads_torch_save_state_dicts_restricted_into_set_up_and_plain_modules(tmp_path: Path) -> None:
    """As FSDPStrategy's ``load_raw``, but without running the pickle: tensors and plain containers only; a pickle
    that calls a function is refused, as is the legacy format (which cannot be checked without running it) and an
    optimizer (FSDPStrategy raises NotImplementedError)."""
    for rank, results in enumerate(run_on_ranks(fabric_load_raw_of_torch_save_files, 2, str(tmp_path))):
        for loaded in ("model.pt", "plain model.pt"):
            assert results[loaded] is True, (rank, loaded)
        assert "legacy.pt is in torch.save's legacy format" in results["legacy"]["message"], results["legacy"]
        assert "holds a pickle that calls builtins.print; refused" in results["calls"]["message"], results["calls"]
        assert results["optimizer"]["is"] == ["ValueError", "NotImplementedError", "RuntimeError"]
        assert results["optimizer"]["message"].startswith(
            "Loading a single optimizer object from a checkpoint is not supported yet with the ShardStrategy."
        )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"grad_sync": "sometimes"}, "Unknown grad_sync 'sometimes'. Valid values are: 'microbatch', 'step'"),
        ({"sharding_strategy": "ZERO9"}, "Unknown sharding_strategy 'ZERO9'"),
        ({"cpu_offload": "yes"}, "cpu_offload must be True or False"),
        ({"device_mesh": (2,)}, "device_mesh must be a pair of positive ints"),
        ({"state_dict_type": "pickle"}, "Unknown state_dict_type 'pickle'"),
        ({"auto_wrap_policy": True}, "auto_wrap_policy must be"),
    ],
)
def test_both_front_ends_validate_arguments_alike(kwargs: dict, fragment: str) -> None:
    from lightning_shard import ShardStrategy as TrainerShardStrategy
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    for cls in (TrainerShardStrategy, FabricShardStrategy):
        with pytest.raises((TypeError, ValueError), match=".*") as raised:
            cls(**kwargs)
        assert fragment in str(raised.value), (cls.__module__, str(raised.value))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_fabric_precision_is_the_trainers_sharded_precision(precision: str) -> None:
    """The same engine under the same precision: Fabric's losses equal the Trainer's, bit for bit."""
    fabric = run_on_ranks(fabric_fit, 2, FabricRun(precision=precision, accumulate=1, max_norm=None, steps=4))
    trainer = run_on_ranks(trainer_twin, 2, precision, 4)
    for f, t in zip(fabric, trainer):
        assert f["precision"].startswith("<lightning_shard.fabric.precision.ShardPrecision")
        assert f["local_losses"] == t


def test_a_checkpoint_io_plugin_that_would_be_ignored_is_refused() -> None:
    for message in run_on_ranks(fabric_with_another_checkpoint_io, 2):
        assert message.startswith("The `ShardStrategy` does not support setting a `CheckpointIO` plugin")
        assert "the plugin Elsewhere would not be used" in message
