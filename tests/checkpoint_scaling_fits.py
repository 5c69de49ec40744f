"""Worker functions and models for the checkpoint-scaling tests (tests/test_checkpoint_scaling.py).

``VersionOneModel`` is the model of the committed version-1 checkpoint ``tests/fixtures/checkpoint_v1/checkpoint``:
a tied embedding and head, a Linear whose 3 rows two ranks split unevenly, a learnable 0-dim scale (its Adam state
split by rows like it) and an integer buffer, after one Adam step. ``write_version_1_fixture`` wrote it with the
version-1 writer, on 2 gloo ranks::

    .venv/bin/python -c "from lightning_shard.testing import run_on_ranks; \
from tests.checkpoint_scaling_fits import write_version_1_fixture as w; \
run_on_ranks(w, 2, 'tests/fixtures/checkpoint_v1/checkpoint')"

(the writer of today writes the current version, so running it again writes a current-version checkpoint). Beside the
checkpoint, ``expected.safetensors`` holds the full model and optimizer state it stores, under
``module_full_state``'s names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shard.checkpoint import load_checkpoint, save_checkpoint
from lightning_shard.engine import shard_model
from lightning_shard.testing_checkpoints import shard_files_read
from tests.checkpoint_fits import module_full_state
from tests.models import GPTBlock, TinyGPT, make_dataset

FIXTURE_V1 = Path(__file__).parent / "fixtures" / "checkpoint_v1" / "checkpoint"
EXPECTED_V1 = FIXTURE_V1.parent / "expected.safetensors"
FIXTURE_V2 = Path(__file__).parent / "fixtures" / "checkpoint_v2" / "checkpoint"  # written so by the version-2 writer


class VersionOneModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mix = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: stored once
        self.register_buffer("seen", torch.tensor([3, 1, 4], dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)) * self.scale)


_TOKENS = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])


def _adam_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    F.cross_entropy(model(_TOKENS).flatten(0, 1), _TOKENS.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def write_version_1_fixture(rank: int, world_size: int, path: str) -> None:
    """One Adam step of ``VersionOneModel`` saved at ``path``; its full state in ``expected.safetensors`` beside."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = VersionOneModel()
    shard_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _adam_step(model, optimizer)
    save_checkpoint(path, model, [optimizer], {"step": 1})
    state = module_full_state(model, [optimizer])
    if rank == 0:
        tensors = {f"params/{k}": v.clone() for k, v in state["params"].items()}
        tensors |= {f"optimizer/{k}": v.clone() for k, v in state["optimizer"].items()}
        save_file(tensors, str(Path(path).parent / "expected.safetensors"))


