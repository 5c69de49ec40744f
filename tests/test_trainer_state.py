"""The trainer state (Lightning's checkpoint dict without the model and optimizer tensors) through JSON and a
safetensors file and back: values keep their identity and type, numpy arrays included, and what cannot be stored
without pickle is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.format.trainer_state import from_json_tree, to_json_tree


def _round_trip(value: Any, tmp_path: Path) -> Any:
    tensors: dict[str, torch.Tensor] = {}
    tree = json.loads(json.dumps(to_json_tree(value, tensors)))
    save_file(tensors, str(tmp_path / "state.safetensors"))
    return from_json_tree(tree, load_file(str(tmp_path / "state.safetensors")))


def test_values_whose_paths_read_alike_stay_apart(tmp_path: Path) -> None:
    """``{"a/b": x}`` and ``{"a": {"b": y}}`` have the same "/"-joined path; each keeps its own tensor."""
    value = {"a/b": torch.zeros(2), "a": {"b": torch.ones(2)}, "c": [torch.full((1,), 3.0), torch.full((1,), 4.0)]}
    back = _round_trip(value, tmp_path)
    assert torch.equal(back["a/b"], torch.zeros(2)) and torch.equal(back["a"]["b"], torch.ones(2))
    assert [t.item() for t in back["c"]] == [3.0, 4.0]


def test_numpy_arrays_come_back_as_numpy_arrays_of_their_dtype(tmp_path: Path) -> None:
    np.random.seed(7)
    state = np.random.get_state()  # ('MT19937', uint32 array of 624, int, int, float)
    value = {"small": np.array([5.0]), "grid": np.arange(6, dtype=np.int16).reshape(2, 3), "rng": state,
             "flags": np.array([True, False]), "scalar": np.float32(0.5), "count": np.int64(3)}
    back = _round_trip(value, tmp_path)
    assert isinstance(back["small"], np.ndarray) and back["small"].dtype == np.float64
    assert back["small"].tolist() == [5.0]
    assert back["grid"].dtype == np.int16 and back["grid"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert back["flags"].dtype == np.bool_ and back["flags"].tolist() == [True, False]
    assert back["rng"][1].dtype == np.uint32 and np.array_equal(back["rng"][1], state[1])
    np.random.set_state(back["rng"])
    expected = np.random.rand(3)
    np.random.set_state(state)
    assert np.array_equal(np.random.rand(3), expected)  # the restored generator continues where the saved one was
    assert back["scalar"] == 0.5 and back["count"] == 3 and type(back["count"]) is int


def test_arrays_that_need_pickle_are_refused_naming_the_value(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"at /callbacks/names is a numpy array of dtype object"):
        to_json_tree({"callbacks": {"names": np.array(["a", None], dtype=object)}}, {})
    with pytest.raises(CheckpointError, match=r"numpy array of dtype complex128"):
        to_json_tree(np.zeros(2, dtype=np.complex128), {})


def test_a_numpy_dtype_a_file_claims_is_checked() -> None:
    with pytest.raises(CheckpointError, match="numpy array of unknown dtype 'object'"):
        from_json_tree({"__ndarray__": "x", "dtype": "object"}, {"x": torch.zeros(1)})
