"""Hugging Face weights in, shard-wise: a ``transformers`` GPT-2 written by ``save_pretrained`` (several files and
an index, or one file) loads with ``load_safetensors_into`` into a model built on the meta device and sharded on 2
ranks, and its logits equal the Hugging Face model's own. GPT-2 stores its tied LM head once (as
``transformer.wte.weight``); strict loading must not call ``lm_head.weight`` missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor, nn

from lightning_shard.testing import run_on_ranks

TOKENS = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(7))


def gpt2_config() -> Any:
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)


class Holder(nn.Module):
    """What a LightningModule looks like to the loader: the network under ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.GPT2LMHeadModel(gpt2_config())


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One GPT-2 saved twice: in several files with an index, and as one ``model.safetensors``; its logits."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config()).eval()
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    model.save_pretrained(root / "single")
    with torch.no_grad():
        logits = model(TOKENS).logits
    return {"root": root, "logits": logits}


def load_and_run(
    rank: int, world_size: int, path: str, prefix: str, param_init: str = "reset_parameters"
) -> dict[str, Any]:
    """Build GPT-2 on the meta device, shard it, load ``path`` into it; the logits and the load's report."""
    from lightning_shard import load_safetensors_into
    from lightning_shard.engine import shard_model

    with torch.device("meta"):
        net: nn.Module = Holder() if prefix else transformers.GPT2LMHeadModel(gpt2_config())
    # transformers' Conv1D has no reset_parameters(): its shards stay uninitialised until the load fills them, and a
    # forward before that is refused (see [Note: parameters nothing initialises]).
    engine = shard_model(net, auto_wrap_policy={"GPT2Block"}, device="cpu", param_init=param_init)
    try:
        (net.model if prefix else net)(TOKENS)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    result = load_safetensors_into(net, path, prefix=prefix, strict=True)
    gpt = net.model if prefix else net
    gpt.eval()
    with torch.no_grad():
        logits: Tensor = gpt(TOKENS).logits
    sharded = all(p.sharded.numel() < p.global_shape.numel() for p in engine.sharded_params())
    return {"logits": logits, "missing": result.missing_keys, "unexpected": result.unexpected_keys,
            "sharded": sharded, "refused": refused}


def test_save_pretrained_writes_several_files_and_an_index(pretrained: dict[str, Any]) -> None:
    index = json.loads((pretrained["root"] / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # the bar below is met with a real multi-file layout
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once


@pytest.mark.parametrize("form", ["directory", "index", "file"])
def test_logits_equal_the_hugging_face_model(pretrained: dict[str, Any], form: str) -> None:
    path = {
        "directory": pretrained["root"] / "sharded",
        "index": pretrained["root"] / "sharded" / "model.safetensors.index.json",
        "file": pretrained["root"] / "single" / "model.safetensors",
    }[form]
    for r in run_on_ranks(load_and_run, 2, str(path), ""):
        assert r["sharded"] and r["missing"] == [] and r["unexpected"] == []
        assert "transformer.h.0.attn.c_attn.weight (transformer.h.0.attn.c_attn: Conv1D)" in r["refused"]
        torch.testing.assert_close(r["logits"], pretrained["logits"])


def test_param_init_empty_leaves_every_meta_parameter_to_the_load(pretrained: dict[str, Any]) -> None:
    for r in run_on_ranks(load_and_run, 2, str(pretrained["root"] / "sharded"), "", "empty"):
        # Modules with reset_parameters() (Embedding, LayerNorm) were not initialised either: named until loaded.
        for named in ("transformer.wte.weight (transformer.wte: Embedding)", "transformer.ln_f.bias (transformer.ln_f:"
                      " LayerNorm)", "transformer.h.1.attn.c_proj.weight (transformer.h.1.attn.c_proj: Conv1D)"):
            assert named in r["refused"], r["refused"]
        assert r["missing"] == [] and r["unexpected"] == []
        torch.testing.assert_close(r["logits"], pretrained["logits"])


def test_param_init_names_the_valid_values() -> None:
    from lightning_shard import ShardStrategy
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    for strategy in (ShardStrategy, FabricShardStrategy):
        with pytest.raises(ValueError, match="param_init") as raised:
            strategy(param_init="zeros")  # type: ignore[arg-type]
        assert "'reset_parameters'" in str(raised.value) and "'empty'" in str(raised.value), raised.value


def test_prefix_loads_into_a_module_holding_the_network(pretrained: dict[str, Any]) -> None:
    for r in run_on_ranks(load_and_run, 2, str(pretrained["root"] / "sharded"), "model."):
        assert r["missing"] == [] and r["unexpected"] == []
        torch.testing.assert_close(r["logits"], pretrained["logits"])


def count_opens(rank: int, world_size: int, path: str) -> dict[str, int]:
    """How many times each file is opened while one rank loads ``path``."""
    import os

    opened: dict[str, int] = {}
    os_open = os.open

    def recording(name: Any, *args: Any, **kwargs: Any) -> Any:
        if str(name).endswith(".safetensors"):
            opened[Path(name).name] = opened.get(Path(name).name, 0) + 1
        return os_open(name, *args, **kwargs)

    os.open = recording  # type: ignore[assignment]
    try:
        load_and_run(rank, world_size, path, "")
    finally:
        os.open = os_open  # type: ignore[assignment]
    return opened


def test_each_file_is_opened_once_for_its_header_and_once_for_its_rows(pretrained: dict[str, Any]) -> None:
    directory = pretrained["root"] / "sharded"
    files = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values())
    for opened in run_on_ranks(count_opens, 2, str(directory)):
        assert opened == dict.fromkeys(files, 2)  # once to check its header before any data is read, once to read
