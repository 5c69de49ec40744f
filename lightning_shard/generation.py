"""``generate``: autoregressive sampling from a language model whose weights stay sharded, one token per forward.

    tokens = generate(model, prompt, max_new_tokens=50, temperature=0.8, top_k=40, generator=generator)

It takes the sharded model (the ``LightningModule`` under ``ShardStrategy``, Fabric's set-up module, the model
given to ``shard_model``), a submodule of it (the network a ``LightningModule`` holds), or a plain model. Every rank
of a sharded model calls it, each with its own prompt, length and stopping token; each forward gathers the units
just in time and frees them after, as in training, so a model that does not fit whole on one device generates too.
Without a key/value cache: every step runs the whole (cropped) context, as nanoGPT's ``generate`` does.

[Note: generation in step]
On a sharded model every forward gathers each unit's weights with collectives over its shard group, so every rank
must run the same number of forwards. Ranks generate different lengths (their own ``max_new_tokens``, or an
``eos_token_id`` one rank reaches first): a rank that simply stopped would leave the others waiting in an
all-gather it never joins, or pair their next all-gather with whatever collective it runs next. So before each
step every rank says whether it still has tokens to generate and all ranks take the maximum (one all-reduce of one
number over the default process group). While any rank is running, every rank runs a forward; a rank that has
finished runs it on a one-token input (the last token of its first row) and discards the logits. When the
maximum is 0 every rank leaves the loop at the same step.

The sharded model itself (it holds the engine) is known to be collective before its first forward: the ranks go in
step from the start, and agree on the arguments the same way first, so that a rank whose arguments are refused
raises its own error and the other ranks raise too instead of waiting in a forward. Inside ``summon_full_params``
it holds its full weights and communicates nothing, so each rank goes on alone: ranks may generate different
lengths, and with ``summon_full_params(model, rank0_only=True)`` rank 0 may generate alone. For any other module (a
submodule of a sharded model, or a plain model) the first forward tells: every rank runs it (a rank with nothing to
generate, on the one-token input), and if it entered any of the engine's collectives (``RECORD`` counts them, the
same count on every rank) the ranks go on in step; if not (a plain model, a submodule inside
``summon_full_params``, a model with nothing to gather), each rank goes on alone.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_shard.engine import collectives
from lightning_shard.engine.full_params import _SUMMONED  # engines inside summon_full_params, on every rank
from lightning_shard.engine.progress import RECORD
from lightning_shard.engine.sharded_module import ShardedModule, sharded_module_of
from lightning_shard.engine.unit import UnitState

_DECLARED_CONTEXT = ("block_size",)  # on the model: nanoGPT-style models
_CONFIG_CONTEXT = ("block_size", "n_positions", "max_position_embeddings")  # on model.config: nanoGPT, HF


class Decoding(enum.Enum):
    """How the next token is chosen from the last position's logits."""

    GREEDY = enum.auto()  # the most likely token (argmax)
    SAMPLE = enum.auto()  # drawn from softmax(logits / temperature), optionally among the top_k only


class Pace(enum.Enum):
    """Whether the ranks must run their forwards together (see [Note: generation in step])."""

    UNDECIDED = enum.auto()  # not known before the first forward: decided by whether it entered a collective
    IN_STEP = enum.auto()  # a sharded model: each forward is collective, so every rank joins every step
    ALONE = enum.auto()  # full weights (a plain model, or inside summon_full_params): no collective in forward


@dataclass(frozen=True)
class _Settings:
    decoding: Decoding
    temperature: float
    top_k: int | None
    eos: tuple[int, ...]  # empty: no stopping token
    context_length: int | None  # None: the whole sequence goes to the model


