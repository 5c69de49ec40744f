"""Sharded safetensors checkpoints: exact resume, resharding to any world size, full layout, atomic saves,
consolidation, and bad input failing fast on every rank."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_shard import CheckpointError, consolidate, inspect
from lightning_shard.checkpoint import save_checkpoint
from lightning_shard.checkpoint.format import INDEX_FILE
from lightning_shard.engine import shard_model
from lightning_shard.testing import RankFailure, RankStatus, run_on_ranks
from lightning_shard.testing_checkpoints import reseal_index
from tests.checkpoint_fits import fit, global_losses
from tests.fits import trainer_for
from tests.models import TinyGPT


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 2-rank run of 2 epochs, and a 2-rank run of 1 epoch whose last.ckpt the tests resume from."""
    root = tmp_path_factory.mktemp("ckpt")
    uninterrupted = run_on_ranks(fit, 2, str(root / "full_run"), 2)
    first = run_on_ranks(fit, 2, str(root / "first"), 1)
    return {"root": root, "uninterrupted": uninterrupted, "first": first, "ckpt": root / "first" / "last.ckpt"}


def test_directory_holds_only_safetensors_and_json(saved: dict) -> None:
    files = sorted(p.name for p in saved["ckpt"].iterdir())
    assert files == ["index.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors",
                     "trainer_state.json", "trainer_state.safetensors"]
    index = json.loads((saved["ckpt"] / INDEX_FILE).read_text())
    entry = index["tensors"]["model/model.wte.weight"]
    first = "shard-00000-of-00002.safetensors"  # pieces of 19 and 18 rows would be small: stored whole
    assert entry == {"shape": [37, 16], "dtype": "float32", "file": first, "key": "model/model.wte.weight"}
    assert index["shard_files"] == [first, "shard-00001-of-00002.safetensors"]
    assert load_file(str(saved["ckpt"] / first))["model/model.wte.weight"].shape == (37, 16)
    assert load_file(str(saved["ckpt"] / index["shard_files"][1])) == {}  # every tensor of this model small
    assert index["ties"] == {"model/model.lm_head.weight": "model/model.wte.weight"}


def test_resume_equals_the_uninterrupted_run(tmp_path: Path, saved: dict) -> None:
    resumed = run_on_ranks(fit, 2, str(tmp_path), 2, str(saved["ckpt"]))
    for full, part1, part2 in zip(saved["uninterrupted"], saved["first"], resumed):
        assert len(part1["losses"]) == 8 and len(part2["losses"]) == 8
        # Same world size, same layout: the resumed run is the uninterrupted one, bit for bit.
        assert part1["losses"] + part2["losses"] == full["losses"]


@pytest.mark.parametrize(
    ("world_size", "strategy_kwargs"),
    [(1, {}), (3, {}), (4, {}), (3, {"sharding_strategy": "SHARD_GRAD_OP", "auto_wrap_policy": None}),
     (4, {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2), "auto_wrap_policy": 500})],
)
def test_resharded_resume_matches_the_uninterrupted_run(
    tmp_path: Path, saved: dict, world_size: int, strategy_kwargs: dict
) -> None:
    resumed = run_on_ranks(fit, world_size, str(tmp_path), 2, str(saved["ckpt"]), 12, strategy_kwargs)
    end_of_first = saved["first"][0]["end"]
    for r in resumed:  # model and optimizer state arrive whole, whatever the new layout
        for name, t in end_of_first["params"].items():
            torch.testing.assert_close(r["start"]["params"][name], t, msg=name)
        for name, t in end_of_first["optimizer"].items():
            torch.testing.assert_close(r["start"]["optimizer"][name], t, msg=name)
    expected = global_losses(saved["uninterrupted"])[8:]
    torch.testing.assert_close(global_losses(resumed), expected, rtol=0, atol=1e-5)


def test_full_layout_streams_one_model_file_that_loads_anywhere(tmp_path: Path, saved: dict) -> None:
    run_on_ranks(fit, 2, str(tmp_path / "full"), 1, None, 12, {"state_dict_type": "full"})
    ckpt = tmp_path / "full" / "last.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["index.json", "model.safetensors", "optimizer.safetensors",
                                                      "trainer_state.json", "trainer_state.safetensors"]
    weights = load_file(str(ckpt / "model.safetensors"))
    for name, t in saved["first"][0]["end"]["params"].items():
        if name != "model.lm_head.weight":  # tied: stored once, as model.wte.weight
            torch.testing.assert_close(weights[name], t, msg=name)
    resumed = run_on_ranks(fit, 4, str(tmp_path / "again"), 2, str(ckpt), 12)
    torch.testing.assert_close(global_losses(resumed), global_losses(saved["uninterrupted"])[8:], rtol=0, atol=1e-5)


