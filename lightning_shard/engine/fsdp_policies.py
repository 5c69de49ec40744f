"""PyTorch FSDP's own wrap policies as ``auto_wrap_policy``: the units are the modules FSDP would have wrapped.

Code written for ``torch.distributed.fsdp`` or Lightning's ``FSDPStrategy`` passes one of:

- a policy object: ``ModuleWrapPolicy({Block})`` (every module that is an instance of one of the classes,
  subclasses included) or ``CustomPolicy(fn)``;
- an FSDP policy function ``(module, recurse, nonwrapped_numel) -> bool``: ``always_wrap_policy``,
  ``functools.partial(size_based_auto_wrap_policy, min_num_params=n)``,
  ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``,
  ``functools.partial(lambda_auto_wrap_policy, lambda_fn=fn)``, or one's own with those parameter names.

``FSDPWrapPolicy`` keeps the object as it was given and chooses the modules FSDP would wrap with it, by the same
rules (see [Note: FSDP's wrap decisions, replayed]). A ``CustomPolicy`` that gives a module FSDP keyword arguments
of its own is refused: every unit runs with the strategy's settings.

[Note: FSDP's wrap decisions, replayed]
FSDP asks a policy function twice per module, walking the tree depth first from the root: on the way down
``policy(module=m, recurse=True, nonwrapped_numel=n)``, with ``n`` all of ``m``'s parameters, says whether to
look inside ``m`` at all; on the way up ``policy(module=m, recurse=False, nonwrapped_numel=r)``, with ``r`` what
the units chosen inside ``m`` left over, says whether ``m`` becomes a unit. The root is a unit whatever the
policy says and is only asked the first question. ``_visit`` asks the same questions with the
same counts, so a size threshold, ``force_leaf_modules`` and ``exclude_wrap_modules`` decide exactly as under
FSDP. A policy object answers through its own ``_run_policy``, as FSDP calls it. Modules marked as units by
hand count as chosen (their parameters are taken) and are looked inside all the same.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from torch import nn

FSDPPolicyFunction = Callable[..., bool]  # called as fn(module=..., recurse=..., nonwrapped_numel=...)


@dataclass(frozen=True)
class FSDPWrapPolicy:
    """A PyTorch FSDP wrap policy (a ``_Policy`` object or a policy function), kept as given."""

    policy: Any

    def targets(self, root: nn.Module, taken: Collection[nn.Module] = ()) -> set[int]:
        """The ids of the modules below ``root`` that FSDP would wrap (the root excluded)."""
        from torch.distributed.fsdp.wrap import _Policy

        if isinstance(self.policy, _Policy):
            return _targets_of_policy_object(self.policy, root)
        chosen: set[int] = set()
        _visit(root, self.policy, chosen, {id(m) for m in taken}, is_root=True)
        return chosen


def is_fsdp_policy(spec: object) -> bool:
    """Whether ``spec`` is one of PyTorch FSDP's wrap-policy forms (see the module docstring): a ``_Policy`` object,
    ``always_wrap_policy``, or a callable that names FSDP's ``recurse`` or ``nonwrapped_numel`` parameter."""
    from torch.distributed.fsdp.wrap import _Policy, always_wrap_policy

    if isinstance(spec, _Policy):
        return True
    if not callable(spec):
        return False
    if getattr(spec, "func", spec) is always_wrap_policy:  # (*args, **kwargs): its signature names nothing
        return True
    try:
        parameters = inspect.signature(spec).parameters
    except (TypeError, ValueError):  # a builtin without a signature: not FSDP's form
        return False
    return "recurse" in parameters or "nonwrapped_numel" in parameters


def _visit(module: nn.Module, policy: FSDPPolicyFunction, chosen: set[int], taken: set[int], is_root: bool) -> int:
    """How many of ``module``'s parameters are in units at or below it, deciding as FSDP's recursive wrap does."""
    nonwrapped_numel = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return nonwrapped_numel if id(module) in taken else 0
    wrapped_below = sum(_visit(child, policy, chosen, taken, is_root=False) for child in module.children())
    if is_root:
        return wrapped_below
    if id(module) in taken:
        return nonwrapped_numel
    if policy(module=module, recurse=False, nonwrapped_numel=nonwrapped_numel - wrapped_below):
        chosen.add(id(module))
        return nonwrapped_numel
    return wrapped_below


def _targets_of_policy_object(policy: Any, root: nn.Module) -> set[int]:
    targets = policy._run_policy(root, set(), {})  # as FSDP applies a _Policy: module -> its FSDP kwargs
    overridden = [(type(m).__name__, kwargs) for m, kwargs in targets.items() if kwargs]
    if overridden:
        shown = "; ".join(f"{name}: {sorted(kwargs)}" for name, kwargs in overridden)
        raise ValueError(
            f"auto_wrap_policy ({type(policy).__name__}) gives modules FSDP settings of their own ({shown}), which"
            " ShardStrategy cannot apply: every unit runs with the strategy's arguments. Make the policy return"
            " True or False only, and set these on ShardStrategy."
        )
    return {id(m) for m in targets if m is not root}
