"""Lightning's checkpoint dict (everything but the model and optimizer tensors) as JSON plus a dict of tensors,
and back: nothing is ever pickled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shard.checkpoint.format import CheckpointError, dtype_from_name, dtype_name

TRAINER_MODEL = "state_dict"  # Lightning's checkpoint dict: the LightningModule's state_dict ...
TRAINER_OPTIMIZERS = "optimizer_states"  # ... and a list of optimizer.state_dict()s
TRAINER_PLACEHOLDERS = (TRAINER_MODEL, TRAINER_OPTIMIZERS)  # what a save writes from the shards, not as JSON


def to_json_tree(obj: Any, tensors: dict[str, Tensor], path: str = "") -> Any:
    """Encode ``obj`` as JSON-compatible data; tensors move to ``tensors`` (keyed by their path) and are referenced.

    Raises ``CheckpointError`` naming the path of any value that JSON and tensors cannot represent.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor):
        _refuse_dtensor(obj, path)
        key = _unique_key(tensors, path or "value")
        tensors[key] = obj.detach().cpu().clone()  # own storage: safetensors refuses shared memory
        return {"__tensor__": key}
    if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
        return _ndarray_to_json(obj, tensors, path)
    if isinstance(obj, torch.dtype):
        return {"__dtype__": dtype_name(obj)}
    if isinstance(obj, Path):
        return {"__path__": str(obj)}
    if isinstance(obj, (list, tuple)):
        items = [to_json_tree(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: to_json_tree(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {"__items__": [[to_json_tree(k, tensors, f"{path}/key{i}"), to_json_tree(v, tensors, f"{path}/{i}")]
                              for i, (k, v) in enumerate(obj.items())]}
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return obj.item()  # a numpy scalar (np.float64(0.5), np.int64(3)) comes back as the Python number
    raise CheckpointError(
        f"The checkpoint value at {path or '/'} is a {type(obj).__name__}, which cannot be stored without pickle."
        f" Store plain values (numbers, strings, lists, dicts, tensors) in hyperparameters and callback states."
    )


def from_json_tree(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """Invert ``to_json_tree``."""
    if isinstance(obj, list):
        return [from_json_tree(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return _ndarray_from_json(obj, tensors)
    if "__dtype__" in obj:
        return dtype_from_name(obj["__dtype__"])
    if "__path__" in obj:
        return Path(obj["__path__"])
    if "__tuple__" in obj:
        return tuple(from_json_tree(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_hashable(from_json_tree(k, tensors)): from_json_tree(v, tensors) for k, v in obj["__items__"]}
    return {k: from_json_tree(v, tensors) for k, v in obj.items()}


def _refuse_dtensor(tensor: Tensor, path: str) -> None:
    """A ``DTensor`` (this rank's shard of a distributed tensor: what ``checkpoint["state_dict"]`` holds during
    ``trainer.save_checkpoint``) has no one value to store in the trainer state: refuse it, naming where it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        raise CheckpointError(
            f"The checkpoint value at {path or '/'} is a DTensor (one rank's shard, as checkpoint['state_dict'] and"
            " checkpoint['optimizer_states'] hold them during trainer.save_checkpoint), which the trainer state"
            " cannot store. The model and optimizers are written from the shards already: do not copy those entries"
            " under other keys; store a plain tensor instead (value.full_tensor(), called on every rank)."
        )


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _unique_key(tensors: dict[str, Tensor], key: str) -> str:
    """``key``, or ``key#1``, ``key#2``...: the first one not taken. Paths join dict keys with "/", so the values
    under ``{"a/b": ...}`` and ``{"a": {"b": ...}}`` would otherwise share a name; the JSON names each tensor's
    key, whatever it is."""
    unique, n = key, 0
    while unique in tensors:
        n += 1
        unique = f"{key}#{n}"
    return unique


# numpy arrays are stored as tensors of a dtype safetensors has (the unsigned types above uint8 widened to the next
# signed one that holds every value) and cast back to their own dtype when read.
_NDARRAY_STORED_AS = {
    "float64": "float64", "float32": "float32", "float16": "float16", "int64": "int64", "int32": "int32",
    "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool", "uint16": "int32", "uint32": "int64",
}


def _ndarray_to_json(array: Any, tensors: dict[str, Tensor], path: str) -> dict[str, str]:
    """A numpy array (``np.random.get_state()``'s key, a metric's buffer) as a tensor plus its dtype's name."""
    import numpy as np

    dtype = array.dtype.name
    if dtype not in _NDARRAY_STORED_AS:
        raise CheckpointError(
            f"The checkpoint value at {path or '/'} is a numpy array of dtype {dtype}, which cannot be stored without"
            f" pickle. Numeric arrays of dtype {', '.join(_NDARRAY_STORED_AS)} can; convert it to one of them."
        )
    key = _unique_key(tensors, path or "value")
    tensors[key] = torch.from_numpy(np.array(array, dtype=_NDARRAY_STORED_AS[dtype], order="C", copy=True))
    return {"__ndarray__": key, "dtype": dtype}


def _ndarray_from_json(obj: dict[str, Any], tensors: dict[str, Tensor]) -> Any:
    dtype = obj.get("dtype")
    if dtype not in _NDARRAY_STORED_AS:
        raise CheckpointError(f"The trainer state holds a numpy array of unknown dtype {dtype!r}.")
    return tensors[obj["__ndarray__"]].numpy().astype(dtype)
