"""Checkpoints that hold only some of the model: ``save_trainable_only`` and ``fabric.save(filter=...)``.

[Note: weights a checkpoint leaves out]
A fine-tune of a frozen pretrained model changes only a small part of it (LoRA adapters): writing the
frozen base into every checkpoint costs its full size each time. A save with a ``ModelSelection``
writes the model tensors it keeps and the optimizer state of those parameters, and records in the
index, for each model tensor it leaves out, its fingerprint (``lightning_shard.engine.fingerprints``).
Such a checkpoint resumes when the left-out weights come from where they came from (a pretrained
import in ``configure_model``, ``on_fit_start`` or after ``fabric.setup_module``), which may happen
after the load: the Trainer loads a checkpoint before ``on_fit_start``. So the load fills what it
holds, and before the next forward every rank checks that the left-out weights hold the values they
had at the save; if they do not (nothing filled them, or another model did), the forward raises on
every rank, naming them, instead of training on random weights. A left-out weight built on the meta
device and never loaded is refused by the check for uninitialised parameters first. A load with
``strict=False`` loads what is there and checks nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_shard.checkpoint.format import MODEL_PREFIX, CheckpointError
from lightning_shard.checkpoint.io.agreement import agree, broadcast_str
from lightning_shard.engine.fingerprints import Fingerprint, fingerprints
from lightning_shard.engine.option_choices import SavedParameters
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.engine.sharded_module import ShardedModule

MODEL_SELECTION_KEY = "lightning_shard_model_selection"  # the checkpoint dict's entry a save takes out
_CHECK_NAME = "weights a checkpoint left out"

KeyFilter = Callable[[str, Any], bool]


@dataclass(frozen=True)
class ModelSelection:
    """What a save keeps of the model (see [Note: weights a checkpoint leaves out]): the parameters ``parameters``
    names, and of those and of the buffers, what ``predicate`` (called with the state-dict key and value, as
    Fabric's ``filter`` is) keeps."""

    parameters: SavedParameters = SavedParameters.ALL
    predicate: KeyFilter | None = None

    def __post_init__(self) -> None:
        if self.predicate is not None and not callable(self.predicate):
            raise TypeError(
                f"A filter must be a callable taking (key, value) and returning whether to save it; got"
                f" {type(self.predicate).__name__}."
            )

    @property
    def keeps_everything(self) -> bool:
        return self.parameters is SavedParameters.ALL and self.predicate is None

    def keeps_parameter(self, key: str, value: Tensor, param: ShardedParam) -> bool:
        if self.parameters is SavedParameters.TRAINABLE and not param.requires_grad:
            return False
        return self.predicate is None or bool(self.predicate(key, value))

    def keeps_buffer(self, key: str, value: Tensor) -> bool:
        return self.predicate is None or bool(self.predicate(key, value))


def left_out_fingerprints(
    engine: ShardedModule, params: list[tuple[str, ShardedParam]], buffers: list[tuple[str, Tensor]]
) -> dict[str, Fingerprint]:
    """The index's ``left_out`` table for the parameters and buffers a save leaves out, keyed by model key. The
    ranks must have chosen the same tensors (a filter that looks at this rank's rows may not): checked first, so
    a disagreement fails on every rank. Collective."""
    names = "\n".join([key for key, _ in params] + [key for key, _ in buffers])
    digest = hashlib.sha256(names.encode()).hexdigest()
    first = broadcast_str(digest)

    def same_on_every_rank() -> None:
        if first != digest:
            raise CheckpointError(
                "The ranks chose different model tensors to save (the filter answered differently on different"
                " ranks: it must decide from the key, or from what every rank holds alike). Nothing was saved."
            )

    agree(same_on_every_rank)
    prints = fingerprints([p for _, p in params], [b for _, b in buffers], engine.mesh.replicate_rank, engine.device)
    keys = [key for key, _ in params] + [key for key, _ in buffers]
    return {MODEL_PREFIX + key: value for key, value in zip(keys, prints)}


def expect_left_out(
    engine: ShardedModule, module: nn.Module, left_out: dict[str, Fingerprint], where: Any, strict: bool
) -> set[str]:
    """After loading a checkpoint that left ``left_out`` out: with ``strict``, check before the next forward that
    the model's tensors of those keys hold the values they had at the save (see [Note: weights a checkpoint leaves
    out]). Returns the model keys that count as accounted for (none without ``strict``)."""
    if not left_out or not strict:
        engine.check_before_next_forward(_CHECK_NAME, None)
        return set()
    wanted = {key.removeprefix(MODEL_PREFIX): value for key, value in left_out.items()}
    params = [(name, p) for p in engine.sharded_params() if (name := next((f for f in p.fqns if f in wanted), None))]
    owned = {f for p in engine.sharded_params() for f in p.fqns}
    buffers = [(k, b) for k, b in module.named_buffers(remove_duplicate=False) if k in wanted and k not in owned]

    def check() -> None:
        found = fingerprints([p for _, p in params], [b for _, b in buffers], engine.mesh.replicate_rank,
                             engine.device)
        names = [name for name, _ in params] + [name for name, _ in buffers]
        changed = [name for name, value in zip(names, found) if value != wanted[name]]
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise CheckpointError(
                f"The checkpoint {where} holds only part of the model (saved with save_trainable_only=True or a"
                f" filter) and relies on the rest being restored from where it came from, but {len(changed)} of the"
                f" {len(params) + len(buffers)} weights it left out do not hold the values they had when it was"
                f" saved: {shown}. Load the pretrained weights they came from (in configure_model, in on_fit_start"
                " with load_safetensors_into(), or after fabric.setup_module()) before training resumes, or load"
                " the checkpoint with strict=False to keep them as they are."
            )

    engine.check_before_next_forward(_CHECK_NAME, check)
    return {f for _, p in params for f in p.fqns} | {name for name, _ in buffers}
