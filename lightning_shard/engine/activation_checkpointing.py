"""Activation checkpointing of chosen modules, working with sharding.

The chosen modules' ``forward`` runs under non-reentrant ``torch.utils.checkpoint``: their
activations are dropped after forward and recomputed in backward. The recomputation calls the
original ``forward`` directly (not the module, so no sharding hook runs twice); by then the unit
holding the weights has been gathered again by its pre-backward hook and its modules hold the
unsharded faces (see [Note: unit states and autograd]).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.utils.checkpoint
from torch import nn

from lightning_shard.engine.policies import WrapPolicy, select_unit_modules

_MARK = "_lightning_shard_checkpointed"


def apply_activation_checkpointing(root: nn.Module, policy: WrapPolicy) -> list[str]:
    """Checkpoint every module ``policy`` selects (once; applying again is a no-op); return their names."""
    names = []
    for name, module in select_unit_modules(root, policy):
        if not getattr(module, _MARK, False):
            module.forward = functools.partial(_checkpointed, module.forward)  # type: ignore[method-assign]
            setattr(module, _MARK, True)
        names.append(name)
    return names


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
