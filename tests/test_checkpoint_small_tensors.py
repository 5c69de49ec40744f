"""Tensors whose pieces would be small are stored whole (see [Note: small tensors stored whole] in
lightning_shard/checkpoint/io/layout.py): a checkpoint of many writers is a few files to a reader, not one per writer,
and still loads exactly at another world size. Large worlds are simulated (``simulate_save``, the save's own code;
tests/test_checkpoint_scaling.py checks it against a real save that splits some tensors and stores others whole)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_shard.checkpoint import format as checkpoint_format
from lightning_shard.checkpoint.format import INDEX_FILE, shard_file_name
from lightning_shard.checkpoint.io.index import read_index
from lightning_shard.checkpoint.io.layout import splits_by_rows, whole_owners
from lightning_shard.checkpoint.io.reader import RowReads
from lightning_shard.testing import run_on_ranks
from lightning_shard.testing_checkpoints import simulate_save
from tests.checkpoint_scaling_fits import TallGPT, load_counting, plain_state, trained_plain

WORLD = 1024


@pytest.fixture(scope="module")
def tall(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TallGPT after one AdamW step saved as 1,024 FULL_SHARD ranks save it: each of its tensors has pieces of at most
    64 bytes there, so each is stored whole, and all of them (under 8 MiB) in shard 0's file."""
    model, optimizer = trained_plain(TallGPT)
    path = simulate_save(tmp_path_factory.mktemp("tall") / "ckpt", model, WORLD, [optimizer], {"step": 1})
    return {"path": path, "state": plain_state(model, optimizer)}


def test_a_tensor_whose_pieces_would_be_small_is_stored_whole(tall: dict[str, Any]) -> None:
    path = tall["path"]
    index = json.loads((path / INDEX_FILE).read_text())
    assert all("split" not in e for e in index["tensors"].values())
    first = shard_file_name(0, WORLD)
    assert {e["file"] for e in index["tensors"].values()} == {first}
    header = read_index(path)["tensors"]["model/wte.weight"].files.header(first)
    for key, entry in index["tensors"].items():
        assert list(header.entries[key].shape) == entry["shape"], key  # whole
    files = [shard_file_name(s, WORLD) for s in range(WORLD)]
    assert index["shard_files"] == files == sorted(p.name for p in path.glob("shard-*.safetensors"))
    for name in files[1:]:  # each writing rank writes its file, here holding nothing
        raw = (path / name).read_bytes()
        assert list(json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])) == ["__metadata__"], name


def _assert_equal_states(got: dict[str, dict[str, torch.Tensor]], expected: dict[str, dict[str, torch.Tensor]]) -> None:
    for part in ("params", "optimizer"):
        assert sorted(got[part]) == sorted(expected[part]), part
        for name, value in expected[part].items():
            assert torch.equal(got[part][name], value), f"{part} {name}"


def test_a_checkpoint_of_1024_ranks_loads_on_2_reading_the_few_files_holding_its_tensors(tall: dict[str, Any]) -> None:
    tensors = json.loads((tall["path"] / INDEX_FILE).read_text())["tensors"]
    for loaded in run_on_ranks(load_counting, 2, str(tall["path"]), TallGPT, True):
        _assert_equal_states(loaded, tall["state"])
        assert loaded["headers_read"] == [shard_file_name(0, WORLD)]  # not 512 and more
        assert loaded["pieces_checked"] == len(tensors)  # a piece a tensor, not tens of thousands


def test_the_rule_splits_a_tensor_whose_pieces_take_at_least_the_minimum() -> None:
    minimum = checkpoint_format.SPLIT_PIECE_MIN_BYTES
    assert minimum == 64 * 2**10
    assert splits_by_rows((16384 * 8,), torch.float32, 8)  # 16,384 rows of 4 bytes a shard: 64 KiB
    assert not splits_by_rows((16383 * 8,), torch.float32, 8)
    assert not splits_by_rows((2048, 512), torch.float32, 1024)  # the 25M GPT's fc.weight: 2 rows of 2 KiB a shard
    assert splits_by_rows((2048, 512), torch.float32, 64) and not splits_by_rows((2048, 512), torch.bfloat16, 128)
    assert not splits_by_rows((), torch.float32, 1) and not splits_by_rows((0, 4096), torch.float32, 1)


def test_tensors_stored_whole_are_dealt_round_robin_to_as_many_shards_as_hold_enough_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(checkpoint_format, "WHOLE_FILE_MIN_BYTES", 10)
    tensors = [("a", 5), ("b", 5), ("c", 5), ("d", 5), ("e", 9)]
    assert whole_owners(tensors, 8) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}  # 29 bytes: 2 shards of 10
    assert whole_owners(tensors, 1) == dict.fromkeys("abcde", 0)
    assert whole_owners(tensors[:1], 8) == {"a": 0}  # fewer bytes than the minimum: one shard
    monkeypatch.setattr(checkpoint_format, "WHOLE_FILE_MIN_BYTES", 1)
    assert whole_owners(tensors, 3) == {"a": 0, "b": 1, "c": 2, "d": 0, "e": 1}

    monkeypatch.setattr(checkpoint_format, "SPLIT_PIECE_MIN_BYTES", 64)  # at 16 shards: 4 rows of 64 bytes a shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 1), torch.nn.Linear(1, 3))
    ckpt = simulate_save(tmp_path / "ckpt", model, 16)
    entries = json.loads((ckpt / INDEX_FILE).read_text())["tensors"]
    assert {k: e.get("split") for k, e in entries.items()} == {  # 4 rows of 16 bytes a shard, 1 row of 256 bytes
        "model/0.weight": "rows", "model/0.bias": None, "model/1.weight": "rows", "model/1.bias": None,
        "model/2.weight": None, "model/2.bias": None}
    assert {k: e["file"] for k, e in entries.items() if "file" in e} == {  # dealt in the order of the index
        "model/0.bias": shard_file_name(0, 16), "model/1.bias": shard_file_name(1, 16),
        "model/2.weight": shard_file_name(2, 16), "model/2.bias": shard_file_name(3, 16)}
    stored = read_index(ckpt)["tensors"]
    state = model.state_dict()
    for start, stop in ((0, 64), (0, 1), (5, 37), (63, 64)):  # rows a reader of another world size needs
        reads = RowReads()
        for name in state:
            rows = state[name].shape[0]
            reads.add(stored["model/" + name], min(start, rows), min(stop, rows))
        for name, got in zip(state, reads.run()):
            rows = state[name].shape[0]
            assert torch.equal(got, state[name][min(start, rows) : min(stop, rows)]), (name, start, stop)
