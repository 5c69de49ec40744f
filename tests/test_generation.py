"""``generate``: on a sharded model, ranks that generate different lengths (their own ``max_new_tokens``, an
``eos_token_id`` one reaches early) finish together and give the tokens one process samples with the same weights and
seed, greedy and sampled, on our GPT and on Hugging Face GPT-2; inside ``summon_full_params`` ranks generate alone;
a loop without the agreement hangs; bad arguments are refused on every rank."""

from __future__ import annotations

import copy
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn

from lightning_shard import generate, summon_full_params
from lightning_shard.engine import shard_model
from lightning_shard.engine.stall import bound_waits
from lightning_shard.testing import RankFailure, RankStatus, run_on_ranks
from tests.models import GPTBlock, TinyGPT

VOCAB, CTX = 37, 8  # TinyGPT's vocabulary and context: longer inputs are cropped to the last 8 tokens
SAMPLED = {"temperature": 2.0, "top_k": 5}  # TinyGPT is peaked at initialisation: hot, so top_k matters
GREEDY = {"temperature": 0.0}


# References: one process, the unsharded weights #


def reference_generate(
    model: nn.Module,
    ids: Tensor,
    max_new_tokens: int,
    context: int,
    temperature: float,
    top_k: int | None = None,
    eos: int | None = None,
    seed: int = 0,
    hf: bool = False,
) -> Tensor:
    """nanoGPT's sampling loop, with rows that produced ``eos`` padded with it and a stop once every row has."""
    generator = torch.Generator().manual_seed(seed)
    ended = torch.zeros(ids.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            cropped = ids[:, -context:]
            logits = (model(input_ids=cropped).logits if hf else model(cropped))[:, -1, :]
            if temperature == 0:
                next_ids = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, top_k).values[:, [-1]]
                    logits[logits < kth] = float("-inf")
                next_ids = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            if eos is not None:
                next_ids[ended] = eos
                ended |= next_ids[:, 0] == eos
            ids = torch.cat([ids, next_ids], dim=1)
            if eos is not None and ended.all():
                break
    return ids


def tiny_gpt_pair(strategy: str = "FULL_SHARD") -> tuple[nn.Module, nn.Module]:
    """``TinyGPT`` sharded by ``shard_model`` over every rank, and an unsharded copy of the same weights."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model).eval()
    shard_model(model, auto_wrap_policy={GPTBlock}, sharding_strategy=strategy, device="cpu")
    assert all(p.numel() < r.numel() for p, r in zip(model.parameters(), reference.parameters())), "not sharded"
    return model, reference


def prompt(rank: int, batch: int = 2, length: int = 3, vocab: int = VOCAB) -> Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(10 + rank))


# Sharded generation, different lengths per rank #


def different_max_new_tokens(rank: int, world_size: int, decoding: dict, strategy: str) -> list[int]:
    model, reference = tiny_gpt_pair(strategy)
    model.train()
    n = 3 if rank == 0 else 9  # rank 1 runs 6 forwards more, past the context length of 8
    seed = 100 + rank
    ids = prompt(rank)
    out = generate(
        model, ids, n, **decoding, generator=torch.Generator().manual_seed(seed), context_length=CTX
    )
    expected = reference_generate(reference, ids, n, CTX, seed=seed, **decoding)
    torch.testing.assert_close(out, expected)
    assert model.training, "the model's mode is restored"
    return list(out.shape)


@pytest.mark.parametrize("decoding", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_ranks_with_different_max_new_tokens_finish_together_with_one_process_tokens(
    decoding: dict, strategy: str
) -> None:
    shapes = run_on_ranks(different_max_new_tokens, 2, decoding, strategy, timeout=120)
    assert shapes == [[2, 6], [2, 12]]


def eos_early_on_one_rank(rank: int, world_size: int, decoding: dict) -> list[int]:
    model, reference = tiny_gpt_pair()
    seed = 200 + rank
    ids = prompt(rank, batch=1 if rank == 0 else 2)
    eos = None
    if rank == 0:  # the token rank 0 produces second ends its only row: it stops after at most 2 of 8 tokens
        eos = int(reference_generate(reference, ids, 2, CTX, seed=seed, **decoding)[0, -1])
    out = generate(
        model, ids, 8, **decoding, eos_token_id=eos, generator=torch.Generator().manual_seed(seed), context_length=CTX
    )
    expected = reference_generate(reference, ids, 8, CTX, eos=eos, seed=seed, **decoding)
    torch.testing.assert_close(out, expected)
    return list(out.shape)


@pytest.mark.parametrize("decoding", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_rank_that_reaches_eos_early_keeps_joining_the_forwards(decoding: dict) -> None:
    shapes = run_on_ranks(eos_early_on_one_rank, 2, decoding, timeout=120)
    assert shapes[0][1] <= 3 + 2 and shapes[1] == [2, 3 + 8], shapes


class Holder(nn.Module):
    """A model that holds the language model, as a ``LightningModule`` does (``self.model``), without a forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def hf_gpt2_different_lengths(rank: int, world_size: int, sharded_root: str) -> list[int]:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model).eval()
    root = model if sharded_root == "model" else Holder(model)  # "holder": generate() gets a submodule of it
    shard_model(root, auto_wrap_policy={"GPT2Block"}, device="cpu")
    assert model.transformer.wte.weight.shape[0] < 64, "not sharded"
    calls: list[tuple[str, ...]] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(tuple(sorted(kwargs))), with_kwargs=True)
    ids = prompt(rank, length=4, vocab=64)
    n = 3 if rank == 0 else 15  # rank 1 goes past n_positions = 16: generate() crops to what the config declares
    seed = 300 + rank
    out = generate(model, ids, n, **SAMPLED, generator=torch.Generator().manual_seed(seed))
    expected = reference_generate(reference, ids, n, 16, seed=seed, hf=True, **SAMPLED)
    torch.testing.assert_close(out, expected)
    assert set(calls) == {("input_ids", "use_cache")}, "called by keyword, without building a key/value cache"
    return list(out.shape)


