"""Where the supported torch versions differ, in one place: each name below is what the engine calls, and each branch
says which torch it serves. The floor is torch 2.7 (``pyproject.toml``; why: docs/testing.md, "Supported torch
versions"); ``make test-torch TORCH=...`` runs the tests that cover these branches against any torch in the range.
Everything the package uses that no branch here names is the same in every supported torch. Each branch is chosen by
whether the API exists, not by the version number, so the versions between 2.7 and 2.13 (not run here) take
whichever branch fits them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The single-tensor collectives: torch 2.13 names them all_gather_single and reduce_scatter_single (and deprecates
# the old names, with a warning per call); torch 2.7 to 2.12 have only all_gather_into_tensor and
# reduce_scatter_tensor. The arguments are the same: (output, input, [op,] group, async_op).
if hasattr(dist, "all_gather_single"):  # torch 2.13 and newer
    all_gather_single = dist.all_gather_single
    reduce_scatter_single = dist.reduce_scatter_single
else:  # torch 2.7 to 2.12
    all_gather_single = dist.all_gather_into_tensor
    reduce_scatter_single = dist.reduce_scatter_tensor

# Moving memory from one storage into another, every view following it (the buffer pool's ``fill`` and ``drain``):
# torch 2.13 has UntypedStorage._swap_data_ptr_; torch 2.7 to 2.12 can only resize a storage, so there the pool
# allocates a unit's buffer anew with resize_(nbytes) and frees it with resize_(0), as it did before it pooled.
STORAGES_SWAP_MEMORY = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # True from torch 2.13


def root_mesh(mesh: DeviceMesh) -> Any:
    """The mesh ``mesh`` was sliced from (``mesh`` itself when it is not a slice)."""
    if hasattr(mesh, "_get_root_mesh"):  # torch 2.13 and newer: a method of the mesh
        return mesh._get_root_mesh()
    from torch.distributed.device_mesh import _mesh_resources  # torch 2.7 to 2.12: the module's mesh registry

    return _mesh_resources.get_root_mesh(mesh)


__all__ = ["STORAGES_SWAP_MEMORY", "all_gather_single", "reduce_scatter_single", "root_mesh"]
