"""The sharding arguments are declared once (``ShardArguments``): both front ends' ``ShardStrategy`` take them as
real named parameters with the same annotations and defaults, document each in their docstrings, and
``ShardOptions.parse`` checks them with the same defaults; jsonargparse (and so LightningCLI) builds either class
from them."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser
from lightning.fabric.strategies import Strategy as FabricStrategy

from lightning_shard import ShardStrategy
from lightning_shard.common.options import ShardArguments, ShardOptions
from lightning_shard.engine.option_choices import PipelineSchedule, StateDictType
from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

DECLARED = [f.name for f in dataclasses.fields(ShardArguments)]
LIGHTNING_ARGUMENTS = {
    ShardStrategy: ["accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"],
    FabricShardStrategy: ["accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision"],
}
FRONT_ENDS = pytest.mark.parametrize("front", [ShardStrategy, FabricShardStrategy], ids=["trainer", "fabric"])


def _sharding_parameters(cls: type) -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(cls).parameters
    return {name: parameters[name] for name in DECLARED}


@FRONT_ENDS
def test_the_signature_is_lightnings_arguments_then_the_declared_ones(front: type) -> None:
    names = list(inspect.signature(front).parameters)
    assert names[:5] == LIGHTNING_ARGUMENTS[front]
    assert names[-len(DECLARED):] == DECLARED
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in _sharding_parameters(front).values())


def test_both_front_ends_take_the_same_arguments_with_the_same_annotations_and_defaults() -> None:
    trainer, fabric = _sharding_parameters(ShardStrategy), _sharding_parameters(FabricShardStrategy)
    assert trainer == fabric
    assert [(p.default, p.annotation) for p in trainer.values()] == [
        (f.default, typing.get_type_hints(ShardArguments)[f.name]) for f in dataclasses.fields(ShardArguments)
    ]


@FRONT_ENDS
def test_the_annotations_are_real_types_that_get_type_hints_resolves(front: type) -> None:
    hints = typing.get_type_hints(front.__init__)
    for name, parameter in _sharding_parameters(front).items():
        assert not isinstance(parameter.annotation, str), name
        assert hints[name] == parameter.annotation, name
    assert hints["state_dict_type"] == typing.Literal["sharded", "full"] | StateDictType
    assert hints["pipeline_schedule"] == typing.Literal["1F1B", "gpipe"] | PipelineSchedule


def test_parse_takes_the_same_arguments_and_the_strategies_hold_what_it_makes() -> None:
    assert _sharding_parameters(ShardStrategy) == dict(inspect.signature(ShardOptions.parse).parameters)
    assert ShardStrategy().options == FabricShardStrategy().options == ShardOptions.parse()


@FRONT_ENDS
def test_the_docstring_documents_every_argument_once_in_its_args_section(front: type) -> None:
    doc = inspect.getdoc(front)
    assert doc is not None and doc.count("\nArgs:\n") == 1
    args = doc.split("\nArgs:\n")[1]
    for name in DECLARED:
        assert args.count(f"\n    {name}: ") + args.startswith(f"    {name}: ") == 1, name


def test_microbatches_default_to_one_per_pipeline_stage() -> None:
    assert ShardOptions.parse().microbatches == 1
    assert ShardOptions.parse(pipeline_parallel_size=4, auto_wrap_policy={"Block"}).microbatches == 4
    assert ShardOptions.parse(pipeline_parallel_size=4, auto_wrap_policy={"Block"}, microbatches=8).microbatches == 8


@FRONT_ENDS
def test_an_unknown_argument_is_refused_naming_it(front: type) -> None:
    with pytest.raises(TypeError, match="ShardStrategy.__init__\\(\\) got an unexpected keyword argument 'shard'"):
        front(shard="FULL_SHARD")


@FRONT_ENDS
def test_jsonargparse_builds_the_strategy_from_a_yaml_file_and_the_command_line(front: type, tmp_path: Path) -> None:
    """``strategy: {class_path: ..., init_args: {...}}`` in a YAML file, an argument overridden on the command line,
    as LightningCLI (the Trainer) or a jsonargparse script (Fabric) takes them."""
    from lightning.pytorch.strategies import Strategy as TrainerStrategy

    class_path = f"{front.__module__.rsplit('.', 1)[0]}.ShardStrategy"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"strategy:\n  class_path: {class_path}\n  init_args:\n    auto_wrap_policy: [GPTBlock, MLPBlock]\n"
        "    pipeline_schedule: gpipe\n    state_dict_type: full\n"
    )
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action="config")
    parser.add_argument("--strategy", type=TrainerStrategy if front is ShardStrategy else FabricStrategy)
    parsed = parser.parse_args(["--config", str(config), "--strategy.init_args.tensor_parallel_size", "2"])
    strategy = parser.instantiate(parsed).strategy
    assert type(strategy) is front
    assert strategy.options.pipeline_schedule is PipelineSchedule.GPIPE
    assert strategy.options.state_dict_type is StateDictType.FULL
    assert strategy.options.tensor_parallel_size == 2
    assert strategy.options.wrap_policy.classes == frozenset({"GPTBlock", "MLPBlock"})


@FRONT_ENDS
def test_jsonargparse_reads_each_arguments_type_and_documentation(front: type) -> None:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(front, "strategy")
    help_text = " ".join(parser.format_help().split()).split(" options: ", 1)[1]  # after the usage line
    grad_sync = help_text[help_text.index("--strategy.grad_sync GRAD_SYNC"):help_text.index("--strategy.state_dict")]
    assert "``\"microbatch\"`` (default) reduce-scatters after every micro-batch" in grad_sync, grad_sync
    assert "(type: Union[Literal['microbatch', 'step'], GradSync], default: microbatch)" in grad_sync, grad_sync
    parsed = parser.parse_args(["--strategy.tensor_parallel_size", "2", "--strategy.sharding_strategy", "NO_SHARD"])
    assert (parsed.strategy.tensor_parallel_size, parsed.strategy.sharding_strategy) == (2, "NO_SHARD")
    with pytest.raises(Exception, match="pipeline_schedule"):
        parser.parse_args(["--strategy.pipeline_schedule", "interleaved"])

