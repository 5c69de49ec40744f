"""User-facing wrap policies: which modules become sharding units (the sharding strategy and the other named
choices are in ``option_choices``).

Everything here is a small frozen value, resolved once when the strategy is built, so that a bad
value fails on every rank before any process group work starts.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from torch import nn

from lightning_shard.engine.diagnostics import warn_rank0
from lightning_shard.engine.fsdp_policies import FSDPWrapPolicy, is_fsdp_policy


@dataclass(frozen=True)
class ModuleClassWrapPolicy:
    """Every module whose class is one of ``classes`` (a class, or a class name such as ``"GPT2Block"``)."""

    classes: frozenset[type[nn.Module] | str]

    def __call__(self, module: nn.Module, name: str) -> bool:
        cls = type(module)
        return cls in self.classes or cls.__name__ in self.classes or cls.__qualname__ in self.classes

    def check_matches(self, root: nn.Module) -> None:
        """Raise ``ValueError`` for any class or name that matches no module of ``root``."""
        present = {type(m) for m in root.modules()}
        names = {c.__name__ for c in present} | {c.__qualname__ for c in present}
        missing = [c for c in self.classes if (c not in present if isinstance(c, type) else c not in names)]
        if missing:
            shown = ", ".join(sorted(_class_label(c) for c in missing))
            available = ", ".join(sorted({c.__name__ for c in present}))
            raise ValueError(
                f"auto_wrap_policy names {shown}, but no module of the model has that class."
                f" Module classes present: {available}."
            )


@dataclass(frozen=True)
class CallableWrapPolicy:
    """Every module for which ``fn(module, qualified_name)`` returns True."""

    fn: Callable[[nn.Module, str], bool]

    def __call__(self, module: nn.Module, name: str) -> bool:
        return bool(self.fn(module, name))


@dataclass(frozen=True)
class SizeWrapPolicy:
    """Bottom-up: a module becomes a unit once the parameters it holds outside nested units reach ``min_num_params``."""

    min_num_params: int

    def __post_init__(self) -> None:
        if self.min_num_params < 1:
            raise ValueError(f"auto_wrap_policy as a parameter count must be >= 1, got {self.min_num_params}.")


WrapPolicy = ModuleClassWrapPolicy | CallableWrapPolicy | SizeWrapPolicy | FSDPWrapPolicy
WrapPolicySpec = (
    list[str]
    | set[str]
    | set[type[nn.Module]]
    | list[type[nn.Module]]
    | str
    | type[nn.Module]
    | int
    | Callable[[nn.Module, str], bool]
    | WrapPolicy
    | None
)


def resolve_wrap_policy(spec: WrapPolicySpec, argument: str = "auto_wrap_policy") -> WrapPolicy | None:
    """Turn what a user passed as ``auto_wrap_policy`` (or ``argument``, e.g. ``activation_checkpointing_policy``)
    into a policy object (``None``: the root is the only unit); a bad value raises naming ``argument``.

    PyTorch FSDP's own policies (``ModuleWrapPolicy``, ``CustomPolicy``, ``always_wrap_policy`` and the
    ``functools.partial`` forms of ``size_based_auto_wrap_policy``, ``transformer_auto_wrap_policy``,
    ``lambda_auto_wrap_policy``) select what FSDP would wrap: see ``lightning_shard.engine.fsdp_policies``."""
    if spec is None or isinstance(spec, (ModuleClassWrapPolicy, CallableWrapPolicy, SizeWrapPolicy, FSDPWrapPolicy)):
        return spec
    if isinstance(spec, bool):
        raise TypeError(f"{argument} must be module classes, class names, a callable or an int, not a bool.")
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"{argument} as a parameter count must be >= 1, got {spec}.")
        return SizeWrapPolicy(spec)
    if isinstance(spec, (str, type)):
        return ModuleClassWrapPolicy(frozenset([spec]))
    if is_fsdp_policy(spec):
        return FSDPWrapPolicy(spec)
    if callable(spec):
        _check_takes_module_and_name(spec, argument)
        return CallableWrapPolicy(spec)
    if isinstance(spec, Iterable):
        items = list(spec)
        bad = [x for x in items if not (isinstance(x, str) or (isinstance(x, type) and issubclass(x, nn.Module)))]
        if bad:
            raise TypeError(f"{argument} entries must be nn.Module classes or class names, got {bad!r}.")
        return ModuleClassWrapPolicy(frozenset(items))  # type: ignore[arg-type]  # checked just above
    raise TypeError(
        f"{argument} must be a set of module classes or class names, a callable (module, name) -> bool,"
        f" or an int minimum parameter count; got {type(spec).__name__}."
    )


def select_unit_modules(
    root: nn.Module, policy: WrapPolicy | None, taken: Collection[nn.Module] = ()
) -> list[tuple[str, nn.Module]]:
    """The modules below ``root`` that become sharding units, in module order (the root itself is always one).

    ``taken`` are units chosen otherwise (marked by hand): a size policy counts their parameters as claimed."""
    if policy is None:
        return []
    if isinstance(policy, FSDPWrapPolicy):
        return _units_among(root, policy.targets(root, taken))
    if isinstance(policy, ModuleClassWrapPolicy):
        policy.check_matches(root)
    if isinstance(policy, SizeWrapPolicy):
        return _select_by_size(root, policy.min_num_params, {id(m) for m in taken})
    selected = [(name, m) for name, m in root.named_modules() if m is not root and policy(m, name)]
    containers = sorted({type(m).__name__ for _, m in selected if not is_callable_module(m)})
    if containers:
        raise ValueError(
            f"auto_wrap_policy selects {', '.join(containers)}, which has no forward(): a unit is gathered when its"
            " forward runs, so a container would never be. Select the modules inside it instead."
        )
    return selected


def is_callable_module(module: nn.Module) -> bool:
    """Containers such as nn.ModuleList/nn.ModuleDict keep nn.Module's unimplemented forward."""
    return type(module).forward is not nn.Module.forward