@pytest.mark.parametrize("sharded_root", ["model", "holder"])
def test_hugging_face_gpt2_generates_different_lengths_per_rank_with_one_process_tokens(sharded_root: str) -> None:
    """Also on the submodule of a sharded model (``self.model`` of a ``LightningModule``): its first forward
    gathers, so the ranks go on in step."""
    assert run_on_ranks(hf_gpt2_different_lengths, 2, sharded_root, timeout=120) == [[2, 7], [2, 19]]


# Full weights: summon_full_params #


def inside_summon_full_params(rank: int, world_size: int, rank0_only: bool) -> list[int] | None:
    model, reference = tiny_gpt_pair()
    ids = prompt(rank)
    with summon_full_params(model, rank0_only=rank0_only):
        if rank0_only and rank != 0:  # holds its shards: refused before any collective, rank 0 goes on alone
            with pytest.raises(RuntimeError, match="only global rank 0 holds the full weights"):
                generate(model, ids, 4, context_length=CTX)
            return None
        n = 7 if rank == 0 else 2  # no collective in forward: each rank stops when it is done
        out = generate(model, ids, n, **SAMPLED, generator=torch.Generator().manual_seed(rank), context_length=CTX)
    torch.testing.assert_close(out, reference_generate(reference, ids, n, CTX, seed=rank, **SAMPLED))
    return list(out.shape)


@pytest.mark.parametrize("rank0_only", [False, True])
def test_inside_summon_full_params_ranks_generate_alone(rank0_only: bool) -> None:
    shapes = run_on_ranks(inside_summon_full_params, 2, rank0_only, timeout=120)
    assert shapes == ([[2, 10], None] if rank0_only else [[2, 10], [2, 5]])


def alone_on_rank0(rank: int, world_size: int, what: str) -> list[int] | None:
    """Only rank 0 calls generate(), on a module whose first forward enters no collective: it goes on alone."""
    torch.manual_seed(0)
    gpt = TinyGPT()
    reference = copy.deepcopy(gpt).eval()
    holder = Holder(gpt)
    if what == "summoned part":
        shard_model(holder, auto_wrap_policy={GPTBlock}, device="cpu")
    with summon_full_params(holder, rank0_only=True) if what == "summoned part" else nullcontext():
        if rank != 0:
            return None
        ids = prompt(rank)
        out = generate(gpt, ids, 6, **SAMPLED, generator=torch.Generator().manual_seed(9), context_length=CTX)
    torch.testing.assert_close(out, reference_generate(reference, ids, 6, CTX, seed=9, **SAMPLED))
    return list(out.shape)


