"""The ``lightning-shard`` command.

    lightning-shard consolidate CKPT_DIR OUT.safetensors   # one model file, loadable with safetensors
    lightning-shard inspect CKPT_DIR                       # world size, step, tensors, checksum verification
    lightning-shard export CKPT_DIR OUT_DIR --format hf --prefix model. --config config.json  # from_pretrained
    lightning-shard export CKPT_DIR OUT_DIR --format dcp         # what ModelParallelStrategy resumes from
    lightning-shard export CKPT_DIR OUT.ckpt --format lightning  # for LightningModule.load_from_checkpoint
    lightning-shard export CKPT_DIR OUT.gguf --format gguf --prefix model. --config config.json  # llama.cpp
    lightning-shard convert last.ckpt CKPT_DIR --module my_pkg.models:LitGPT   # a DDP/FSDP .ckpt or a DCP directory
    lightning-shard estimate my_pkg.models:build_gpt --world-size 8 --wrap Block --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # torch, Lightning and the checkpoint machinery are imported only now that a command runs: --help stays quick.
    if args.command == "estimate":
        return _estimate(args)
    from lightning_shard.checkpoint.format import CheckpointError
    from lightning_shard.checkpoint.interop.hf import consolidate
    from lightning_shard.checkpoint.load.inspect import inspect

    try:
        if args.command == "export":
            return _export(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "consolidate":
            print(f"wrote {consolidate(args.checkpoint_dir, args.output)}")
            return 0
        summary = inspect(args.checkpoint_dir, verify=not args.no_verify)
        print(summary)
        return 1 if summary.problems else 0
    except CheckpointError as err:
        print(f"lightning-shard: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, one subparser per command. Standard library only: see ``main``."""
    parser = argparse.ArgumentParser(
        prog="lightning-shard", description="Tools for lightning_shard checkpoints and memory estimates."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("consolidate", help="write a checkpoint's model as one .safetensors file")
    c.add_argument("checkpoint_dir")
    c.add_argument("output")
    i = commands.add_parser("inspect", help="summarise a checkpoint directory and verify its checksums")
    i.add_argument("checkpoint_dir")
    i.add_argument("--no-verify", action="store_true", help="skip reading every file to check its checksum")
    e = commands.add_parser("estimate", help="per-rank memory for a model built on the meta device")
    e.add_argument("factory", help="module:callable returning the nn.Module (called under torch.device('meta'))")
    e.add_argument("--world-size", type=_world_size, required=True)
    e.add_argument("--wrap", nargs="*", default=None, help="module class names that become sharding units")
    e.add_argument("--sharding-strategy", default="FULL_SHARD")
    e.add_argument("--precision", default="32-true")
    e.add_argument("--optimizer", default="adamw")
    e.add_argument("--cpu-offload", action="store_true", help="model state in CPU memory (cpu_offload=True)")
    e.add_argument("--backend", default="nccl", help="the process group's backend: nccl (GPUs) or gloo (CPUs)")
    e.add_argument("--tensor-parallel-size", type=_world_size, default=1,
                   help="ranks splitting each layer by the model's tensor-parallel plan (a Hugging Face config's, or"
                   " --tensor-parallel-plan's); the data-parallel ranks are WORLD_SIZE / this")
    e.add_argument("--tensor-parallel-plan", default=None,
                   help="module:callable returning the plan for parallelize_module (a dict of parallel styles)")
    x = commands.add_parser(
        "export", help="write a checkpoint in another layout: Hugging Face (hf), peft adapters (peft), DCP (dcp), one"
        " Lightning .ckpt file (lightning), one GGUF file (gguf)"
    )
    x.add_argument("checkpoint_dir")
    x.add_argument("output_dir")
    x.add_argument("--format", choices=["hf", "peft", "dcp", "lightning", "gguf"], default=_EXPORT_FORMAT_DEFAULT,
                   help="output layout (hf: sharded safetensors + index, peft adapters merged into --base; peft:"
                   " adapter_model.safetensors + adapter_config.json for PeftModel.from_pretrained; dcp:"
                   " torch.distributed.checkpoint directory that ModelParallelStrategy resumes from, with the"
                   " optimizer state; lightning: one OUT.ckpt file for LightningModule.load_from_checkpoint; gguf: one"
                   " GGUF v3 OUT.gguf file for llama.cpp and transformers' GGUF loader, GPT-2 and Llama)")
    x.add_argument("--prefix", default=_EXPORT_OPTION_DEFAULTS["--prefix"],
                   help="the submodule whose keys are exported, without its name (e.g. 'model')")
    x.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "f32", "f16", "bf16", "q8_0"], default=None,
                   help="cast floating-point weights (f32, f16, bf16, q8_0: --format gguf)")
    x.add_argument("--max-shard-size", default=_EXPORT_OPTION_DEFAULTS["--max-shard-size"],
                   help="largest weight file, e.g. 5GB, 200MB or bytes")
    x.add_argument("--config", default=None,
                   help="a config.json to copy into OUTPUT_DIR (--format gguf: the model's, for its metadata)")
    x.add_argument("--tokenizer", default=None,
                   help="--format gguf: a Hugging Face tokenizer directory whose vocabulary goes into the file")
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT_DIR")
    x.add_argument("--weights", choices=["current", "averaged"], default=_EXPORT_OPTION_DEFAULTS["--weights"],
                   help="the model as trained, or the average a WeightAveraging callback kept (--format hf, peft)")
    x.add_argument("--adapter-config", default=None,
                   help="--format peft of a checkpoint that recorded no adapters: the LoRA adapter_config.json")
    x.add_argument("--adapter-name", default=None,
                   help="--format peft: the adapter to export (default: every recorded one; with --adapter-config:"
                   " 'default')")
    x.add_argument("--base", default=None,
                   help="--format hf of a checkpoint with peft adapters: the base model's Hugging Face directory"
                   " (default: the adapter config's base_model_name_or_path, when it is a local directory)")
    v = commands.add_parser(
        "convert", help="write a Lightning .ckpt (DDP, FSDP full) or a DCP directory as a lightning_shard checkpoint"
    )
    v.add_argument("source", help="a Lightning .ckpt file or a torch.distributed.checkpoint directory")
    v.add_argument("output_dir")
    v.add_argument("--module", default=None,
                   help="module:callable building the LightningModule that wrote a .ckpt (a class gets the"
                   " checkpoint's hyper_parameters), to name the parameters of its optimizer state")
    v.add_argument("--overwrite", action="store_true", help="replace a checkpoint directory at OUTPUT_DIR")
    return parser