# Modules that use their children's weights without calling the children (nn.MultiheadAttention reads
# out_proj.weight in its functional forward): a child of one made a unit would never be gathered, so the size
# policy counts their children as their own, as PyTorch's size-based wrap policy does.
READS_CHILDREN_WEIGHTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _select_by_size(root: nn.Module, min_num_params: int, taken: set[int]) -> list[tuple[str, nn.Module]]:
    selected: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, name: str) -> int:
        """Parameters under ``module`` not yet claimed by a selected descendant."""
        if isinstance(module, READS_CHILDREN_WEIGHTS):
            remaining = sum(p.numel() for p in module.parameters())
        else:
            remaining = sum(p.numel() for p in module.parameters(recurse=False))
            for child_name, child in module.named_children():
                remaining += visit(child, f"{name}.{child_name}" if name else child_name)
        if id(module) in taken:  # a unit already: its parameters are claimed
            return 0
        if module is not root and remaining >= min_num_params and is_callable_module(module):
            selected.append((name, module))
            return 0
        return remaining

    visit(root, "")
    order = {id(m): i for i, m in enumerate(root.modules())}
    return sorted(selected, key=lambda item: order[id(item[1])])


def _check_takes_module_and_name(fn: Callable[..., object], argument: str) -> None:
    """Refuse, when the strategy is built, a callable that cannot be called as ``fn(module, name)``."""
    import inspect

    try:
        inspect.signature(fn).bind(nn.Module(), "")
    except TypeError as err:
        raise TypeError(
            f"{argument} as a callable is called as fn(module, name) -> bool (or is one of PyTorch FSDP's policies,"
            f" whose parameters are (module, recurse, nonwrapped_numel)); {fn!r} cannot be: {err}."
        ) from None
    except ValueError:  # no signature to inspect (a builtin): it is called as it is
        pass


def _units_among(root: nn.Module, chosen: set[int]) -> list[tuple[str, nn.Module]]:
    """The chosen modules that can be units, in module order. A PyTorch FSDP policy may choose a container (FSDP
    wraps it; it owns nothing once its children are units) or a submodule ``READS_CHILDREN_WEIGHTS`` modules read
    without calling; neither would ever be gathered, so their parameters stay with the unit around them."""
    readers = [m for m in root.modules() if isinstance(m, READS_CHILDREN_WEIGHTS)]
    unreadable = {id(inner) for m in readers for inner in m.modules() if inner is not m}
    units = [
        (name, m)
        for name, m in root.named_modules()
        if id(m) in chosen and is_callable_module(m) and id(m) not in unreadable
    ]
    kept = {id(m) for _, m in units}
    dropped = [name for name, m in root.named_modules() if id(m) in chosen and id(m) not in kept and m is not root]
    owning = [name for name in dropped if _owns_parameters_outside(root.get_submodule(name), kept)]
    if owning:
        warn_rank0(
            f"auto_wrap_policy chose {', '.join(owning)}, which cannot be a unit here (a container without forward(),"
            " or a submodule that nn.MultiheadAttention reads without calling it: it would never be gathered). Their"
            " parameters stay with the unit around them. Choose the modules inside a container, or the"
            " MultiheadAttention itself, to make them units."
        )
    return units


def _owns_parameters_outside(module: nn.Module, units: set[int]) -> bool:
    """Whether ``module`` holds parameters that none of the ``units`` below it owns."""
    stack = [module]
    while stack:
        current = stack.pop()
        if current is not module and id(current) in units:
            continue
        if any(True for _ in current.parameters(recurse=False)):
            return True
        stack.extend(current.children())
    return False


def _class_label(c: type | str) -> str:
    return c if isinstance(c, str) else c.__name__
