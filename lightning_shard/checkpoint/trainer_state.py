"""Lightning's checkpoint dict (everything but the model and optimizer tensors) as JSON plus a dict of tensors,
and back: nothing is ever pickled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shard.checkpoint.format import CheckpointError, dtype_from_name, dtype_name


def to_json_tree(obj: Any, tensors: dict[str, Tensor], path: str = "") -> Any:
    """Encode ``obj`` as JSON-compatible data; tensors move to ``tensors`` (keyed by their path) and are referenced.

    Raises ``CheckpointError`` naming the path of any value that JSON and tensors cannot represent.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Tensor):
        key = path or "value"
        tensors[key] = obj.detach().cpu().clone()  # own storage: safetensors refuses shared memory
        return {"__tensor__": key}
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
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalars
        return obj.item()
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
    if "__dtype__" in obj:
        return dtype_from_name(obj["__dtype__"])
    if "__path__" in obj:
        return Path(obj["__path__"])
    if "__tuple__" in obj:
        return tuple(from_json_tree(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_hashable(from_json_tree(k, tensors)): from_json_tree(v, tensors) for k, v in obj["__items__"]}
    return {k: from_json_tree(v, tensors) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key
