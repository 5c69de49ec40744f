"""A second copy of the model's tensors in a checkpoint: the running average of the weights (EMA/SWA).

[Note: averaged weights in a checkpoint]
A weight-averaging callback keeps, on every rank, the average of this rank's rows of every
parameter (and of every buffer). A save stores it beside the model, laid out like it: index keys
``"average/" + <the model's state_dict key>``, each rank writing its rows of the parameters (rank
0 the buffers) in its own shard file, so nothing is gathered. A load reads each rank's rows back,
whatever world size wrote them, straight into the averaged tensors. The front end passes the
averaged tensors to the save under ``AVERAGED_MODEL_KEY`` in the checkpoint dict (the save takes
them out before the trainer state is written) and asks ``load_averaged`` (``averaged_load.py``) for
them on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError
from lightning_shard.checkpoint.io.index import iter_index_tensors

AVERAGE_PREFIX = "average/"  # index keys of averaged tensors: "average/" + the model's state_dict key
AVERAGE_FILE = "average.safetensors"  # where a "full" save streams the averaged weights
AVERAGED_MODEL_KEY = "lightning_shard_averaged_model"  # the checkpoint dict's entry a save takes out


@dataclass(frozen=True)
class AveragedTensors:
    """This rank's averaged tensors, keyed by the model's parameter and buffer names: for a parameter, a tensor of
    this rank's rows (shaped like its shard); for a buffer, the whole buffer."""

    tensors: dict[str, Tensor] = field(repr=False)


Weights = Literal["current", "averaged"]


def weights_prefix(index: dict[str, Any], weights: Weights | str, where: Any) -> str:
    """The index prefix of the weights a reader of checkpoint ``where`` named: ``"current"`` (the model as trained)
    or ``"averaged"`` (the running average a weight-averaging callback kept; refused if the checkpoint has none)."""
    if weights == "current":
        return MODEL_PREFIX
    if weights != "averaged":
        raise ValueError(f"weights={weights!r} is not one of 'current', 'averaged'.")
    if not any(True for _ in iter_index_tensors(index, AVERAGE_PREFIX)):
        raise CheckpointError(
            f"{where} holds no averaged weights: it was not saved during a fit with a WeightAveraging callback."
            " Use weights='current' (--weights current)."
        )
    return AVERAGE_PREFIX