def generate(
    model: nn.Module,
    input_ids: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    do_sample: bool | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    context_length: int | None = None,
) -> Tensor:
    """Append up to ``max_new_tokens`` tokens to each row of ``input_ids`` and return ``(B, T + n)`` token ids,
    the prompt first; ``n`` is ``max_new_tokens``, or fewer when every row has produced ``eos_token_id``.

    Collective on a sharded model (or a submodule of one): every rank calls it (with its own prompt,
    ``max_new_tokens`` and ``eos_token_id``), and ranks that finish first keep joining the others' forwards until all
    have finished (see [Note: generation in step]). On a plain model, or inside ``summon_full_params``, it
    communicates nothing. Runs under ``torch.no_grad()`` with the model in eval mode; every module's mode is
    restored afterwards.

    Args:
        model: the sharded model (the ``LightningModule`` given to ``ShardStrategy``, the module
            ``fabric.setup_module`` returned, the model given to ``shard_model``), a submodule of it whose forward
            gives the logits (``self.model`` inside a ``LightningModule``), or a plain model. It is called as
            ``model(input_ids=ids)`` when its ``forward`` takes ``input_ids`` (Hugging Face models;
            ``use_cache=False`` is passed too where accepted), else as ``model(ids)``. It returns the logits
            ``(B, T, V)`` (or ``(B, 1, V)``, the last position only), an output with ``.logits``, or a tuple whose
            first element is the logits (nanoGPT's ``(logits, loss)``).
        input_ids: ``(B, T)`` integer token ids on the device the model computes on.
        max_new_tokens: how many tokens to generate at most (0: return the prompt).
        temperature: the logits are divided by it before sampling; ``0`` means greedy decoding.
        top_k: sample among the ``top_k`` most likely tokens only (all of them when it exceeds the vocabulary).
        do_sample: ``False`` decodes greedily, ``True`` samples; ``None`` (the default) samples unless
            ``temperature`` is 0. Contradictory settings (``do_sample=True`` with ``temperature=0``,
            ``do_sample=False`` with another temperature or a ``top_k``) are refused.
        eos_token_id: a token id (or several) that ends a row. A row that produced one gets ``eos_token_id`` (the
            first, when several) at every later position, and the rank stops once every row has ended.
        generator: the random generator to sample with (the global one when ``None``). The probabilities are moved
            to its device to draw, so a CPU generator gives the same tokens whatever the model's device; with the
            same weights and seed the tokens are those a single process samples.
        context_length: the longest input the model takes; longer sequences are cropped to their last
            ``context_length`` tokens before each forward (the returned sequence keeps every token). When ``None``,
            read from the model if it declares one (``model.block_size``; ``model.config.block_size``,
            ``n_positions`` or ``max_position_embeddings``), else the whole sequence is passed.
    """
    engine = sharded_module_of(model)
    pace = _pace_known_before(engine)
    refusal: Exception | None = None
    try:
        settings = _parse(
            model, input_ids, max_new_tokens, temperature, top_k, do_sample, eos_token_id, generator, context_length,
            engine if pace is Pace.IN_STEP else None,
        )
    except (TypeError, ValueError) as error:
        refusal = error
    if engine is not None and pace is Pace.IN_STEP:
        _agree_on_arguments(refusal, engine.device)
    if refusal is not None:
        raise refusal
    call = _forward_call(model)
    with torch.no_grad(), _eval_mode(model):
        return _generate(call, input_ids, max_new_tokens, settings, generator, pace)


# Runtime #


def _generate(
    call: Callable[[Tensor], Any],
    input_ids: Tensor,
    max_new_tokens: int,
    settings: _Settings,
    generator: torch.Generator | None,
    pace: Pace,
) -> Tensor:
    """The decoding loop: one forward per step, every rank in step with the others while ``pace`` is ``IN_STEP``
    (see [Note: generation in step])."""
    ids = input_ids
    batch = ids.shape[0]
    ended = torch.zeros(batch, dtype=torch.bool, device=ids.device)  # rows that produced an eos token
    eos = torch.tensor(settings.eos, dtype=ids.dtype, device=ids.device)
    produced = 0
    while True:
        running = produced < max_new_tokens and not bool(ended.all())
        if pace is Pace.IN_STEP:
            if not _on_any_rank(running, ids.device):
                break
        elif pace is Pace.ALONE and not running:
            break
        entered = RECORD.index  # collectives this process has entered so far
        if running:
            logits = _last_logits(call(_crop(ids, settings.context_length)), batch)  # (B, V)
            next_ids = _choose(logits, settings, generator).to(ids.dtype)  # (B, 1)
            if settings.eos:
                next_ids = next_ids.masked_fill(ended.unsqueeze(1), settings.eos[0])
                ended |= torch.isin(next_ids.squeeze(1), eos)
            ids = torch.cat([ids, next_ids], dim=1)
            produced += 1
        else:  # finished here but not (known to be) everywhere: join the forward, discard its logits
            call(ids[:1, -1:])
        if pace is Pace.UNDECIDED:
            pace = Pace.IN_STEP if RECORD.index > entered else Pace.ALONE
    return ids


