"""The plain-PyTorch entry points: ``lightning_shard.engine.shard_model`` / ``clip_grad_norm_`` against DDP, and
``lightning_shard.checkpoint.save_checkpoint`` / ``load_checkpoint`` across world sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_shard.checkpoint import load_checkpoint, save_checkpoint
from lightning_shard.engine import clip_grad_norm_, shard_model
from lightning_shard.testing import run_on_ranks
from tests.checkpoint_fits import module_full_state
from tests.models import GPTBlock, TinyGPT, make_dataset


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_dataset("gpt")[rank * 3 : rank * 3 + 3]
    return x, y


def step_against_ddp(rank: int, world_size: int, dtype: torch.dtype = torch.float32) -> None:
    torch.manual_seed(0)
    reference, model = TinyGPT().to(dtype), TinyGPT().to(dtype)
    model.load_state_dict(reference.state_dict())
    x, y = _batch(rank)
    ref_loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
    ref_loss.backward()
    for p in reference.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    norm = clip_grad_norm_(model, max_norm=0.5)
    optimizer.step()
    torch.testing.assert_close(norm, ref_norm)
    full = module_full_state(model, [])["params"]
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), msg=name)


@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_model_trains_a_step_as_ddp_with_the_global_norm(world_size: int) -> None:
    run_on_ranks(step_against_ddp, world_size)


def test_a_float64_model_is_clipped_by_its_norm_in_float64() -> None:
    run_on_ranks(step_against_ddp, 2, torch.float64)  # float64's default tolerances: a float32 norm fails them


def _one_adamw_step(rank: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """A sharded TinyGPT (seed 0) after one AdamW step on this rank's batch."""
    torch.manual_seed(0)
    model = TinyGPT()
    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(rank)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    return model, optimizer


