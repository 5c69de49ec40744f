"""Checkpoints that leave weights out, under Fabric: ``fabric.save(filter=...)`` and ``save_trainable_only``.

A frozen first layer and a trainable second: the checkpoint holds what was kept (and the optimizer state of the
kept parameters only); a load on another world size fills it and, before the next forward, checks that the weights
left out hold their values at the save: restored from where they came from, the run goes on exactly as the
uninterrupted one; left as something else, the forward raises on every rank (strict) or goes on (strict=False).
Filters that cannot be honoured are refused before anything is written. The fingerprints the check compares do not
depend on how rows are spread over ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_shard.checkpoint.io.index import read_index
from lightning_shard.engine.fingerprints import local_fingerprint
from lightning_shard.fabric import ShardStrategy
from lightning_shard.testing import run_on_ranks

STEPS = 4


class Scaled(nn.Module):
    """Multiplies by a buffer: a buffer a save keeps (or a filter leaves out) like the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


def frozen_then_trainable() -> nn.Module:
    torch.manual_seed(0)  # the "pretrained" first layer: the same wherever it is built
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3), Scaled())
    model[0].requires_grad_(False)
    return model


def batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 8, generator=g), torch.randn(12, 3, generator=g)) for _ in range(2 * STEPS)]


def launched(world_size: int, **options: Any) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ShardStrategy(**options))
    fabric.launch()
    return fabric


def train(fabric: L.Fabric, model: nn.Module, optimizer: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batches()[step]
        rows = slice(fabric.global_rank * 12 // fabric.world_size, (fabric.global_rank + 1) * 12 // fabric.world_size)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def save_partial(rank: int, world_size: int, path: str, how: str) -> dict[str, Any]:
    options = {"save_trainable_only": True} if how == "trainable" else {}
    fabric = launched(world_size, **options)
    model = fabric.setup_module(frozen_then_trainable())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    losses = train(fabric, model, optimizer, range(STEPS))
    state = {"model": model, "optimizer": optimizer, "step": STEPS, "meta": {"keep": 1, "drop": 2}}
    flt = {"model": lambda key, value: not key.startswith("0."), "meta": lambda key, value: key == "keep"}
    fabric.save(path, state, filter=flt if how == "filter" else None)
    losses += train(fabric, model, optimizer, range(STEPS, 2 * STEPS))
    return {"losses": losses}


def resume(rank: int, world_size: int, path: str, first_layer: str, strict: bool = True) -> dict[str, Any]:
    fabric = launched(world_size)
    model = frozen_then_trainable()
    if first_layer == "other":
        nn.init.zeros_(model[0].bias)  # not the weights the checkpoint was trained with
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    rest = fabric.load(path, state, strict=strict)
    try:
        losses = train(fabric, model, optimizer, range(state["step"], 2 * STEPS))
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(err).__name__}: {err}"}
    return {"losses": losses, "rest": rest}


@pytest.fixture(scope="module", params=["filter", "trainable"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("partial") / "ckpt"
    runs = run_on_ranks(save_partial, 2, str(path), request.param)
    return {"path": path, "how": request.param, "losses": runs[0]["losses"]}


def test_the_checkpoint_holds_what_was_kept_and_records_what_was_left_out(saved: dict[str, Any]) -> None:
    index = read_index(saved["path"])
    model = sorted(k for k in index["tensors"] if k.startswith("model/"))
    assert model == ["model/2.bias", "model/2.weight", "model/3.factor"]
    assert sorted(index["left_out"]) == ["model/0.bias", "model/0.weight"]
    optimizer = {k.split("/")[2] for k in index["tensors"] if k.startswith("optimizer/")}
    assert optimizer == {"2.weight", "2.bias"}


def test_resumed_on_3_ranks_with_the_weights_restored_it_goes_on_as_the_uninterrupted_run(
    saved: dict[str, Any]
) -> None:
    resumed = run_on_ranks(resume, 3, str(saved["path"]), "restored")
    torch.testing.assert_close(torch.tensor(resumed[0]["losses"]), torch.tensor(saved["losses"][STEPS:]))
    expected_meta = {"keep": 1} if saved["how"] == "filter" else {"keep": 1, "drop": 2}
    assert resumed[0]["rest"] == {"meta": expected_meta}


def test_with_other_weights_in_their_place_the_forward_raises_on_every_rank(saved: dict[str, Any]) -> None:
    for run in run_on_ranks(resume, 2, str(saved["path"]), "other"):
        assert run["error"].startswith("CheckpointError") and "0.bias" in run["error"], run
        assert "0.weight" not in run["error"]  # only the weight that changed is named


def test_strict_false_loads_what_is_there_and_checks_nothing(saved: dict[str, Any]) -> None:
    for run in run_on_ranks(resume, 2, str(saved["path"]), "other", False):
        assert "losses" in run, run


def refused_filters(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    fabric = launched(world_size)
    model = fabric.setup_module(frozen_then_trainable())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    cases = {
        "optimizer": {"optimizer": lambda k, v: True},
        "missing": {"modle": lambda k, v: True},
        "not callable": {"model": "0."},
        "differs by rank": {"model": lambda k, v: rank == 0 or k.startswith("2.")},
    }
    out = {}
    for name, flt in cases.items():
        try:
            fabric.save(f"{tmp}/{name}", {"model": model, "optimizer": optimizer}, filter=flt)
            out[name] = "saved"
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_filters_that_cannot_be_honoured_are_refused_on_every_rank_before_anything_is_written(tmp_path: Path) -> None:
    for out in run_on_ranks(refused_filters, 2, str(tmp_path)):
        assert "optimizer" in out["optimizer"] and out["optimizer"].startswith("ValueError"), out
        assert "modle" in out["missing"], out  # Fabric itself refuses it
        assert out["not callable"].startswith("TypeError"), out
        assert "different model tensors" in out["differs by rank"], out
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_a_fingerprint_is_the_same_however_the_rows_are_split(dtype: torch.dtype) -> None:
    values = torch.randn(37, 5) * 100
    values = values > 0 if dtype is torch.bool else values.to(dtype)
    before = values.clone()
    whole = local_fingerprint(values, 0)
    assert torch.equal(values, before)  # read, never written
    for parts in (2, 3, 8, 37):
        per = -(-37 // parts)
        pieces = [local_fingerprint(values[i : i + per], i) for i in range(0, 37, per)]
        split = torch.stack(pieces).sum(dim=0)
        assert torch.equal(split, whole)
    for moved in (values.roll(1, dims=0), values.roll(1, dims=1)):  # the same values in other rows or columns
        assert not torch.equal(local_fingerprint(moved, 0), whole)