def load_version_1_fixture(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Load ``path`` into a freshly initialised ``VersionOneModel`` and its Adam; the full state that arrived."""
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = VersionOneModel()
    shard_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    values, _ = load_checkpoint(path, model, [optimizer])
    state = module_full_state(model, [optimizer])
    return {"values": values, "params": state["params"], "optimizer": state["optimizer"]}


def load_refused(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Load the damaged checkpoint ``path`` into ``VersionOneModel`` and its Adam after a step of their own: the error,
    and whether the model and the optimizer still hold exactly what they held before."""
    from lightning_shard.checkpoint.format import CheckpointError

    torch.manual_seed(1)
    model = VersionOneModel()
    shard_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _adam_step(model, optimizer)
    before = module_full_state(model, [optimizer])
    try:
        load_checkpoint(path, model, [optimizer])
        error = ""
    except CheckpointError as err:
        error = str(err)
    after = module_full_state(model, [optimizer])
    unchanged = all(before[part].keys() == after[part].keys() and all(
        torch.equal(value, after[part][name]) for name, value in before[part].items()) for part in before)
    _adam_step(model, optimizer)  # and it trains on
    return {"error": error, "unchanged": unchanged}


# --------------------------------------------------------------------------------------------------
# Checkpoints of many writers, loaded by a few
# --------------------------------------------------------------------------------------------------


class TallGPT(TinyGPT):
    """TinyGPT with a 2,048-token vocabulary, whose embedding has rows for every shard of a 1,024-rank world (2 each),
    and an integer buffer."""

    def __init__(self) -> None:
        super().__init__(vocab=2048, d=8, depth=2, heads=2)
        self.register_buffer("seen", torch.arange(5))


def _gpt_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, y = make_dataset("gpt")[:6]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def trained_plain(model_class: type[nn.Module]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model_class`` after one AdamW step, in one process: what ``simulate_save`` writes."""
    torch.manual_seed(0)
    model = model_class()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _gpt_step(model, optimizer)
    return model, optimizer


def plain_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """``module_full_state``'s names for a plain model and its optimizer."""
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    params = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    optim = {f"0/{names[id(p)]}/{k}": v for p, state in optimizer.state.items() for k, v in state.items()}
    return {"params": params, "optimizer": optim}


def with_layout(rank: int, world_size: int, layout: dict[str, int], fn: Any, *args: Any) -> Any:
    """``fn(rank, world_size, *args)`` with saves laying out their tensors by the constants of ``layout`` (names in
    ``lightning_shard.checkpoint.format``: ``SPLIT_PIECE_MIN_BYTES``, ``WHOLE_FILE_MIN_BYTES``; see [Note: small
    tensors stored whole]); ``SPLIT_PIECE_MIN_BYTES`` 0 splits every tensor the shards hold by rows, as version-3
    saves did before they stored small tensors whole."""
    from lightning_shard.checkpoint import format as checkpoint_format

    defaults = {name: getattr(checkpoint_format, name) for name in layout}
    for name, value in layout.items():
        setattr(checkpoint_format, name, value)
    try:
        return fn(rank, world_size, *args)
    finally:
        for name, value in defaults.items():  # the worker process serves later tests
            setattr(checkpoint_format, name, value)


def save_sharded(rank: int, world_size: int, path: str, model_class: type[nn.Module]) -> dict[str, Any]:
    """``model_class`` after one AdamW step on ``world_size`` ranks, saved at ``path``; its full state."""
    torch.manual_seed(0)
    model = model_class()
    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _gpt_step(model, optimizer)
    save_checkpoint(path, model, [optimizer], {"step": 1})
    return module_full_state(model, [optimizer])


def load_counting(
    rank: int, world_size: int, path: str, model_class: type[nn.Module], together: bool = False
) -> dict[str, Any]:
    """Load ``path`` into a fresh sharded ``model_class`` and AdamW, the model then the optimizer (``together``:
    with ``load_checkpoint``, in one read); the full state that arrived, and the work this rank did: the files whose
    headers it read, the pieces it checked, every file it opened (once per open)."""
    import builtins
    import os

    from lightning_shard.checkpoint.io.agreement import agree
    from lightning_shard.checkpoint.load.directory import load_model, load_optimizers, load_trainer_state

    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = model_class()
    engine = shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opened: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def record(opener: Any) -> Any:
        def opening(file: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, Path)):
                opened.append(str(Path(file).resolve()))
            return opener(file, *args, **kwargs)
        return opening

    builtins.open, os.open = record(real_open), record(real_os_open)  # type: ignore[assignment]
    try:
        directory = Path(path)
        with shard_files_read() as shard_files:
            if together:
                load_checkpoint(directory, model, [optimizer])
            else:
                _, index = agree(lambda: load_trainer_state(directory))
                load_model(engine, model, directory, index)
                load_optimizers(engine, [optimizer], directory, index)
    finally:
        builtins.open, os.open = real_open, real_os_open  # type: ignore[assignment]
    files = shard_files[-1]
    state = module_full_state(model, [optimizer])
    return {**state, "headers_read": files.headers_read, "pieces_checked": files.pieces_checked, "opened": opened}