# The export options that only some formats take, with their defaults (one source: the parser reads them here), and
# the format of a command without --format.
_EXPORT_FORMAT_DEFAULT = "hf"
_EXPORT_OPTION_DEFAULTS: dict[str, Any] = {
    "--prefix": "", "--dtype": None, "--config": None, "--max-shard-size": "5GB", "--weights": "current",
    "--adapter-config": None, "--adapter-name": None, "--base": None, "--tokenizer": None,
}


def _given(args: argparse.Namespace, *flags: str) -> list[str]:
    """Which of ``flags`` (export options) the command line set to something other than their default."""
    return [f for f in flags if getattr(args, f.lstrip("-").replace("-", "_")) != _EXPORT_OPTION_DEFAULTS[f]]


def _export(args: argparse.Namespace) -> int:
    from lightning_shard.checkpoint.interop import EXPORTERS

    exporter = EXPORTERS[args.format]
    refused = _refused_options(args, exporter)
    if refused:
        print(f"lightning-shard: {refused}", file=sys.stderr)
        return 2
    options = {name: getattr(args, name) for name in exporter.options}
    if "max_shard_size" in options and options["max_shard_size"].isdigit():  # bytes
        options["max_shard_size"] = int(options["max_shard_size"])
    result = exporter(args.checkpoint_dir, args.output_dir, overwrite=args.overwrite, **options)
    print(f"wrote {result.description} to {result.output}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _refused_options(args: argparse.Namespace, exporter: Any) -> str | None:
    """Why the export options given cannot go to the exporter of ``args.format``, or ``None``: options it does not
    take (for the default format, each named with the format that takes it: --format was likely left out), or one it
    needs."""
    from lightning_shard.checkpoint.interop import EXPORTERS

    def takes(other: Any, option: str) -> bool:  # option: "--prefix", or "--dtype q8_0" (the value given)
        name, _, value = option.partition(" ")
        return name.lstrip("-").replace("-", "_") in other.options and (not value or value in other.dtypes)

    given = _given(args, *_EXPORT_OPTION_DEFAULTS)
    if "dtype" in exporter.options and args.dtype not in (None, *exporter.dtypes):  # a value of another format's
        given[given.index("--dtype")] = f"--dtype {args.dtype}"
    misplaced = [option for option in given if not takes(exporter, option)]
    if not misplaced:
        return next((f"--format {args.format} needs --{name}, {what}." for name, what in exporter.needs
                     if getattr(args, name) is None), None)
    if args.format != _EXPORT_FORMAT_DEFAULT:
        scope = f", which writes {exporter.scope}" if exporter.scope else ""
        return f"{', '.join(misplaced)} do not apply to --format {args.format}{scope}."
    owner = {option: next(name for name, e in EXPORTERS.items() if takes(e, option)) for option in misplaced}
    return " ".join(f"{', '.join(o for o in misplaced if owner[o] == name)} only apply to --format {name}."
                    for name in dict.fromkeys(owner.values()))


def _convert(args: argparse.Namespace) -> int:
    from lightning_shard.checkpoint.convert import convert

    module = None
    if args.module is not None:
        module = _load_callable(args.module, "module")
        if module is None:
            return 2
    result = convert(args.source, args.output_dir, module=module, overwrite=args.overwrite)
    print(f"converted {result.description} into {result.output}")
    return 0


def _load_callable(spec: str, what: str) -> Any:
    """The callable ``module:attr`` names, or ``None`` after printing why it cannot be loaded. The current directory
    is importable, as with ``python -m`` and torchrun; other folders go on ``PYTHONPATH``."""
    import importlib

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    module_name, colon, attr = spec.partition(":")
    try:
        if not colon or not attr:
            raise ValueError("no ':callable' part")
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        print(f"lightning-shard: cannot load the {what} {spec!r} (module:callable): {err}. Modules are imported from"
              " the current directory and PYTHONPATH.", file=sys.stderr)
        return None


def _estimate(args: argparse.Namespace) -> int:
    import torch

    from lightning_shard.engine.estimate import estimate_memory

    factory = _load_callable(args.factory, "model factory")
    if factory is None:
        return 2
    plan = None
    if args.tensor_parallel_plan is not None:
        plan_factory = _load_callable(args.tensor_parallel_plan, "tensor-parallel plan")
        if plan_factory is None:
            return 2
        plan = plan_factory()
    with torch.device("meta"):
        model = factory()
    try:
        report = estimate_memory(model, args.world_size, args.sharding_strategy, args.precision, args.optimizer,
                                 auto_wrap_policy=args.wrap, cpu_offload=args.cpu_offload, backend=args.backend,
                                 tensor_parallel_size=args.tensor_parallel_size, tensor_parallel_plan=plan)
    except ValueError as err:  # an option the estimate refuses: its message names the valid values
        print(f"lightning-shard: {err}", file=sys.stderr)
        return 2
    print(report)
    return 0


def _world_size(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def run() -> None:
    """The console script: ``main``'s exit status; output cut short by a closed pipe (``| head``) ends quietly."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        status = 0
    sys.exit(status)


if __name__ == "__main__":
    run()
