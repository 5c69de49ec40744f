"""Package attributes imported when first read (PEP 562), so that importing a package costs only what it runs.

    if TYPE_CHECKING:  # what type checkers and readers see
        from lightning_shard.trainer.strategy import ShardStrategy
    else:
        __getattr__, __dir__ = lazy_attributes(__name__, {"ShardStrategy": "lightning_shard.trainer.strategy"})

``import lightning_shard`` then imports neither torch nor Lightning; ``lightning_shard.ShardStrategy`` (or
``from lightning_shard import ShardStrategy``) imports its module on first use and keeps the class in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, attributes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, serving each name of ``attributes`` (name -> the module
    that defines it) from its module, imported the first time the name is read."""

    def __getattr__(name: str) -> Any:
        module = attributes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # read once: later reads find it without this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(attributes))

    return __getattr__, __dir__