def _crop(ids: Tensor, context_length: int | None) -> Tensor:
    return ids if context_length is None or ids.shape[1] <= context_length else ids[:, -context_length:]


def _choose(logits: Tensor, settings: _Settings, generator: torch.Generator | None) -> Tensor:
    """The next token of each row, ``(B, 1)``, from the last position's logits ``(B, V)`` (computed in fp32)."""
    logits = logits.float()
    if settings.decoding is Decoding.GREEDY:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / settings.temperature
    if settings.top_k is not None and settings.top_k < logits.shape[-1]:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if generator is not None:
        probs = probs.to(generator.device)  # multinomial draws on the generator's device
    return torch.multinomial(probs, num_samples=1, generator=generator).to(logits.device)


def _last_logits(output: Any, batch: int) -> Tensor:
    """The last position's logits ``(B, V)`` from what the model returned; a clear error when it is not logits."""
    logits = output
    if not isinstance(logits, Tensor):
        logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, Tensor) or logits.ndim != 3 or logits.shape[0] != batch:
        got = f"shape {tuple(logits.shape)}" if isinstance(logits, Tensor) else type(output).__name__
        raise TypeError(
            f"generate() needs the model to return logits of shape (B, T, V) with B = {batch}: a tensor, an output"
            f" with .logits, or a tuple whose first element is the logits; got {got}. Pass a module whose forward"
            " returns the logits (e.g. a small wrapper around your model)."
        )
    return logits[:, -1, :]


def _on_any_rank(holds: bool, device: torch.device) -> bool:
    """Whether ``holds`` is true on any rank: the MAX over all ranks of this rank's flag (one all-reduce)."""
    flag = torch.tensor([int(holds)], device=device)
    collectives.all_reduce_max(flag, None)
    return bool(flag.item())


def _agree_on_arguments(refusal: Exception | None, device: torch.device) -> None:
    """Raise on every rank if any rank's arguments were refused, before any forward (see [Note: generation in
    step]); the refused rank raises its own error afterwards."""
    if _on_any_rank(refusal is not None, device) and refusal is None:
        raise RuntimeError(
            "generate() was refused on another rank (its error says why), so it stops on this rank too instead of"
            " waiting for that rank's forwards. Fix the arguments there: every rank calls generate() with valid"
            " arguments."
        )


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode; every module's own mode back afterwards (a frozen submodule may have been in eval)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _forward_call(model: nn.Module) -> Callable[[Tensor], Any]:
    """How to call ``model`` on token ids: by keyword ``input_ids`` when its forward names it (Hugging Face, which
    also gets ``use_cache=False``: every step reruns the whole context, so a cache would only cost memory)."""
    inner = getattr(model, "_forward_module", model)  # Fabric's set-up module passes its arguments through
    try:
        parameters = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):  # no signature to read: call positionally
        parameters = {}  # type: ignore[assignment]
    if "input_ids" not in parameters:
        return lambda ids: model(ids)
    extra = {"use_cache": False} if "use_cache" in parameters else {}
    return lambda ids: model(input_ids=ids, **extra)


def _pace_known_before(engine: ShardedModule | None) -> Pace:
    """What the model tells before any forward: ``IN_STEP`` for a sharded model (``engine``), ``ALONE`` for one
    holding its full weights, ``UNDECIDED`` for any other (a plain model, a submodule of a sharded one). Refused on
    a rank that holds only its shards inside ``summon_full_params(rank0_only=True)``, before any collective."""
    if engine is None:
        return Pace.UNDECIDED
    if engine.root_unit.state is UnitState.SUMMONED:
        return Pace.ALONE
    if id(engine) in _SUMMONED:  # the block is open, but this rank did not get the full weights
        raise RuntimeError(
            f"Rank {engine.mesh.rank} called generate() inside summon_full_params(rank0_only=True): only global rank"
            " 0 holds the full weights there, and rank 0 generates alone, without the collectives this rank's"
            " forwards would wait for. Call generate() on rank 0 only inside the block (e.g. under"
            " `if trainer.is_global_zero:`), or use rank0_only=False."
        )
    return Pace.IN_STEP


