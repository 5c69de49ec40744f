"""The engine with a tensor-parallel plan, on 4 pooled gloo ranks at (dp=2, tp=2): steps, clipping, accumulation,
activation checkpointing, HYBRID_SHARD and ``summon_full_params`` against the unsharded, untensor-parallel model on
the global batch; and what is refused. Fresh processes under Lightning's launcher: tests/test_tensor_parallel.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import lightning_shard
from lightning_shard.common.options import ShardOptions
from lightning_shard.engine import clip_grad_norm_, prepare_optimizer, shard_model, summon_full_params
from lightning_shard.testing import run_on_ranks

TP = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)  # 12 rows over 2 tensor-parallel ranks, 6 over 2 data-parallel ranks
        self.down = nn.Linear(12, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.inp(x)))


def _parallelize(model: Net) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("data_parallel", "tensor_parallel"))
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})


def steps_against_the_whole_model(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = Net()
    model = Net()
    model.load_state_dict(reference.state_dict())
    _parallelize(model)
    checkpointed = options.pop("checkpoint", False)
    accumulate = options.pop("accumulate", 1)
    optimizer_class = getattr(torch.optim, options.pop("optimizer", "AdamW"))
    if checkpointed:
        from torch.utils.checkpoint import checkpoint

        for block in model.blocks:
            block.forward = lambda x, f=block.forward: checkpoint(f, x, use_reentrant=False)  # type: ignore[method-assign]
    shard_model(model, auto_wrap_policy={Block}, tensor_parallel_size=TP, device="cpu", **options)
    optimizer = prepare_optimizer(optimizer_class(model.parameters(), lr=0.05), model)
    ref_optimizer = optimizer_class(reference.parameters(), lr=0.05)
    data_parallel, dp_rank = world_size // TP, rank // TP
    g = torch.Generator().manual_seed(1)
    norms, ref_norms = [], []
    for _ in range(3):
        for _ in range(accumulate):
            x, y = torch.randn(4 * data_parallel, 5, generator=g), torch.randn(4 * data_parallel, 3, generator=g)
            mine = slice(4 * dp_rank, 4 * (dp_rank + 1))
            (nn.functional.mse_loss(model(x[mine]), y[mine]) / accumulate).backward()
            whole = sum(nn.functional.mse_loss(reference(x[4 * d : 4 * d + 4]), y[4 * d : 4 * d + 4])
                        for d in range(data_parallel))  # fmt: skip
            (whole / (data_parallel * accumulate)).backward()  # type: ignore[operator]
        norms.append(clip_grad_norm_(model, 0.3))
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3))
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    with summon_full_params(model):
        from torch.distributed.tensor import DTensor

        summoned = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in model.named_parameters()}  # fmt: skip
    return {"norms": norms, "ref_norms": ref_norms, "params": summoned, "reference": dict(reference.named_parameters())}


@pytest.mark.parametrize(
    ("world_size", "options"),
    [(4, {}), (4, {"checkpoint": True}), (4, {"accumulate": 2}),
     (4, {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 1)}), (2, {}), (4, {"optimizer": "Adafactor"})],
    ids=["full-shard", "activation-checkpointing", "accumulation", "hybrid", "one-data-parallel-rank",
         "adafactor-whole-tensors"],
)  # fmt: skip
def test_steps_clipping_and_full_params_equal_the_whole_model(world_size: int, options: dict[str, Any]) -> None:
    """Each rank's part of every DTensor parameter is sharded over the data-parallel ranks: the global norm counts
    every tensor-parallel part once (clipping active), the gradients average over the data-parallel ranks only, and
    ``summon_full_params`` presents the plan's DTensors in full. With one data-parallel rank (tensor parallelism
    alone) each rank keeps its own part of the plan: nothing is made to agree across the tensor-parallel ranks."""
    for result in run_on_ranks(steps_against_the_whole_model, world_size, dict(options)):
        torch.testing.assert_close(result["norms"], result["ref_norms"])
        assert result["params"].keys() == result["reference"].keys()
        for name, value in result["reference"].items():
            torch.testing.assert_close(result["params"][name], value.detach(), msg=name)


def _full_params(model: nn.Module) -> dict[str, Tensor]:
    from torch.distributed.tensor import DTensor

    with summon_full_params(model):
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.named_parameters()}  # fmt: skip


def meta_built(rank: int, world_size: int) -> dict[str, Any]:
    """A model built on the meta device, with and without the plan, initialised by the engine from one seed; then
    three steps of the planned one against the whole model started from its values."""
    with torch.device("meta"):
        planned, unplanned = Net(), Net()
    _parallelize(planned)
    torch.manual_seed(0)
    shard_model(planned, auto_wrap_policy={Block}, tensor_parallel_size=TP, device="cpu")
    torch.manual_seed(0)
    shard_model(unplanned, auto_wrap_policy={Block}, tensor_parallel_size=TP, device="cpu")
    initial = _full_params(planned)
    reference = Net()
    reference.load_state_dict(initial)
    optimizer = torch.optim.AdamW(planned.parameters(), lr=0.05)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    dp, dp_rank = world_size // TP, rank // TP
    for _ in range(3):
        x, y = torch.randn(4 * dp, 5, generator=g), torch.randn(4 * dp, 3, generator=g)
        nn.functional.mse_loss(planned(x[4 * dp_rank : 4 * dp_rank + 4]), y[4 * dp_rank : 4 * dp_rank + 4]).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return {"initial": initial, "unplanned": _full_params(unplanned), "trained": _full_params(planned),
            "reference": {n: p.detach() for n, p in reference.named_parameters()}}  # fmt: skip


def test_a_meta_built_model_starts_from_the_values_it_has_without_the_plan_and_trains_as_the_whole_model() -> None:
    """``init_module(empty_init=True)`` then the plan: each DTensor parameter is initialised in its global shape and
    split, so the planned model starts exactly where the model without the plan starts from the same seed (its
    tensor-parallel blocks are not copies of each other), on every rank, and then steps as the whole model."""
    results = run_on_ranks(meta_built, 4)
    for rank, result in enumerate(results):
        for name, value in result["unplanned"].items():
            torch.testing.assert_close(result["initial"][name], value, msg=f"{name}, rank {rank}")
            torch.testing.assert_close(result["initial"][name], results[0]["initial"][name], msg=f"{name}, rank {rank}")
        for name, value in result["reference"].items():
            torch.testing.assert_close(result["trained"][name], value, msg=f"{name}, rank {rank}")
    up = results[0]["initial"]["blocks.0.up.weight"]
    assert not torch.equal(up[:6], up[6:]), "the two tensor-parallel halves differ"


def state_dicts(rank: int, world_size: int, strategy: str, root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_shard.checkpoint.state import save_checkpoint
    from lightning_shard.checkpoint.state_dicts import model_state_dict, optimizer_state_dict

    torch.manual_seed(0)
    model = Net()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    _parallelize(model)
    shard_model(model, auto_wrap_policy={Block}, tensor_parallel_size=TP, device="cpu", sharding_strategy=strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    model(torch.randn(2, 5)).sum().backward()
    optimizer.step()
    sharded = model_state_dict(model, "sharded")
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.items()}
    meshes = {tuple(v.device_mesh.mesh_dim_names or ()) for v in sharded.values() if isinstance(v, DTensor)}
    momentum = optimizer_state_dict(model, optimizer, "sharded")["state"]["blocks.0.down.weight"]["momentum_buffer"]
    full = model_state_dict(model, "full")
    save_checkpoint(root, model, layout="full")
    return {"whole": whole, "full": full, "expected": expected, "meshes": meshes,
            "momentum": (tuple(momentum.shape), tuple(momentum.placements))}  # fmt: skip


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_state_dicts_hold_dtensors_over_the_2d_mesh_and_whole_tensors(strategy: str, tmp_path: Any) -> None:
    """The state-dict contract under tensor parallelism: sharded = DTensors over the ("data_parallel",
    "tensor_parallel") mesh in the global shapes, whose ``full_tensor()`` is the whole weight; full = the whole
    weights on rank 0; a full checkpoint holds them too."""
    from safetensors.torch import load_file

    results = run_on_ranks(state_dicts, 4, strategy, str(tmp_path / "full"))
    expected = results[0]["expected"]
    for rank, result in enumerate(results):
        assert result["meshes"] == {("data_parallel", "tensor_parallel")}
        assert result["momentum"][0] == (8, 12)  # blocks.0.down.weight: (8, 12) whole, split by columns
        for name, value in expected.items():
            torch.testing.assert_close(result["whole"][name], value, msg=f"{name}, rank {rank}")
    assert results[0]["full"].keys() == expected.keys() and all(r["full"] == {} for r in results[1:])
    for name, value in expected.items():
        torch.testing.assert_close(results[0]["full"][name], value, msg=name)
    stored = load_file(str(tmp_path / "full" / "model.safetensors"))
    for name, value in expected.items():
        torch.testing.assert_close(stored[name], value, msg=name)


def test_bad_sizes_and_combinations_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        ShardOptions.parse(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int or 'auto'"):
        ShardOptions.parse(tensor_parallel_size=2, data_parallel_size="all")  # type: ignore[arg-type]


def test_sizes_that_do_not_cover_the_world_are_refused_before_the_process_group() -> None:
    from unittest.mock import Mock

    strategy = lightning_shard.ShardStrategy(tensor_parallel_size=3)
    strategy.accelerator = Mock()
    strategy.cluster_environment = Mock(
        world_size=Mock(return_value=4), local_rank=Mock(return_value=1), node_rank=Mock(return_value=0),
        global_rank=Mock(return_value=1),
    )
    strategy.parallel_devices = [torch.device("cpu")] * 4
    refused = r"`tensor_parallel_size=3` multiplied should equal the world size \(4\)\. With num_nodes=1 x devices=4"
    with pytest.raises(ValueError, match=refused):
        strategy.setup_environment()
    assert not dist.is_initialized()


def test_the_device_mesh_exists_once_the_processes_are_set_up() -> None:
    for tp in (1, 2):
        with pytest.raises(RuntimeError, match="before processes have initialized"):
            _ = lightning_shard.ShardStrategy(tensor_parallel_size=tp).device_mesh


def test_the_hugging_face_plan_is_named_from_the_module_given() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    plan = lightning_shard.hf_tensor_parallel_plan(model)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert set(lightning_shard.hf_tensor_parallel_plan(model.model)) == {k.removeprefix("model.") for k in plan}
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "local_packed_rowwise"}
    with pytest.raises(ValueError, match=r"uses \['local_packed_rowwise'\]"):
        lightning_shard.hf_tensor_parallel_plan(model)
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        lightning_shard.hf_tensor_parallel_plan(nn.Linear(2, 2))


def _plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def sharded_bytes(rank: int, world_size: int) -> int:
    model = Net()
    _parallelize(model)
    engine = shard_model(model, auto_wrap_policy={Block}, tensor_parallel_size=TP, device="cpu")
    return sum(u.flat_sharded.numel() * u.flat_sharded.element_size() for u in engine.units)


def test_the_estimate_counts_each_ranks_tensor_parallel_part() -> None:
    """``estimate_memory(tensor_parallel_size=2, tensor_parallel_plan=...)`` counts the parameter shards rank 0 holds
    at (dp=2, tp=2) exactly; without the plan it would count whole layers over two data-parallel ranks."""
    with torch.device("meta"):
        model = Net()
    estimate = lightning_shard.estimate_memory(model, 4, auto_wrap_policy={Block}, tensor_parallel_size=TP,
                                               tensor_parallel_plan=_plan())  # fmt: skip
    measured = run_on_ranks(sharded_bytes, 4)[0]
    assert estimate.parameters == measured
    assert lightning_shard.estimate_memory(model, 2, auto_wrap_policy={Block}).parameters > measured


def state_dict_without_a_plan(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from lightning_shard.checkpoint.state_dicts import model_state_dict

    torch.manual_seed(0)
    model = Net()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    shard_model(model, auto_wrap_policy={Block}, tensor_parallel_size=TP, device="cpu")
    sharded = model_state_dict(model, "sharded")
    consistent = all(len(v.placements) == v.device_mesh.ndim for v in sharded.values() if isinstance(v, DTensor))
    return {"whole": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.items()},
            "expected": expected, "consistent": consistent}  # fmt: skip


def test_a_state_dict_without_a_plan_is_over_the_data_parallel_ranks() -> None:
    """``tensor_parallel_size=2`` with no plan applied: every parameter is replicated over the tensor-parallel ranks,
    and its state-dict DTensor lives on the data-parallel mesh of its column."""
    for result in run_on_ranks(state_dict_without_a_plan, 4):
        assert result["consistent"], "a placement per mesh dimension"
        for name, value in result["expected"].items():
            torch.testing.assert_close(result["whole"][name], value, msg=name)