def train_and_save(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    model, optimizer = _one_adamw_step(rank)
    save_checkpoint(path, model, [optimizer], {"step": 1, "note": "after one step"})
    return module_full_state(model, [])["params"]


def load_elsewhere(rank: int, world_size: int, path: str) -> dict:
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = TinyGPT()
    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    values, result = load_checkpoint(path, model, [optimizer])
    steps = [int(s["step"]) for s in optimizer.state.values()]
    full = module_full_state(model, [])["params"]
    return {"values": values, "missing": result.missing_keys, "full": full, "steps": steps}


def test_save_checkpoint_on_2_ranks_loads_on_3(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(train_and_save, 2, path)[0]
    for r in run_on_ranks(load_elsewhere, 3, path):
        assert r["values"] == {"step": 1, "note": "after one step"} and r["missing"] == []
        assert r["steps"] and set(r["steps"]) == {1}  # the optimizer state came back too
        for name, t in saved.items():
            torch.testing.assert_close(r["full"][name], t, rtol=0, atol=0, msg=name)


def needs_a_process_group(rank: int, world_size: int) -> str:
    dist.destroy_process_group()
    try:
        shard_model(TinyGPT())
    except RuntimeError as err:
        return str(err)
    finally:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return ""


def test_shard_model_without_a_process_group_says_what_to_do() -> None:
    for message in run_on_ranks(needs_a_process_group, 1):
        assert "call torch.distributed.init_process_group() first" in message


def root_submodule_around_a_step(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """``lm_head`` (root-unit weights) called on its own without gradients, between backward and the optimizer step,
    after the step, and after loading other weights: each call must see the weights as they are then."""
    torch.manual_seed(0)
    reference, model = TinyGPT(), TinyGPT()
    model.load_state_dict(reference.state_dict())
    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _batch(rank)
    probe = torch.linspace(-1.0, 1.0, 16).unsqueeze(0)  # not constant: a LayerNorm'd input's update sums to zero
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    with torch.no_grad():
        before = model.lm_head(probe)
    optimizer.step()
    with torch.no_grad():
        after = model.lm_head(probe)
    ref_before = reference.lm_head(probe).detach()
    F.cross_entropy(reference(x).flatten(0, 1), y.flatten()).backward()
    for p in reference.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    return {"before": before, "after": after, "ref_before": ref_before, "ref_after": reference.lm_head(probe).detach()}


def test_a_root_submodule_called_without_gradients_sees_the_weights_of_the_moment() -> None:
    for run in run_on_ranks(root_submodule_around_a_step, 2):
        torch.testing.assert_close(run["before"], run["ref_before"])
        torch.testing.assert_close(run["after"], run["ref_after"])
        assert not torch.equal(run["after"], run["before"])


def inner_modules_called_on_their_own(rank: int, world_size: int) -> dict[str, Any]:
    """Modules inside a block unit (``blocks[0].fc``, ``blocks[1].out``) called outside the block's forward: without
    gradients between the steps, and with gradients as the whole loss of a training step of their own."""
    torch.manual_seed(0)
    reference, model = TinyGPT(), TinyGPT()
    model.load_state_dict(reference.state_dict())
    shard_model(model, auto_wrap_policy={GPTBlock})
    probe = torch.linspace(-1.0, 1.0, 16 * 3).view(3, 16) + rank  # each rank's own input
    outputs: dict[str, Any] = {}
    for name, net in (("ours", model), ("ref", reference)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        x, y = _batch(rank)
        F.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
        with torch.no_grad():
            between = net.blocks[0].fc(probe)  # after backward, before the step
        _average_by_hand(net, world_size, mine=net is model)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            after = net.blocks[0].fc(probe)
        net.blocks[1].out(torch.cat([probe] * 4, 1)).square().mean().backward()  # a step of blocks[1].out alone
        _average_by_hand(net, world_size, mine=net is model)
        optimizer.step()
        outputs[name] = {"between": between, "after": after, "params": module_full_state(net, [])["params"]
                         if net is model else {k: v.detach() for k, v in net.state_dict().items()}}
    return outputs


def _average_by_hand(net: torch.nn.Module, world_size: int, mine: bool) -> None:
    if mine:  # the sharded model's gradients are averaged already
        return
    for p in net.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


def test_a_module_inside_a_unit_called_on_its_own_computes_and_trains_with_the_full_weights() -> None:
    for run in run_on_ranks(inner_modules_called_on_their_own, 2):
        ours, ref = run["ours"], run["ref"]
        torch.testing.assert_close(ours["between"], ref["between"])
        torch.testing.assert_close(ours["after"], ref["after"])
        for name, value in ref["params"].items():
            torch.testing.assert_close(ours["params"][name], value, msg=name)


class LearnedScale(torch.nn.Module):
    """A learnable 0-dim parameter (as CLIP's ``logit_scale``) beside a Linear: one rank holds its single row."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


_SCALE_BATCH = torch.linspace(-1.0, 1.0, 12).view(4, 3)  # the same on every rank: any world size, the same gradient


def _scale_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(_SCALE_BATCH).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_with_a_scalar_parameter(rank: int, world_size: int, path: str, layout: str) -> dict[str, torch.Tensor]:
    """Two Adam steps, save, and the step after the save: what a resumed run must reproduce."""
    torch.manual_seed(0)
    model = LearnedScale()
    shard_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        _scale_step(model, optimizer)
    save_checkpoint(path, model, [optimizer], layout=layout)
    _scale_step(model, optimizer)
    return module_full_state(model, [])["params"]


def resume_with_a_scalar_parameter(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = LearnedScale()
    shard_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    load_checkpoint(path, model, [optimizer])
    _scale_step(model, optimizer)
    return module_full_state(model, [])["params"]


@pytest.mark.parametrize("layout", ["sharded", "full"])
def test_a_0_dim_parameter_and_its_adam_state_resume_at_any_world_size(tmp_path: Path, layout: str) -> None:
    path = str(tmp_path / "ckpt")
    expected = run_on_ranks(save_with_a_scalar_parameter, 2, path, layout)[0]
    for world_size in (1, 2, 3):
        for resumed in run_on_ranks(resume_with_a_scalar_parameter, world_size, path):
            for name, value in expected.items():
                torch.testing.assert_close(resumed[name], value, msg=f"{name} at world size {world_size}")


def load_full_state_dict(rank: int, world_size: int) -> dict[str, Any]:
    """``load_state_dict`` of full tensors into the sharded model, after a step (the root gathered and freed); then
    its own (sharded) state dict back into it; then a load between forward and backward."""
    torch.manual_seed(0)
    model = TinyGPT()
    shard_model(model, auto_wrap_policy={GPTBlock})
    x, y = _batch(rank)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    torch.manual_seed(1)
    other = TinyGPT()  # other weights, in full
    result = model.load_state_dict(other.state_dict())
    with torch.no_grad():
        after_full = model(x)
    own = {k: v.clone() for k, v in model.state_dict().items()}  # this rank's shards
    model.load_state_dict(own)
    with torch.no_grad():
        after_own = model(x)
    loss = model(x).sum()
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict(other.state_dict())
    loss.backward()
    return {
        "full": module_full_state(model, [])["params"], "expected": dict(other.named_parameters()),
        "output": after_full, "expected_output": other(x).detach(), "own_output": after_own,
        "missing": result.missing_keys, "unexpected": result.unexpected_keys, "between": str(raised.value),
    }


def test_load_state_dict_takes_full_tensors_and_its_own_shards() -> None:
    for run in run_on_ranks(load_full_state_dict, 2):
        assert run["missing"] == [] and run["unexpected"] == []
        for name, expected in run["expected"].items():
            torch.testing.assert_close(run["full"][name], expected.detach(), msg=name)
        torch.testing.assert_close(run["output"], run["expected_output"])
        torch.testing.assert_close(run["own_output"], run["expected_output"])
        assert "between a forward and its backward" in run["between"]


def save_with_state_in_another_order(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    """One AdamW step, then a save on a rank whose optimizer lists its state in reverse order (state created in
    another order than on the other ranks: an optimizer whose step skips parameters on some ranks)."""
    model, optimizer = _one_adamw_step(rank)
    saved = module_full_state(model, [optimizer])["optimizer"]
    if rank == 1:
        reversed_state = list(optimizer.state.items())[::-1]
        optimizer.state.clear()
        optimizer.state.update(reversed_state)
    save_checkpoint(path, model, [optimizer], {})
    return saved


def load_optimizer_state(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    model = TinyGPT()
    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_checkpoint(path, model, [optimizer])
    return module_full_state(model, [optimizer])["optimizer"]


def test_optimizer_state_listed_in_another_order_on_one_rank_saves_and_loads_exactly(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(save_with_state_in_another_order, 2, path)[0]
    for loaded in run_on_ranks(load_optimizer_state, 2, path):
        assert loaded.keys() == saved.keys()
        for name, t in saved.items():
            torch.testing.assert_close(loaded[name], t, rtol=0, atol=0, msg=name)
