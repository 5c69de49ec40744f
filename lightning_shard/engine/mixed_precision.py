"""Mixed precision the sharded way: which dtype weights are gathered and computed in, and gradients reduced in.

The shards the optimizer updates stay in the parameters' own dtype (fp32 master weights); a unit's
all-gather sends them cast to ``param_dtype`` (half the bytes for bf16/fp16), modules compute in
that dtype, and gradients are reduce-scattered in ``reduce_dtype`` and handed to the optimizer in
the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """A dtype, or its name as written in YAML (``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"``)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {value!r}. Use one of: {', '.join(sorted(_DTYPES))}.")
    return _DTYPES[name]


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for sharded mixed precision; set on ``ShardStrategy(mixed_precision=...)``.

    Args:
        param_dtype: dtype the weights are gathered and computed in (``None``: the parameters' own dtype).
        reduce_dtype: dtype gradients are reduce-scattered in (``None``: the parameters' own dtype, fp32 for
            fp32 master weights).
        buffer_dtype: dtype buffers are cast to at setup (``None``: unchanged).
        output_dtype: dtype floating outputs of the root module are cast to (``None``: unchanged).
        cast_forward_inputs: cast floating inputs of the root module to ``param_dtype``; needed when computing in
            ``param_dtype`` without autocast.
        keep_fp32: module classes or class names whose parameters are gathered and used in their own dtype
            (e.g. ``("LayerNorm",)``).
    """

    # A dtype name such as "bfloat16" is accepted too (YAML), and turned into the dtype.
    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    buffer_dtype: torch.dtype | str | None = None
    output_dtype: torch.dtype | str | None = None
    cast_forward_inputs: bool = False
    keep_fp32: tuple[type[nn.Module] | str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            object.__setattr__(self, name, parse_dtype(getattr(self, name)))
        object.__setattr__(self, "keep_fp32", tuple(self.keep_fp32))

    def keeps_fp32(self, module: nn.Module) -> bool:
        cls = type(module)
        return any(k is cls or k == cls.__name__ or k == cls.__qualname__ for k in self.keep_fp32)

    def compute_dtype(self, owners: Iterable[nn.Module]) -> torch.dtype | None:
        """The dtype a parameter held by ``owners`` is gathered in (``None``: its own)."""
        if self.param_dtype is None or any(self.keeps_fp32(m) for m in owners):
            return None
        return parse_dtype(self.param_dtype)


# [Note: normalization inputs on CPU]
# A unit computes with its weights cast to ``param_dtype``, under autocast. CUDA's autocast runs layer and group
# norms in fp32 whatever their inputs and weights; CPU's leaves them alone, and their CPU kernels refuse an fp32 input
# with bf16 weights ("mixed dtype (CPU): expect parameter to have scalar type of Float"). Such an input is common: a
# residual sum with an fp32 tensor (``nn.Transformer`` behind a positional encoding kept in fp32, as in Lightning's
# demo Transformer) promotes to fp32. So on CPU a normalization layer whose weights are cast gets its floating inputs
# cast to the same dtype, as FSDP's ``cast_forward_inputs`` casts a unit's inputs; inputs already in that dtype (the
# usual case) pass unchanged.
NORMALIZATION_LAYERS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase
)


def cast_normalization_inputs(modules: Iterable[nn.Module]) -> None:
    """Give each normalization layer among ``modules`` (those whose weights are cast) its floating inputs in the
    dtype its weight has when it runs: the compute dtype, or the master dtype inside ``summon_full_params`` (see
    [Note: normalization inputs on CPU])."""
    done: set[int] = set()
    for module in modules:
        if isinstance(module, NORMALIZATION_LAYERS) and id(module) not in done:
            done.add(id(module))
            module.register_forward_pre_hook(_inputs_in_the_weights_dtype)


def _inputs_in_the_weights_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        return args
    dtype = weight.dtype
    return tuple(
        a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != dtype else a for a in args
    )


SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def check_precision(precision: str) -> None:
    """Raise ``ValueError`` naming the supported Trainer precision strings unless ``precision`` is one of them."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"ShardStrategy does not support precision={precision!r}. Choose one of: {', '.join(SUPPORTED_PRECISIONS)}."
        )


def true_dtype_for(precision: str) -> torch.dtype | None:
    """The dtype a ``"*-true"`` precision stores parameters in (``None``: the parameters' own dtype)."""
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)


def mixed_precision_for(precision: str) -> MixedPrecision | None:
    """What a Trainer precision string implies for the shards (``None``: nothing to cast)."""
    match precision:
        case "bf16-mixed":
            return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        case "16-mixed":
            return MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        case _:
            return None


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` (nested containers) with every floating-point tensor cast to ``dtype``."""
    flat, spec = tree_flatten(tree)
    return tree_unflatten([t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in flat], spec)


def cast_floating_outputs(dtype: torch.dtype):  # noqa: ANN201
    """A forward hook that casts a module's floating-point outputs to ``dtype``."""

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return cast_floating(output, dtype)

    return hook
