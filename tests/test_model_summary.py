"""The Trainer's model summary under ShardStrategy counts every parameter in full, as Lightning's summary of the same
model on one device does, and adds what each rank holds ("Params per Device"), which over the ranks adds up to the
full count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import summarize
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from lightning_shard import ShardStrategy
from lightning_shard.testing import run_on_ranks
from lightning_shard.trainer.summary import ShardModelSummary
from tests.fits import trainer_for
from tests.models import block_class, lit_model, loader

DEPTH = 3  # down to the blocks' own layers


class _Recorded:
    """What the summary callback printed (on global rank 0)."""

    printed: dict[str, Any] = {}


def _recording(base: type[ModelSummary]) -> ModelSummary:
    class Recording(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def summarize(summary_data: list, total: int, trainable: int, size: float, *args: Any, **kwargs: Any) -> None:
            _Recorded.printed = {"data": dict(summary_data), "total": total, "trainable": trainable, "size": size}

    return Recording(max_depth=DEPTH)


def summary_under_shard_strategy(rank: int, world_size: int, callback: str) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = summarize(lit_model("gpt"), max_depth=DEPTH)  # the same model, not sharded
    expected = {
        "names": reference.layer_names,
        "params": reference.param_nums,
        "total": reference.total_parameters,
        "trainable": reference.trainable_parameters,
        "size": reference.model_size,
    }
    _Recorded.printed = {}
    base = RichModelSummary if callback == "rich" else ModelSummary
    strategy = ShardStrategy(auto_wrap_policy={block_class("gpt")})
    trainer = trainer_for(strategy, world_size, steps=1, callbacks=[_recording(base)])
    model = lit_model("gpt")
    trainer.fit(model, loader("gpt"))
    summed = torch.tensor(ShardModelSummary(model, strategy.engine, max_depth=DEPTH).params_per_device)
    dist.all_reduce(summed)
    return {"expected": expected, "printed": _Recorded.printed, "per_device_summed": summed.tolist()}


@pytest.mark.parametrize("callback", ["plain", "rich"])
def test_the_trainer_summary_counts_parameters_in_full_and_per_device(callback: str) -> None:
    results = run_on_ranks(summary_under_shard_strategy, 2, callback)
    expected, printed = results[0]["expected"], results[0]["printed"]
    assert printed["total"] == expected["total"] and printed["trainable"] == expected["trainable"]
    assert printed["size"] == expected["size"]
    assert printed["data"]["Name"] == expected["names"]
    full = [int(n) for n in expected["params"]]
    assert results[0]["per_device_summed"] == full  # every rank's rows, added up, are the whole layer
    per_device = printed["data"]["Params per Device"]
    assert len(per_device) == len(full) and per_device != printed["data"]["Params"]
    assert printed["data"]["Params"] == [get_human_readable_count(n) for n in full]
