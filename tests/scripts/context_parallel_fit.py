"""Context parallelism run the way a user runs it: a fresh script under Lightning's launcher (``python``), where
``ShardStrategy`` itself creates the process group. Each role is one launch:

    python tests/scripts/context_parallel_fit.py --role reference --devices 2 --root /tmp/cp   # DDP on 2, the oracle
    python tests/scripts/context_parallel_fit.py --role cp --devices 4 --root /tmp/cp          # (dp=2, cp=2)

(``tests/test_context_parallel_launch.py`` calls ``fit("reference", 2, ...)`` on its pooled ranks instead: the oracle
needs no fresh process.)

Both train the test suite's causal language model (SDPA attention, position ids from the batch) and Hugging Face
Llama for 10 steps in fp32, on the same global batches. Every rank writes ``<root>/<role>-<rank>.pt``: the losses
``training_step`` returned on that rank and the trained weights.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

import lightning_shard  # noqa: E402
from tests.context_parallel_models import Block, LitCausalLM, LitLlama, token_loader  # noqa: E402


def fit(role: str, devices: int, llama: bool) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = LitLlama() if llama else LitCausalLM()
    if role == "reference":
        strategy: Any = DDPStrategy()
    else:
        unit = LlamaDecoderLayer if llama else Block
        strategy = lightning_shard.ShardStrategy(auto_wrap_policy={unit}, context_parallel_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=10, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, train_dataloaders=token_loader())
    if role == "reference":
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
    else:
        with lightning_shard.summon_full_params(module):
            params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"losses": module.losses, "params": params}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["reference", "cp"], required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    created = not dist.is_initialized()
    result = {"gpt": fit(args.role, args.devices, llama=False), "llama": fit(args.role, args.devices, llama=True)}
    result["created"] = created
    args.root.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.root / f"{args.role}-{dist.get_rank()}.pt")
