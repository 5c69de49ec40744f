"""Warnings the engine gives about a model when it is set up.

The ranks hold the same model, so they would all warn alike: the warning is given by global rank 0 only (every
process when no process group exists), as Lightning's ``rank_zero_warn`` does.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist


def warn_rank0(message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) on global rank 0."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def warn_nothing_initialises(modules: dict[str, str]) -> None:
    """Name, once at set-up, the modules (name -> class name) whose meta-device parameters nothing initialises (see
    [Note: parameters nothing initialises]), and their classes, in Lightning's words first. Not given with
    ``param_init="empty"``, which asks for exactly that."""
    warn_rank0(
        "Parameter initialization incomplete. The following modules have parameters or buffers with uninitialized"
        " memory because they don't define a `reset_parameters()` method for re-initialization: "
        + ", ".join(dict.fromkeys(modules.values())) + ". "
        "These modules own parameters built on the meta device but have no reset_parameters(), so nothing"
        " initialises them: " + ", ".join(f"{name} ({cls})" for name, cls in modules.items()) + ". Their shards"
        " hold uninitialised memory, and a forward"
        " raises until weights are loaded. Load the weights before the first forward (load_safetensors_into(),"
        " e.g. from on_fit_start, or fabric.load_raw() after setup_module), give these modules a"
        " reset_parameters(), or pass param_init='empty' if the whole model is loaded (it initialises nothing"
        " and does not warn).",
        stacklevel=4,
    )