# Checks #


def _parse(
    model: nn.Module,
    input_ids: Any,
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    do_sample: Any,
    eos_token_id: Any,
    generator: Any,
    context_length: Any,
    engine: ShardedModule | None,
) -> _Settings:
    """The settings of one call; ``TypeError``/``ValueError`` naming the argument that is wrong."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"generate(model=...) must be an nn.Module, got {type(model).__name__}.")
    _check_input_ids(input_ids, engine)
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"generate(max_new_tokens=...) must be an int >= 0, got {max_new_tokens!r}.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"generate(temperature=...) must be a number >= 0, got {temperature!r}.")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"generate(temperature=...) must be a finite number >= 0 (0: greedy), got {temperature!r}.")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"generate(top_k=...) must be an int >= 1 or None, got {top_k!r}.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generate(generator=...) must be a torch.Generator or None, got {type(generator).__name__}.")
    return _Settings(
        decoding=_decoding(do_sample, float(temperature), top_k),
        temperature=float(temperature),
        top_k=top_k,
        eos=_eos_ids(eos_token_id),
        context_length=_context_length(model, context_length),
    )


def _check_input_ids(input_ids: Any, engine: ShardedModule | None) -> None:
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"generate(input_ids=...) must be a tensor of token ids, got {type(input_ids).__name__}.")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"generate(input_ids=...) must hold integer token ids, got dtype {input_ids.dtype}.")
    if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        hint = " (add the batch dimension: input_ids[None])" if input_ids.ndim == 1 else ""
        raise ValueError(
            f"generate(input_ids=...) must have shape (B, T) with B, T >= 1, got {tuple(input_ids.shape)}{hint}."
        )
    if engine is not None and input_ids.device != engine.device:
        raise ValueError(
            f"generate(input_ids=...) is on {input_ids.device}, but the sharded model computes on {engine.device}:"
            f" move the prompt there (input_ids.to({str(engine.device)!r}))."
        )


def _decoding(do_sample: Any, temperature: float, top_k: int | None) -> Decoding:
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TypeError(f"generate(do_sample=...) must be True, False or None, got {do_sample!r}.")
    if do_sample is True and temperature == 0:
        raise ValueError(
            "generate(do_sample=True, temperature=0) contradicts itself: temperature 0 means greedy decoding. Pass a"
            " temperature > 0 to sample, or do_sample=False to decode greedily."
        )
    if do_sample is False and temperature not in (0.0, 1.0):
        raise ValueError(
            f"generate(do_sample=False, temperature={temperature}) contradicts itself: greedy decoding ignores the"
            " temperature. Drop the temperature, or sample with do_sample=True."
        )
    decoding = Decoding.GREEDY if do_sample is False or temperature == 0 else Decoding.SAMPLE
    if decoding is Decoding.GREEDY and top_k is not None:
        raise ValueError(
            f"generate(top_k={top_k}) has no effect with greedy decoding (temperature=0 or do_sample=False). Drop"
            " top_k, or sample with a temperature > 0."
        )
    return decoding


def _eos_ids(eos_token_id: Any) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if _is_int(eos_token_id) else eos_token_id
    if (
        isinstance(ids, (str, bytes, Tensor))
        or not isinstance(ids, Sequence)
        or not ids
        or not all(_is_int(i) and i >= 0 for i in ids)
    ):
        raise ValueError(
            f"generate(eos_token_id=...) must be a token id (an int >= 0), a non-empty sequence of them, or None;"
            f" got {eos_token_id!r}."
        )
    return tuple(int(i) for i in ids)


def _context_length(model: nn.Module, given: Any) -> int | None:
    """``given``, else what the model declares (see ``generate``), else ``None``."""
    if given is not None:
        if not _is_int(given) or given < 1:
            raise ValueError(f"generate(context_length=...) must be an int >= 1 or None, got {given!r}.")
        return int(given)
    inner = getattr(model, "_forward_module", model)
    config = getattr(inner, "config", None)
    declared: list[Any] = [getattr(inner, name, None) for name in _DECLARED_CONTEXT]
    declared += [getattr(config, name, None) for name in _CONFIG_CONTEXT]
    return next((int(n) for n in declared if _is_int(n) and n > 0), None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