def test_consolidated_model_equals_ddp_after_the_same_training(tmp_path: Path, saved: dict) -> None:
    out = consolidate(saved["root"] / "full_run" / "last.ckpt", tmp_path / "model.safetensors")
    weights = load_file(str(out))
    reference = run_on_ranks(fit_ddp_same_data, 2)
    for name, t in reference[0].items():
        if name == "model.lm_head.weight":
            continue
        torch.testing.assert_close(weights[name], t, rtol=0, atol=1e-5, msg=name)
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        assert json.loads(f.metadata()["ties"]) == {"model.lm_head.weight": "model.wte.weight"}


def fit_ddp_same_data(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from tests.models import LitModel, make_dataset

    L.seed_everything(0)
    module = LitModel("gpt")
    trainer = trainer_for(DDPStrategy(), world_size, steps=-1, max_epochs=2)
    trainer.fit(module, train_dataloaders=DataLoader(make_dataset("gpt"), batch_size=6, shuffle=False))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_inspect_and_cli(saved: dict, tmp_path: Path) -> None:
    summary = inspect(saved["ckpt"])
    assert summary.world_size == 2 and summary.global_step == 8 and summary.problems == []
    assert "model/model.wte.weight" in summary.tensors
    cli = [sys.executable, "-m", "lightning_shard.cli"]
    shown = subprocess.run([*cli, "inspect", str(saved["ckpt"])], capture_output=True, text=True)
    assert shown.returncode == 0 and "verified: OK" in shown.stdout
    out = tmp_path / "m.safetensors"
    done = subprocess.run([*cli, "consolidate", str(saved["ckpt"]), str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and load_file(str(out))["model.wte.weight"].shape == (37, 16)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _fails_on_every_rank(ckpt: Path, out: Path, pattern: str) -> None:
    """Resuming from ``ckpt`` raises on each of 2 ranks, each rank's own error matching ``pattern``: every rank
    reported (none left waiting in a collective), and no rank's error is read from another rank's report."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fit, 2, str(out), 2, str(ckpt), timeout=120)
    outcomes = failure.value.outcomes
    assert [o.status for o in outcomes.values()] == [RankStatus.RAISED] * 2, str(failure.value)
    for rank, outcome in outcomes.items():
        assert outcome.error.startswith("CheckpointError: "), f"rank {rank}: {outcome.error}"
        assert re.search(pattern, outcome.error), f"rank {rank}: {outcome.error}"


def test_truncated_shard_fails_fast_on_every_rank_naming_the_file(tmp_path: Path, saved: dict) -> None:
    ckpt = _copy(saved["ckpt"], tmp_path / "bad")
    shard = ckpt / "shard-00000-of-00002.safetensors"  # the file holding the tensors
    shard.write_bytes(shard.read_bytes()[:-100])
    _fails_on_every_rank(ckpt, tmp_path / "out", r"shard-00000-of-00002\.safetensors has \d+ bytes .* truncated")


def test_corrupted_bytes_are_caught_by_the_checksum(tmp_path: Path, saved: dict) -> None:
    ckpt = _copy(saved["ckpt"], tmp_path / "bad")
    shard = ckpt / "shard-00000-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF  # same size, one flipped byte in the last tensor
    shard.write_bytes(bytes(data))
    _fails_on_every_rank(ckpt, tmp_path / "out", r"shard-00000-of-00002\.safetensors is corrupted")
    assert inspect(ckpt).problems


def test_missing_file_and_unknown_version_are_named(tmp_path: Path, saved: dict) -> None:
    missing = _copy(saved["ckpt"], tmp_path / "missing")
    (missing / "shard-00000-of-00002.safetensors").unlink()
    _fails_on_every_rank(missing, tmp_path / "o1", r"shard-00000-of-00002\.safetensors is missing")
    future = _copy(saved["ckpt"], tmp_path / "future")
    reseal_index(future, lambda index: index.update(version=99))
    _fails_on_every_rank(future, tmp_path / "o2", "format version 99")


def test_shape_mismatch_names_the_keys(tmp_path: Path, saved: dict) -> None:
    ckpt = _copy(saved["ckpt"], tmp_path / "other")
    reseal_index(ckpt, lambda index: index["tensors"]["model/model.wte.weight"].update(shape=[40, 16]))
    _fails_on_every_rank(ckpt, tmp_path / "o", r"model\.wte\.weight: checkpoint \(40, 16\), model \(37, 16\)")


def test_another_models_checkpoint_is_named_so_without_suggesting_strict_loading(tmp_path: Path, saved: dict) -> None:
    """Keys that differ and keys in common that differ in shape: strict_loading = False would fail too."""
    ckpt = _copy(saved["ckpt"], tmp_path / "other")

    def edit(index: dict) -> None:
        index["tensors"]["model/model.head.weight"] = index["tensors"].pop("model/model.ln_f.weight")
        index["tensors"]["model/model.wte.weight"]["shape"] = [40, 16]

    reseal_index(ckpt, edit)
    pattern = (
        r"missing keys \[model\.ln_f\.weight\], unexpected keys \[model\.head\.weight\]\. Of the keys both have, 1"
        r" differ in shape \(\[model\.wte\.weight: checkpoint \(40, 16\).*it is a checkpoint of another model"
    )
    _fails_on_every_rank(ckpt, tmp_path / "o", pattern)
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(fit, 2, str(tmp_path / "o2"), 2, str(ckpt), timeout=120)
    assert "strict_loading = False to load" not in str(failure.value)


def failing_save(rank: int, world_size: int, ckpt_dir: str) -> str:
    """Save once, then make rank 1 fail while writing its shard of a second save to the same path."""
    from lightning_shard.checkpoint.io import writer as checkpoint_format

    result = fit(rank, world_size, ckpt_dir, 1)
    del result
    import lightning as L

    from lightning_shard import ShardStrategy
    from tests.checkpoint_fits import Snapshots
    from tests.models import loader

    L.seed_everything(1)
    module = Snapshots("gpt")
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={"GPTBlock"}), world_size, steps=2)
    trainer.fit(module, train_dataloaders=loader("gpt"))
    original = checkpoint_format.SafetensorsStreamWriter.__init__

    def broken(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if rank == 1:  # its shard file (which holds no tensor of this small model: see [Note: small tensors ...])
            raise OSError("disk full")
        return original(self, *args, **kwargs)

    checkpoint_format.SafetensorsStreamWriter.__init__ = broken
    try:
        trainer.save_checkpoint(f"{ckpt_dir}/last.ckpt")
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return str(err)
    finally:
        checkpoint_format.SafetensorsStreamWriter.__init__ = original
    return ""


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    messages = run_on_ranks(failing_save, 2, str(tmp_path))
    for message in messages:
        assert "rank 1: OSError: disk full" in message  # raised on every rank, not only the failing one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary directory left behind
    assert inspect(tmp_path / "last.ckpt").problems == []
    assert inspect(tmp_path / "last.ckpt").global_step == 8  # the first save's, untouched


def top_k(rank: int, world_size: int, ckpt_dir: str) -> list[str]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_shard import ShardStrategy
    from tests.models import LitModel, loader

    class Logged(LitModel):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, sync_dist=True)
            return loss

    L.seed_everything(0)
    callback = ModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss", save_top_k=1, every_n_train_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={"GPTBlock"}),
                        max_steps=8, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.fit(Logged("gpt"), train_dataloaders=loader("gpt"))
    return [callback.best_model_path]


def test_model_checkpoint_top_k_removes_old_directories(tmp_path: Path) -> None:
    best = run_on_ranks(top_k, 2, str(tmp_path))[0][0]
    assert [p.name for p in tmp_path.iterdir()] == [Path(best).name]
    assert inspect(best).problems == []


def strict_false(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Resume a model with one more layer than the checkpoint; its full state when training starts (after the
    load), and the extra layer's values before the load."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from tests.checkpoint_fits import Snapshots
    from tests.models import loader

    class Extra(Snapshots):
        def __init__(self) -> None:
            super().__init__("gpt")
            self.extra = torch.nn.Linear(2, 2)  # not in the checkpoint
            self.extra_before = {f"extra.{n}": p.detach().clone() for n, p in self.extra.named_parameters()}
            self.strict_loading = False

    L.seed_everything(0)
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={"GPTBlock"}), world_size, steps=-1, max_epochs=2)
    expected = r"missing keys \['extra.bias', 'extra.weight'\]"  # rank 0 warns
    module = Extra()
    with pytest.warns(UserWarning, match=expected) if rank == 0 else contextlib.nullcontext():
        trainer.fit(module, train_dataloaders=loader("gpt"), ckpt_path=ckpt)
    return {"start": module.start, "extra_before": module.extra_before}


def test_strict_false_loads_what_matches_and_keeps_the_rest(saved: dict) -> None:
    checkpoint = saved["first"][0]["end"]  # the full state the first run saved as last.ckpt
    for rank, r in enumerate(run_on_ranks(strict_false, 2, str(saved["ckpt"]))):
        params = r["start"]["params"]
        assert sorted(params) == sorted([*checkpoint["params"], "extra.bias", "extra.weight"]), f"rank {rank}"
        for name, t in checkpoint["params"].items():
            torch.testing.assert_close(params[name], t, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        for name, t in r["extra_before"].items():  # the layer the checkpoint lacks keeps its values exactly
            assert torch.equal(params[name], t), f"rank {rank} {name}: {params[name]} != {t}"
        optimizer = r["start"]["optimizer"]  # the checkpoint's optimizer state; none yet for the extra layer
        assert sorted(optimizer) == sorted(checkpoint["optimizer"]), f"rank {rank}"
        for name, t in checkpoint["optimizer"].items():
            torch.testing.assert_close(optimizer[name], t, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")


def from_model_file(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    import lightning as L

    from lightning_shard import ShardStrategy, load_safetensors_into
    from tests.checkpoint_fits import full_state
    from tests.models import LitModel, loader

    class FineTune(LitModel):
        def on_fit_start(self) -> None:
            load_safetensors_into(self, path)  # keys already carry the LightningModule's "model." prefix
            self.loaded = full_state(self.trainer.strategy)["params"]

    L.seed_everything(5)
    module = FineTune("gpt")
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={"GPTBlock"}), world_size, steps=1)
    trainer.fit(module, train_dataloaders=loader("gpt"))
    return module.loaded


def test_a_plain_safetensors_model_file_loads_into_the_sharded_model(tmp_path: Path, saved: dict) -> None:
    out = consolidate(saved["ckpt"], tmp_path / "model.safetensors")
    weights = load_file(str(out))
    for loaded in run_on_ranks(from_model_file, 4, str(out)):
        for name, t in weights.items():
            torch.testing.assert_close(loaded[name], t, msg=name)


def fp16_save_and_resume(rank: int, world_size: int, ckpt_dir: str) -> dict:
    import lightning as L

    from lightning_shard import ShardPrecision, ShardStrategy
    from tests.models import LitModel, loader

    class ScaleAtStart(LitModel):
        def on_train_start(self) -> None:  # after the checkpoint was restored, before any new step
            self.scale_at_start = self.trainer.precision_plugin.scaler.get_scale()

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={"GPTBlock"}),
                         max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[ShardPrecision("16-mixed")], default_root_dir=ckpt_dir)

    L.seed_everything(0)
    first = trainer(1)
    first.fit(LitModel("gpt"), train_dataloaders=loader("gpt"))
    first.precision_plugin.scaler.update(new_scale=1234.0)
    first.save_checkpoint(f"{ckpt_dir}/fp16.ckpt")
    second, resumed = trainer(2), ScaleAtStart("gpt")
    second.fit(resumed, train_dataloaders=loader("gpt"), ckpt_path=f"{ckpt_dir}/fp16.ckpt")
    return {"scale_at_resume": resumed.scale_at_start}


def test_loss_scaler_state_is_saved_and_restored(tmp_path: Path) -> None:
    for r in run_on_ranks(fp16_save_and_resume, 2, str(tmp_path)):
        assert r["scale_at_resume"] == 1234.0
    state = json.loads((tmp_path / "fp16.ckpt" / "trainer_state.json").read_text())
    assert state["ShardPrecision"]["scale"] == 1234.0


def refused_saves(rank: int, world_size: int, ckpt_dir: str) -> list[str]:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_shard import ShardStrategy
    from tests.models import LitModel, loader

    class CustomIO(TorchCheckpointIO):
        pass

    messages = []
    trainer = trainer_for(ShardStrategy(), world_size, steps=1)
    trainer.fit(LitModel("mlp"), train_dataloaders=loader("mlp"))
    for call in (lambda: trainer.save_checkpoint(f"{ckpt_dir}/a", storage_options={"x": 1}),
                 lambda: (setattr(trainer.strategy, "checkpoint_io", CustomIO()),
                          trainer.save_checkpoint(f"{ckpt_dir}/b"))):
        try:
            call()
        except TypeError as err:
            messages.append(str(err))
    return messages


def test_storage_options_and_custom_checkpoint_io_are_refused(tmp_path: Path) -> None:
    for messages in run_on_ranks(refused_saves, 2, str(tmp_path)):
        assert len(messages) == 2 and "storage_options" in messages[0] and "CustomIO" in messages[1]
    assert list(tmp_path.iterdir()) == []  # nothing written


def save_after(rank: int, world_size: int, ckpt_dir: str, breakage: str) -> str:
    """Train briefly, then save with ``breakage``: rank 0 failing while it finishes the directory, or an
    optimizer option held as a tensor."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from lightning_shard.checkpoint.save import directory as checkpoint_save
    from tests.models import LitModel, loader

    L.seed_everything(1)
    module = LitModel("gpt")
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={"GPTBlock"}), world_size, steps=1)
    trainer.fit(module, train_dataloaders=loader("gpt"))
    original = checkpoint_save._finish

    def broken_finish(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("rename failed")

    if breakage == "finish":
        checkpoint_save._finish = broken_finish
    else:
        trainer.optimizers[0].param_groups[0]["lr"] = torch.tensor(1e-3)
    try:
        trainer.save_checkpoint(f"{ckpt_dir}/last.ckpt")
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return str(err)
    finally:
        checkpoint_save._finish = original
    return ""


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [("finish", "rank 0: OSError: rename failed"), ("tensor_option", "tensor-valued options (optimizer 0/lr)")],
)
def test_a_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path, breakage: str, expected: str) -> None:
    for message in run_on_ranks(save_after, 2, str(tmp_path), breakage):  # a hang would time out instead
        assert expected in message, message
    assert not any(tmp_path.iterdir())  # nothing left behind