@pytest.mark.parametrize("what", ["plain", "summoned part"])
def test_a_module_whose_forward_communicates_nothing_generates_on_one_rank_alone(what: str) -> None:
    assert run_on_ranks(alone_on_rank0, 2, what, timeout=120) == [[2, 9], None]


# Refusals #


def refused_on_one_rank(rank: int, world_size: int) -> str:
    model, _ = tiny_gpt_pair()
    try:
        generate(model, prompt(rank), 4, top_k=0 if rank == 1 else 5, context_length=CTX)
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "returned"


def test_arguments_refused_on_one_rank_raise_on_every_rank() -> None:
    rank0, rank1 = run_on_ranks(refused_on_one_rank, 2, timeout=120)
    assert rank1.startswith("ValueError: generate(top_k=...) must be an int >= 1"), rank1
    assert rank0.startswith("RuntimeError: generate() was refused on another rank"), rank0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"input_ids": torch.tensor([1, 2])}, ValueError, r"shape \(B, T\).*input_ids\[None\]"),
        ({"input_ids": torch.ones(1, 2)}, TypeError, "integer token ids"),
        ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_k": 0}, ValueError, "top_k"),
        ({"temperature": 0.0, "top_k": 5}, ValueError, "no effect with greedy"),
        ({"do_sample": True, "temperature": 0.0}, ValueError, "contradicts"),
        ({"do_sample": False, "temperature": 0.7}, ValueError, "contradicts"),
        ({"eos_token_id": [], "temperature": 0.0}, ValueError, "eos_token_id"),
        ({"eos_token_id": "a"}, ValueError, "eos_token_id"),
        ({"context_length": 0}, ValueError, "context_length"),
        ({"generator": 3}, TypeError, "torch.Generator"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(kwargs: dict, error: type, match: str) -> None:
    arguments: dict[str, Any] = {"input_ids": torch.ones(1, 2, dtype=torch.long), "max_new_tokens": 2} | kwargs
    with pytest.raises(error, match=match):
        generate(TinyGPT(), **arguments)


def test_a_model_that_does_not_return_logits_is_refused() -> None:
    class Embeds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 4)

        def forward(self, idx: Tensor) -> Tensor:
            return self.emb(idx).sum(-1)  # (B, T)

    with pytest.raises(TypeError, match=r"logits of shape \(B, T, V\).*got shape \(1, 2\)"):
        generate(Embeds(), torch.ones(1, 2, dtype=torch.long), 1)


# One process: model outputs, modes, rows that end #


