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