def test_a_successful_save_removes_what_a_killed_save_left_and_nothing_else(tmp_path: Path) -> None:
    stale = [".last.ckpt.tmp-0123456789ab", ".last.ckpt.old-abcdef012345"]  # last.ckpt is saved again: both go
    moved_aside = ".epoch=0.ckpt.old-abcdef012345"  # killed between the renames: the only copy of epoch=0.ckpt
    kept = [".notes.tmp-short", "user-data", ".last.ckpt.tmp-0123456789ab.txt"]
    for name in [*stale, moved_aside, *kept[:2]]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard-00000-of-00002.safetensors").write_bytes(name.encode())
    (tmp_path / kept[2]).write_text("a file, not a save's directory")
    run_on_ranks(fit, 2, str(tmp_path), 1)
    names = {p.name for p in tmp_path.iterdir()}
    assert not names & {*stale, moved_aside}, names
    assert set(kept) | {"last.ckpt", "epoch=0.ckpt"} <= names, names
    restored = tmp_path / "epoch=0.ckpt" / "shard-00000-of-00002.safetensors"
    assert restored.read_bytes() == moved_aside.encode()  # put back under its name, not deleted


def save_over(rank: int, world_size: int, target: str) -> str:
    torch.manual_seed(0)
    model = TinyGPT()
    shard_model(model)
    try:
        save_checkpoint(target, model)
    except CheckpointError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("existing", ["file", "directory"])
