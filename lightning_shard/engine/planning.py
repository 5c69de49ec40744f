"""Which modules become units and which unit owns each parameter: the plan ``shard_module`` follows.

[Note: which unit owns a parameter]
A parameter belongs to the innermost unit whose subtree holds it. A parameter held in two
subtrees (tied weights: an embedding and the LM head; a module shared by two blocks) belongs to
the lowest unit that contains both: it is stored once, gathered whenever that unit is, and its
gradient from every use accumulates on one unsharded face before the single reduction. That
unit's forward encloses every use, so the weight is gathered wherever it is needed.

The units are the root, the modules ``auto_wrap_policy`` selects and the modules marked by hand (see
[Note: manual units] in ``wrapping``), each once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from lightning_shard.engine.activation_checkpointing import refuse_units_inside_checkpoint_wrappers
from lightning_shard.engine.policies import WrapPolicy, select_unit_modules
from lightning_shard.engine.wrapping import marked_units


def plan_units(
    root: nn.Module, policy: WrapPolicy | None
) -> list[tuple[str, nn.Module, list[tuple[_ParamUse, nn.Parameter]]]]:
    """The units in module order (root first), each with the parameters it owns.

    See [Note: which unit owns a parameter].
    """
    unit_modules = [("", root), *unit_modules_below(root, policy)]
    refuse_units_inside_checkpoint_wrappers(root, unit_modules)
    unit_ids = {id(m) for _, m in unit_modules}
    uses, params_by_id = _collect_parameters(root, unit_ids)
    parent_unit = _unit_parents(root, unit_ids)
    owned: dict[int, list[tuple[_ParamUse, nn.Parameter]]] = {id(m): [] for _, m in unit_modules}
    for pid, use in uses.items():
        owned[_lowest_common_unit(sorted(use.unit_ids), parent_unit)].append((use, params_by_id[pid]))
    return [(name, module, owned[id(module)]) for name, module in unit_modules]


def unit_modules_below(root: nn.Module, policy: WrapPolicy | None) -> list[tuple[str, nn.Module]]:
    """The units below the root, in module order: the modules marked by hand and those ``policy`` selects."""
    marked = marked_units(root)
    chosen = {id(m) for _, m in marked} | {id(m) for _, m in select_unit_modules(root, policy, [m for _, m in marked])}
    return [(name, m) for name, m in root.named_modules() if m is not root and id(m) in chosen]


def _collect_parameters(root: nn.Module, unit_ids: set[int]) -> tuple[dict[int, _ParamUse], dict[int, nn.Parameter]]:
    """For every parameter: the units whose subtrees hold it and each (module, attribute, name) holding it.

    Walks without de-duplication, so a module or parameter reachable by two paths is seen in both
    units' subtrees (see [Note: which unit owns a parameter]).
    """
    uses: dict[int, _ParamUse] = {}
    params: dict[int, nn.Parameter] = {}
    # An explicit stack, not a recursive closure: a closure that refers to itself is a reference cycle, which
    # would keep ``params`` (every original full-size parameter) alive until Python's cycle collector runs.
    stack: list[tuple[nn.Module, str, int, tuple[int, ...]]] = [(root, "", id(root), (id(root),))]
    while stack:
        module, prefix, unit_id, path = stack.pop()
        if id(module) in unit_ids:
            unit_id = id(module)
        for name, p in module._parameters.items():
            if p is None:
                continue
            params[id(p)] = p
            use = uses.setdefault(id(p), _ParamUse())
            use.unit_ids.add(unit_id)
            if prefix + name not in use.fqns:
                use.fqns.append(prefix + name)
            if not any(m is module and n == name for m, n in use.owners):
                use.owners.append((module, name))
        children = [(n, c) for n, c in module._modules.items() if c is not None and id(c) not in path]
        for child_name, child in reversed(children):  # popped in registration order, as a recursive walk would
            stack.append((child, f"{prefix}{child_name}.", unit_id, (*path, id(child))))
    return uses, params


@dataclass
class _ParamUse:
    fqns: list[str] = field(default_factory=list)
    unit_ids: set[int] = field(default_factory=set)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def _unit_parents(root: nn.Module, unit_ids: set[int]) -> dict[int, int | None]:
    """Parent unit of each unit (by module id); the root's is None."""
    parents: dict[int, int | None] = {id(root): None}

    def visit(module: nn.Module, enclosing: int) -> None:
        for child in module.children():
            if id(child) in unit_ids and id(child) not in parents:
                parents[id(child)] = enclosing
                visit(child, id(child))
            else:
                visit(child, enclosing)

    visit(root, id(root))
    return parents


def _lowest_common_unit(unit_ids: list[int], parents: dict[int, int | None]) -> int:
    def chain(u: int) -> list[int]:
        out = [u]
        while (p := parents.get(out[-1])) is not None:
            out.append(p)
        return out

    common = chain(unit_ids[0])
    for u in unit_ids[1:]:
        ancestors = set(chain(u))
        common = [c for c in common if c in ancestors]
    return common[0]


def initializer(module: nn.Module) -> Callable[[], None] | None:
    """What initialises ``module``'s own parameters: its ``reset_parameters()``, or for ``nn.MultiheadAttention``,
    which only has a private one, ``_reset_parameters()``; ``None`` when it has none (e.g. transformers'
    ``Conv1D``)."""
    method = getattr(module, "reset_parameters", None)
    if method is None and isinstance(module, nn.MultiheadAttention):
        method = getattr(module, "_reset_parameters", None)
    return method if callable(method) else None


def without_reset_parameters(module: nn.Module) -> bool:
    """Whether ``module`` cannot initialise its own parameters (see ``initializer``): its meta-device parameters
    stay uninitialised until weights are loaded."""
    return initializer(module) is None
