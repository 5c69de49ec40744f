"""Weights tied across pipeline stages: which they are, and keeping every stage's copy equal.

[Note: weights tied across stages]
A parameter registered under names of modules on different stages (a GPT's embedding, on the first stage, tied to
its head, on the last) is kept by every stage holding one of those names: the ``SkippedModule`` standing in for the
other stage's module holds it under its own names, so each stage's state dict and optimizer see the tied weight as
the unsplit model does (one parameter, all its names). Each holding stage shards it alike over its data-parallel
ranks; at set-up they take the first holder's values, and after each backward they sum what each stage added to its
gradient (an all-reduce over the holders of one data-parallel coordinate), so every holder takes the same optimizer
step and the copies stay equal. The gradient norm and a save count it on the first holder only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_shard.engine import collectives

if TYPE_CHECKING:
    from lightning_shard.engine.mesh import ShardMesh


class TiedWeightsError(ValueError):
    """Weights tied across pipeline stages in a configuration that cannot keep their copies equal."""


@dataclass(frozen=True)
class TiedParameter:
    """A parameter registered under several names (``names``, the root's registration order) of modules that
    different stages hold (``stages``, in order)."""

    names: tuple[str, ...]
    stages: tuple[int, ...]


def ties_across_stages(root: nn.Module, places: dict[str, int]) -> list[tuple[TiedParameter, nn.Parameter]]:
    """Each parameter of ``root`` registered under names of modules on different stages (``places``: the stage of
    each module holding parameters, by name), with the parameter."""

    def place(name: str) -> int:
        return next(stage for module, stage in places.items() if name.startswith(module + "."))

    names: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(name)
    ties = []
    for p, aliases in names.values():
        stages = sorted({place(a) for a in aliases})
        if len(stages) > 1:
            ties.append((TiedParameter(tuple(aliases), tuple(stages)), p))
    return ties


@dataclass
class TiedAcrossStages:
    """The ties of one stage's module, and once it is sharded, the shards this stage trains of them, each with the
    group of its holders at this rank's data-parallel coordinate."""

    ties: tuple[TiedParameter, ...] = ()
    bound: list[tuple[ProcessGroup, nn.Parameter]] = field(default_factory=list)

    def bind(self, sharded: dict[str, nn.Parameter], mesh: ShardMesh, offloaded: bool) -> None:
        """Once the stage is sharded (``sharded``: each name of its parameters -> the shard it trains): give each
        tied weight the first holding stage's values, and remember the shards to sum the gradients of. The groups
        this rank is in are owned by ``mesh`` (destroyed with it). Collective: every rank calls it. Raises
        ``TiedWeightsError`` on every rank, before any collective, for shards offloaded to CPU memory."""
        if self.ties and offloaded:
            raise TiedWeightsError(
                f"The weights {', '.join(' = '.join(t.names) for t in self.ties)} are tied across pipeline stages,"
                " which cpu_offload=True does not support yet: untie them or train without cpu_offload."
            )
        ranks = mesh.pipeline
        assert ranks is not None  # bound on a pipeline stage only
        for tie in self.ties:
            group: ProcessGroup | None = ranks.group
            if tie.stages != tuple(range(ranks.size)):
                group = mesh.new_groups(mesh.dims.tie_groups(tie.stages), mesh.shard_backend)
            if ranks.stage not in tie.stages:
                continue
            assert group is not None
            shard = next(sharded[name] for name in tie.names if name in sharded)
            with torch.no_grad():
                collectives.broadcast_from_rank0(shard.data, group)  # its first rank is the first holder's
            if ranks.stage != tie.stages[0]:
                ranks.held_earlier.add(id(shard))
            if shard.requires_grad:  # a frozen tied weight keeps its values without any gradient
                self.bound.append((group, shard))

    def gradients(self) -> list[Tensor | None]:
        """Copies of the bound shards' gradients, as a backward begins."""
        return [None if shard.grad is None else shard.grad.clone() for _, shard in self.bound]

    def sum_gradients(self, before: list[Tensor | None]) -> None:
        """Add to each bound shard's gradient what the other holding stages added to theirs since ``before``
        (``gradients()`` as the backward began), so every holder steps with the whole model's gradient."""
        for (group, shard), old in zip(self.bound, before):
            grad = shard.grad if shard.grad is not None else torch.zeros_like(shard)
            added = grad - old if old is not None else grad.clone()
            collectives.all_reduce_sum(added, group)
            if shard.grad is None:
                shard.grad = added
            else:  # in place: the engine may hold the gradient tensor
                shard.grad.copy_(added if old is None else old + added)
