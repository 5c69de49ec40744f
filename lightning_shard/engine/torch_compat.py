"""Where the supported torch versions differ, in one place: each name below is what the engine calls, and each branch
says which torch it serves. The floor is torch 2.7 (``pyproject.toml``; why: docs/testing.md, "Supported torch
versions"); ``make test-torch TORCH=...`` runs the tests that cover these branches against any torch in the range.
Everything the package uses that no branch here names is the same in every supported torch.
"""

from __future__ import annotations

import torch.distributed as dist

# The single-tensor collectives: torch 2.13 names them all_gather_single and reduce_scatter_single (and deprecates
# the old names, with a warning per call); torch 2.7 to 2.12 have only all_gather_into_tensor and
# reduce_scatter_tensor. The arguments are the same: (output, input, [op,] group, async_op).
if hasattr(dist, "all_gather_single"):  # torch 2.13 and newer
    all_gather_single = dist.all_gather_single
    reduce_scatter_single = dist.reduce_scatter_single
else:  # torch 2.7 to 2.12
    all_gather_single = dist.all_gather_into_tensor
    reduce_scatter_single = dist.reduce_scatter_tensor

__all__ = ["all_gather_single", "reduce_scatter_single"]
