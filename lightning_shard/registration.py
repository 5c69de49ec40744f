"""The names under which both front ends' ``ShardStrategy`` is registered (``strategy="shard"`` and friends), and
how ``import lightning_shard`` registers them without importing Lightning.

[Note: registering without importing Lightning]
``import lightning_shard`` must stay cheap (the command line's ``--help`` imports it), so it cannot import Lightning
to reach its two strategy registries. Instead, ``register_on_import()`` registers the names in each registry as
soon as the module that holds it (``lightning.pytorch.strategies``, ``lightning.fabric.strategies``) exists: at once
when Lightning is imported already, else right after Lightning imports that module. The registered callable
imports the strategy class when a ``Trainer`` or ``Fabric`` asks for the name, so registering imports nothing.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from lightning_shard.common.registry import register_shard_strategies


def trainer_shard_strategy(**init_kwargs: Any) -> Any:
    """The Trainer's ``ShardStrategy`` built from ``init_kwargs``: what ``Trainer(strategy="shard")`` calls."""
    from lightning_shard.trainer.strategy import ShardStrategy

    return ShardStrategy(**init_kwargs)


def fabric_shard_strategy(**init_kwargs: Any) -> Any:
    """Fabric's ``ShardStrategy`` built from ``init_kwargs``: what ``Fabric(strategy="shard")`` calls."""
    from lightning_shard.fabric.strategy import ShardStrategy

    return ShardStrategy(**init_kwargs)


# The module holding each registry, the registry's name in it, and what the names build.
_REGISTRIES: dict[str, tuple[str, Callable[..., Any]]] = {
    "lightning.pytorch.strategies": ("StrategyRegistry", trainer_shard_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", fabric_shard_strategy),
}


def register_on_import() -> None:
    """Register the names in both of Lightning's strategy registries, now or once Lightning imports them. See
    [Note: registering without importing Lightning]."""
    waiting = {}
    for module_name, (registry_name, build) in _REGISTRIES.items():
        module = sys.modules.get(module_name)
        if module is not None:
            register_shard_strategies(getattr(module, registry_name), build)
        else:
            waiting[module_name] = _registrar(registry_name, build)
    if waiting and not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(waiting))


def _registrar(registry_name: str, build: Callable[..., Any]) -> Callable[[ModuleType], None]:
    def register(module: ModuleType) -> None:
        register_shard_strategies(getattr(module, registry_name), build)

    return register


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callbacks[name](module)`` once the module ``name`` has run, then leaves ``sys.meta_path`` after the
    last. It finds nothing itself: it asks the finders after it and wraps the loader of the spec they return."""

    def __init__(self, callbacks: dict[str, Callable[[ModuleType], None]]) -> None:
        self._callbacks = callbacks

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self._callbacks:
            return None
        spec = _spec_from_other_finders(self, fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # nothing to wrap: the module imports as it would have, unregistered
        spec.loader = _RunAfter(spec.loader, self._callbacks.pop(fullname))
        if not self._callbacks and self in sys.meta_path:
            sys.meta_path.remove(self)
        return spec


class _RunAfter(importlib.abc.Loader):
    """``loader`` executing the module, then ``callback(module)``. The module gets ``loader`` back as its own."""

    def __init__(self, loader: Any, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._callback(module)


def _spec_from_other_finders(
    finder: importlib.abc.MetaPathFinder, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    for other in sys.meta_path:
        find_spec = getattr(other, "find_spec", None)
        if other is finder or find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec  # type: ignore[no-any-return]
    return None