class NanoGPTStyle(nn.Module):
    """nanoGPT's interface: ``block_size`` declared; ``forward(idx)`` returns (the last position's logits, None)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.block_size = CTX

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return self.gpt(idx)[:, [-1], :], None


def test_a_nanogpt_style_model_is_cropped_to_its_block_size_and_read_from_its_tuple() -> None:
    torch.manual_seed(0)
    model = NanoGPTStyle()
    ids = prompt(0)
    out = generate(model, ids, 10, **SAMPLED, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(out, reference_generate(model.gpt, ids, 10, CTX, seed=5, **SAMPLED))


def test_eval_mode_no_grad_and_every_module_mode_restored() -> None:
    torch.manual_seed(0)
    model = TinyGPT().train()
    model.blocks[1].eval()  # e.g. a frozen block kept in eval mode
    seen: list[tuple[bool, bool]] = []
    model.blocks[0].register_forward_hook(lambda m, a, out: seen.append((m.training, out.requires_grad)))
    out = generate(model, prompt(0), 3, **GREEDY, context_length=CTX)
    assert seen == [(False, False)] * 3
    assert not out.requires_grad
    assert model.training and model.blocks[0].training and not model.blocks[1].training


def test_a_row_that_ended_is_padded_with_eos_while_the_others_continue() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    ids = prompt(0)
    free = generate(model, ids, 6, **SAMPLED, generator=torch.Generator().manual_seed(7), context_length=CTX)
    eos = int(free[0, 4])  # the second new token of row 0
    assert eos not in free[1, 3:].tolist(), "the seed is chosen so that row 1 does not produce it"
    out = generate(
        model, ids, 6, **SAMPLED, eos_token_id=eos, generator=torch.Generator().manual_seed(7), context_length=CTX
    )
    first = free[0, 3:].tolist().index(eos) + 3
    assert out[0, first:].tolist() == [eos] * (9 - first)
    torch.testing.assert_close(out[1], free[1])  # every row draws at every step: row 1 is unchanged
    torch.testing.assert_close(out, reference_generate(model, ids, 6, CTX, eos=eos, seed=7, **SAMPLED))


# Without the agreement: the ranks' collectives fall out of step #


def naive_generate(rank: int, world_size: int) -> int:
    """The hand-written loop every rank runs, each to its own length: rank 0 stops after 2 tokens, rank 1's third
    forward waits for an all-gather rank 0 never joins."""
    model, _ = tiny_gpt_pair()
    bound_waits(timedelta(seconds=2))  # the wait rank 1 is left in raises instead of blocking
    ids = prompt(rank)
    with torch.no_grad():
        for _ in range(2 if rank == 0 else 6):
            next_ids = model(ids[:, -CTX:])[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], dim=1)
    return ids.shape[1]


def test_without_the_agreement_a_rank_that_stops_early_leaves_the_others_waiting() -> None:
    """Last in this file: the failure ends the worker pool (the next call starts fresh workers)."""
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(naive_generate, 2, timeout=60, grace=20)
    outcomes = failure.value.outcomes
    assert outcomes[0].status is RankStatus.RETURNED and outcomes[0].result == 5
    assert outcomes[1].status is RankStatus.RAISED and "StalledRanksError" in outcomes[1].error, outcomes[1].error


# Hugging Face's own generate() in a validation_step: transformers keeps the ranks in step by itself #


class ValidatesByGenerating(L.LightningModule):
    """A tiny GPT-2 whose validation step runs Hugging Face's ``generate`` (greedy, with an end-of-sequence token)
    on this rank's prompt and keeps the tokens."""

    def __init__(self, prompts: list[Tensor], eos: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(HF_CONFIG)
        self.prompts, self.eos = prompts, eos
        self.tokens: list[list[int]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids = self.prompts[self.global_rank]
        out = self.model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=self.eos,
                                  pad_token_id=self.eos, attention_mask=torch.ones_like(ids))
        self.tokens.append(out[0].tolist())


HF_CONFIG = transformers.GPT2Config(
    vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)


def _prompts_where_rank_0_ends_first() -> tuple[list[Tensor], int]:
    """Two prompts and an end token that the greedy continuation of the first gives as its first new token and the
    second's does not give in 12 (found on the unsharded model, the same on every rank)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(HF_CONFIG).eval()
    generator = torch.Generator().manual_seed(7)
    candidates = [torch.randint(0, 64, (1, 4), generator=generator) for _ in range(20)]
    with torch.no_grad():
        runs = [model.generate(c, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 4:].tolist()
                for c in candidates]
    for first, run in zip(candidates, runs):
        eos = run[0]
        for second, other in zip(candidates, runs):
            if eos not in other:
                return [first, second], eos
    raise AssertionError("no pair of prompts for the test")


def generate_in_validation(rank: int, world_size: int, sharded: bool) -> dict[str, Any]:
    import time

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_shard import ShardStrategy

    prompts, eos = _prompts_where_rank_0_ends_first()
    module = ValidatesByGenerating(prompts, eos)
    strategy = (ShardStrategy(auto_wrap_policy={"GPT2Block"}, timeout=timedelta(seconds=30)) if sharded
                else DDPStrategy())
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    trainer.validate(module, torch.utils.data.DataLoader(torch.zeros(world_size, 1)))
    return {"tokens": module.tokens, "eos": eos, "seconds": time.perf_counter() - start}


def test_hugging_face_generate_in_validation_step_keeps_the_ranks_in_step_when_one_ends_first() -> None:
    """transformers runs ``generate`` in step across ranks (``synced_gpus``) for the sharded modules it recognises;
    the engine marks its modules as such, so a rank that reaches its end token keeps joining the forwards."""
    ours = run_on_ranks(generate_in_validation, 2, True, timeout=180)
    ddp = run_on_ranks(generate_in_validation, 2, False, timeout=180)
    assert [r["tokens"] for r in ours] == [r["tokens"] for r in ddp]
    eos = ours[0]["eos"]
    assert ours[0]["tokens"][0][-1] == eos and len(ours[0]["tokens"][0]) == 4 + 1  # rank 0 ended at its 1st token
    assert len(ours[1]["tokens"][0]) == 4 + 12 and eos not in ours[1]["tokens"][0][4:]