def test_a_save_never_replaces_what_is_not_a_checkpoint(tmp_path: Path, existing: str) -> None:
    target = tmp_path / "notes"
    if existing == "file":
        target.write_text("not a checkpoint")
    else:
        target.mkdir()
        (target / "thesis.tex").write_text("not a checkpoint")
    for message in run_on_ranks(save_over, 2, str(target)):  # refused on every rank
        assert "Refusing to save a checkpoint at" in message and "Remove it or choose another path" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # nothing written beside it
    if existing == "file":
        assert target.read_text() == "not a checkpoint"
    else:
        assert (target / "thesis.tex").read_text() == "not a checkpoint"
    assert run_on_ranks(save_over, 2, str(tmp_path / "ckpt")) == ["", ""]
    assert run_on_ranks(save_over, 2, str(tmp_path / "ckpt")) == ["", ""]  # a checkpoint is replaced
    (tmp_path / "made-ready").mkdir()  # an empty directory holds nothing to lose
    assert run_on_ranks(save_over, 2, str(tmp_path / "made-ready")) == ["", ""]
    assert (tmp_path / "made-ready" / INDEX_FILE).is_file()


def test_an_error_raised_on_several_ranks_is_said_once_after_the_ranks() -> None:
    from lightning_shard.checkpoint.io.agreement import ranks_and_errors

    assert ranks_and_errors(["x", "x", None, "y", "x", "x", "x"]) == "ranks 0, 1, 4-6: x; rank 3: y"
    assert ranks_and_errors([None, "disk full"]) == "rank 1: disk full"
