"""The ``lightning-shard`` command.

    lightning-shard consolidate CKPT_DIR OUT.safetensors   # one model file, loadable with safetensors
    lightning-shard inspect CKPT_DIR                       # world size, step, tensors, checksum verification
"""

from __future__ import annotations

import argparse
import sys

from lightning_shard.checkpoint_format import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-shard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("consolidate", help="write a checkpoint's model as one .safetensors file")
    c.add_argument("checkpoint_dir")
    c.add_argument("output")
    i = commands.add_parser("inspect", help="summarise a checkpoint directory and verify its checksums")
    i.add_argument("checkpoint_dir")
    i.add_argument("--no-verify", action="store_true", help="skip reading every file to check its checksum")
    args = parser.parse_args(argv)
    from lightning_shard.consolidate import consolidate, inspect

    try:
        if args.command == "consolidate":
            print(f"wrote {consolidate(args.checkpoint_dir, args.output)}")
            return 0
        summary = inspect(args.checkpoint_dir, verify=not args.no_verify)
        print(summary)
        return 1 if summary.problems else 0
    except CheckpointError as err:
        print(f"lightning-shard: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
