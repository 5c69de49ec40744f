"""GGUF out and in (docs/gguf.md). A transformers GPT-2 and Llama trained 3 steps under ``ShardStrategy`` on 2 ranks are
exported with ``export_gguf`` (and, as users run it, with ``lightning-shard export --format gguf`` in a fresh process);
the references are the ``gguf`` package's own reader and transformers' GGUF loader
(``AutoModelForCausalLM.from_pretrained(directory, gguf_file=...)``), whose logits must equal the trained model's at
fp32 with ``assert_close``'s defaults. transformers builds a GGUF GPT-2 with 1,024 positions and takes its vocabulary
size from the file's tokens (50,257 without them), so the GPT-2 here has both."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import lightning as L
import pytest
import torch
import transformers
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_shard
from lightning_shard import CheckpointError, ShardStrategy
from lightning_shard.testing import run_on_ranks
from tests.fits import trainer_for

PROBE = torch.arange(24).reshape(2, 12) * 7 % 97  # the inputs the logits are compared on
STEPS = 3
Q8_0_LOGITS_ATOL = 0.05  # q8_0 keeps each weight within half of its block's step (max |w| / 254); measured 0.006


def gpt2_config() -> Any:
    return transformers.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=32, n_layer=2, n_head=2,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def llama_config() -> Any:
    return transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    tie_word_embeddings=False)


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config}
UNITS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}


class LitCausalLM(L.LightningModule):
    """A Hugging Face causal LM held as ``self.net`` (so ``--prefix net.``), trained on its own inputs."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        return self.net(input_ids=x, labels=x).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_and_save(rank: int, world_size: int, kind: str, ckpt: str) -> Tensor:
    """Train ``kind`` 3 steps, save the checkpoint directory ``ckpt``; the trained logits on ``PROBE``."""
    L.seed_everything(0)
    module = LitCausalLM(kind)
    trainer = trainer_for(ShardStrategy(auto_wrap_policy={UNITS[kind]}), world_size, STEPS)
    tokens = torch.randint(0, 97, (4 * world_size * STEPS, 12), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(tokens), batch_size=4))
    trainer.save_checkpoint(ckpt)
    module.net.eval()
    with torch.no_grad():
        return module.net(input_ids=PROBE).logits.detach().clone()


@functools.cache
def trained(kind: str) -> tuple[Path, Path, Tensor]:
    """``(checkpoint directory, config.json, trained logits on PROBE)``, trained once per test process."""
    root = Path(tempfile.mkdtemp(prefix=f"gguf-{kind}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    logits = run_on_ranks(fit_and_save, 2, kind, str(root / "ckpt"))
    torch.testing.assert_close(logits[0], logits[1])
    CONFIGS[kind]().to_json_file(str(root / "config.json"))
    return root / "ckpt", root / "config.json", logits[0]


def transformers_logits(path: Path) -> Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def reference_model(kind: str, dtype: torch.dtype | None = None) -> Any:
    """The trained model rebuilt from its checkpoint (``consolidate``), its 2-D weights rounded to ``dtype``."""
    from safetensors.torch import load_file

    ckpt, _, _ = trained(kind)
    out = Path(tempfile.mkdtemp(prefix="gguf-reference-"))
    try:
        state = load_file(str(lightning_shard.consolidate(ckpt, out / "model.safetensors")))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())
    weights = {k.removeprefix("net."): v for k, v in state.items()}
    if dtype is not None:
        weights = {k: v.to(dtype).float() if v.dim() == 2 else v for k, v in weights.items()}
    model.load_state_dict(weights, strict=False)  # a tied head is re-tied by the model
    return model.eval()


def logits_of(model: Any) -> Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


# Out #


def test_cli_export_in_a_fresh_process_loads_through_transformers_to_the_trained_logits(tmp_path: Path) -> None:
    ckpt, config, logits = trained("gpt2")
    out = tmp_path / "gpt2.gguf"
    command = Path(sys.executable).with_name("lightning-shard")
    done = subprocess.run([str(command), "export", str(ckpt), str(out), "--format", "gguf", "--prefix", "net.",
                           "--config", str(config)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert f"wrote 28 gpt2 tensors to {out}" in done.stdout
    torch.testing.assert_close(transformers_logits(out), logits)


def test_the_gguf_reader_finds_version_3_the_metadata_and_the_tensors_in_gguf_layout(tmp_path: Path) -> None:
    ckpt, config, _ = trained("gpt2")
    out = lightning_shard.export_gguf(ckpt, tmp_path / "m.gguf", config, prefix="net.").output
    reader = gguf.GGUFReader(out)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["GGUF.version"] == 3 and fields["general.architecture"] == "gpt2"
    assert (fields["gpt2.block_count"], fields["gpt2.embedding_length"], fields["gpt2.attention.head_count"],
            fields["gpt2.context_length"], fields["gpt2.feed_forward_length"]) == (2, 32, 2, 1024, 128)
    assert fields["tokenizer.ggml.model"] == "none" and fields["general.file_type"] == gguf.LlamaFileType.ALL_F32
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # the LM head is tied to token_embd: written once
    hf = reference_model("gpt2").state_dict()
    qkv = tensors["blk.1.attn_qkv.weight"]
    assert qkv.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(qkv.data.copy()), hf["transformer.h.1.attn.c_attn.weight"].t())  # Conv1D
    assert torch.equal(torch.from_numpy(tensors["token_embd.weight"].data.copy()), hf["transformer.wte.weight"])


def test_llama_export_loads_through_transformers_to_the_trained_logits(tmp_path: Path) -> None:
    ckpt, config, logits = trained("llama")
    result = lightning_shard.export_gguf(ckpt, tmp_path / "llama.gguf", config, prefix="net.")
    assert gguf.GGUFReader(result.output).fields["general.architecture"].contents() == "llama"
    assert "output.weight" in result.tensors  # an untied head
    torch.testing.assert_close(transformers_logits(result.output), logits)


def test_llama_q_and_k_rows_are_in_llama_cpps_rotary_order(tmp_path: Path) -> None:
    ckpt, config, _ = trained("llama")
    out = lightning_shard.export_gguf(ckpt, tmp_path / "llama.gguf", config, prefix="net.").output
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(out).tensors}
    hf = reference_model("llama").state_dict()
    k = hf["model.layers.0.self_attn.k_proj.weight"]  # 2 heads of 16 rows: llama.cpp pairs row i with row i + 8
    expected = k.reshape(2, 2, 8, 64).transpose(1, 2).reshape(32, 64)
    assert torch.equal(tensors["blk.0.attn_k.weight"], expected)
    assert not torch.equal(tensors["blk.0.attn_k.weight"], k)


@pytest.mark.parametrize(("dtype", "ggml", "rounded"), [
    ("f16", gguf.GGMLQuantizationType.F16, torch.float16),
    ("bf16", gguf.GGMLQuantizationType.BF16, torch.bfloat16),
])
def test_half_exports_are_the_trained_model_with_its_matrices_rounded(
    tmp_path: Path, dtype: str, ggml: Any, rounded: torch.dtype
) -> None:
    ckpt, config, _ = trained("llama")
    result = lightning_shard.export_gguf(ckpt, tmp_path / f"{dtype}.gguf", config, prefix="net.", dtype=dtype)
    assert result.tensors["blk.0.ffn_up.weight"] == ggml.name and result.tensors["output_norm.weight"] == "F32"
    torch.testing.assert_close(transformers_logits(result.output), logits_of(reference_model("llama", rounded)))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_q8_0_export_is_within_its_stated_tolerance(tmp_path: Path, kind: str) -> None:
    ckpt, config, logits = trained(kind)
    result = lightning_shard.export_gguf(ckpt, tmp_path / "q8.gguf", config, prefix="net.", dtype="q8_0")
    assert {result.tensors[n] for n in ("token_embd.weight", "blk.0.ffn_down.weight")} == {"Q8_0"}
    got = transformers_logits(result.output)
    assert not torch.equal(got, logits)  # quantised: not the same numbers
    torch.testing.assert_close(got, logits, rtol=0, atol=Q8_0_LOGITS_ATOL)


def byte_level_tokenizer(directory: Path) -> Any:
    """A small GPT-2-style byte-level BPE tokenizer trained here (no download), saved as transformers saves it."""
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(["the sharded model trains and exports to gguf files"] * 20, vocab_size=300,
                                special_tokens=["<|endoftext|>"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=trainer, bos_token="<|endoftext|>",
                                                     eos_token="<|endoftext|>")
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def test_a_tokenizer_directory_becomes_the_files_vocabulary(tmp_path: Path) -> None:
    ckpt, config, logits = trained("gpt2")
    tokenizer = byte_level_tokenizer(tmp_path / "tokenizer")
    result = lightning_shard.export_gguf(ckpt, tmp_path / "out" / "m.gguf", config, prefix="net.",
                                         tokenizer=tmp_path / "tokenizer")
    fields = {n: f for n, f in gguf.GGUFReader(result.output).fields.items()}
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 50257  # the tokenizer's tokens, padded to the embedding's
    assert fields["tokenizer.ggml.model"].contents() == "gpt2" and fields["tokenizer.ggml.merges"].contents()
    loaded = transformers.AutoTokenizer.from_pretrained(str(result.output.parent), gguf_file=result.output.name)
    text = "the model exports"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    torch.testing.assert_close(transformers_logits(result.output), logits)


def test_an_architecture_gguf_is_not_written_for_is_refused(tmp_path: Path) -> None:
    ckpt, _, _ = trained("gpt2")
    transformers.BertConfig().to_json_file(str(tmp_path / "bert.json"))
    with pytest.raises(CheckpointError, match="'bert' is not one GGUF is written or read for here.*gpt2, llama"):
        lightning_shard.export_gguf(ckpt, tmp_path / "m.gguf", tmp_path / "bert.json", prefix="net.")
    assert not (tmp_path / "m.gguf").exists()


def test_keys_that_are_not_the_hugging_face_models_are_refused_naming_them(tmp_path: Path) -> None:
    ckpt, config, _ = trained("gpt2")
    with pytest.raises(CheckpointError, match=r"no GGUF gpt2 name \(net\.transformer\.wte\.weight.*--prefix"):
        lightning_shard.export_gguf(ckpt, tmp_path / "m.gguf", config)  # the prefix forgotten
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_existing_file_is_replaced_only_with_overwrite(tmp_path: Path) -> None:
    ckpt, config, _ = trained("gpt2")
    (tmp_path / "m.gguf").write_text("old")
    with pytest.raises(CheckpointError, match="exists: pass overwrite=True"):
        lightning_shard.export_gguf(ckpt, tmp_path / "m.gguf", config, prefix="net.")
    lightning_shard.export_gguf(ckpt, tmp_path / "m.gguf", config, prefix="net.", overwrite=True)
    assert gguf.GGUFReader(tmp_path / "m.gguf").tensors


# In #


def exported(kind: str, dtype: str = "f32") -> Path:
    """The trained ``kind`` exported as GGUF once per test process."""
    return _exported(kind, dtype)


@functools.cache
def _exported(kind: str, dtype: str) -> Path:
    ckpt, config, _ = trained(kind)
    out = ckpt.parent / "gguf" / f"{kind}-{dtype}.gguf"
    return lightning_shard.export_gguf(ckpt, out, config, prefix="net.", dtype=dtype).output


class LitFromGguf(LitCausalLM):
    """The model built on the meta device, its weights loaded from a GGUF file in ``on_fit_start``; the logits on
    ``PROBE`` right after the load, and whether every parameter was split over the ranks."""

    def __init__(self, kind: str, path: str) -> None:
        L.LightningModule.__init__(self)
        self.kind, self.path = kind, path

    def configure_model(self) -> None:
        with torch.device("meta"):
            self.net = transformers.AutoModelForCausalLM.from_config(CONFIGS[self.kind]())

    def on_fit_start(self) -> None:
        self.result = lightning_shard.load_gguf_into(self, self.path, prefix="net.")
        engine = self.trainer.strategy.engine
        self.sharded = all(p.sharded.numel() < p.global_shape.numel() for p in engine.sharded_params())
        with torch.no_grad():
            self.loaded_logits = self.net.eval()(input_ids=PROBE).logits.detach().clone()
        self.net.train()


def fit_from_gguf(rank: int, world_size: int, kind: str, path: str) -> dict[str, Any]:
    L.seed_everything(0)
    module = LitFromGguf(kind, path)
    strategy = ShardStrategy(auto_wrap_policy={UNITS[kind]}, param_init="empty")
    tokens = torch.randint(0, 97, (4 * world_size, 12), generator=torch.Generator().manual_seed(2))
    trainer_for(strategy, world_size, 1).fit(module, train_dataloaders=DataLoader(TensorDataset(tokens), batch_size=4))
    return {"logits": module.loaded_logits, "sharded": module.sharded, "missing": module.result.missing_keys,
            "unexpected": module.result.unexpected_keys, "steps": module.trainer.global_step}


def test_a_trainer_fit_starts_from_a_gguf_file_each_rank_holding_its_rows() -> None:
    _, _, logits = trained("gpt2")
    for r in run_on_ranks(fit_from_gguf, 2, "gpt2", str(exported("gpt2"))):
        assert r["sharded"] and r["missing"] == [] and r["unexpected"] == [] and r["steps"] == 1
        torch.testing.assert_close(r["logits"], logits)


def fabric_from_gguf(rank: int, world_size: int, kind: str, path: str, save_to: str | None) -> Tensor:
    """Fabric: the Hugging Face model set up sharded, filled by ``fabric.load_raw`` from a GGUF file; its logits, and
    (with ``save_to``) a checkpoint of it."""
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    strategy = FabricShardStrategy(auto_wrap_policy={UNITS[kind]})
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()))
    fabric.load_raw(path, model)
    if save_to is not None:
        fabric.save(save_to, {"model": model})
    with torch.no_grad():
        return model.eval()(input_ids=PROBE).logits.detach().clone()


@pytest.mark.parametrize(("kind", "dtype"), [("llama", "f16"), ("llama", "bf16"), ("llama", "q8_0"), ("gpt2", "bf16"),
                                           ("gpt2", "q8_0")])
def test_fabric_loads_a_quantised_file_as_transformers_dequantises_it(kind: str, dtype: str) -> None:
    """Each rank reads part of every tensor: Llama's rows (its q/k rows out of llama.cpp's order), GPT-2's transposed
    weights as GGUF columns (of whole Q8_0 blocks: rank 1's half of c_attn starts inside the first block)."""
    path = exported(kind, dtype)
    expected = transformers_logits(path)
    for logits in run_on_ranks(fabric_from_gguf, 2, kind, str(path), None):
        torch.testing.assert_close(logits, expected)


@pytest.mark.parametrize(("kind", "dtype"), [("gpt2", "f32"), ("llama", "f32"), ("llama", "q8_0")])
def test_import_then_export_gives_the_same_file_tensors(tmp_path: Path, kind: str, dtype: str) -> None:
    path = exported(kind, dtype)
    run_on_ranks(fabric_from_gguf, 2, kind, str(path), str(tmp_path / "ckpt"))
    (tmp_path / "config.json").write_text(trained(kind)[1].read_text())
    again = lightning_shard.export_gguf(tmp_path / "ckpt", tmp_path / "again.gguf", tmp_path / "config.json",
                                        dtype=dtype).output
    before = {t.name: t for t in gguf.GGUFReader(path).tensors}
    after = {t.name: t for t in gguf.GGUFReader(again).tensors}
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert tensor.tensor_type == after[name].tensor_type, name
        assert tensor.data.tobytes() == after[name].data.tobytes(), name


def load_refused(rank: int, world_size: int, config: dict[str, Any], path: str, strict: bool = True) -> str:
    """The error ``load_gguf_into`` raises loading ``path`` into a sharded model of ``config``."""
    from lightning_shard.engine import shard_model

    net = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    shard_model(net, device="cpu")
    try:
        lightning_shard.load_gguf_into(net, path, strict=strict)
    except CheckpointError as err:
        return str(err)
    return "loaded"


def test_a_file_of_another_architecture_is_refused_naming_both() -> None:
    path = exported("llama")
    for message in run_on_ranks(load_refused, 2, gpt2_config().to_dict(), str(path)):
        assert message.endswith(f"The GGUF file {path} holds a llama model; the model under the prefix '' is a gpt2.")


def test_a_tensor_the_model_needs_that_the_file_lacks_is_named_with_the_file() -> None:
    path = exported("gpt2")
    deeper = {**gpt2_config().to_dict(), "n_layer": 3}
    for message in run_on_ranks(load_refused, 2, deeper, str(path)):
        assert (f"The GGUF file {path} has no tensor 'blk.2.attn_norm.weight' (the model's"
                " 'transformer.h.2.ln_1.weight')") in message, message


def test_a_tensor_of_another_shape_is_named_with_the_file() -> None:
    path = exported("gpt2")
    narrower = {**gpt2_config().to_dict(), "n_embd": 16}
    for message in run_on_ranks(load_refused, 2, narrower, str(path)):
        assert f"The GGUF file {path} does not match the model's shapes: tensor 'token_embd.weight' holds" \
               " [50257, 32] for the model's 'transformer.wte.weight', which is [50257, 16]" in message


# Hostile and damaged files #


def small_gguf(path: Path, quantisation: Any = None) -> Path:
    """A valid GGUF file of two small tensors and an array, written by the ``gguf`` package."""
    import numpy as np

    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    values = np.arange(4 * 32, dtype=np.float32).reshape(4, 32)
    if quantisation is None:
        writer.add_tensor("token_embd.weight", values)
    else:
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(values, quantisation), raw_dtype=quantisation)
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patched(path: Path, offset: int, value: int, fmt: str = "<Q") -> Path:
    import struct

    data = bytearray(path.read_bytes())
    data[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    out = path.with_name(f"patched-{offset}.gguf")
    out.write_bytes(bytes(data))
    return out


def tensor_field_offset(path: Path, tensor: str, part: str) -> int:
    """Where, in ``path``, the tensor table entry of ``tensor`` holds ``part`` ("type" or "offset")."""
    entry = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor).field
    name_len, name, n_dims, dims = entry.parts[:4]
    at_type = entry.offset + name_len.nbytes + name.nbytes + n_dims.nbytes + dims.nbytes
    return int(at_type if part == "type" else at_type + 4)


def refusal(path: Path) -> str:
    from lightning_shard.checkpoint.interop.gguf import read_gguf

    with pytest.raises(CheckpointError) as raised:
        read_gguf(path)
    assert str(path) in str(raised.value)  # every refusal names the file
    return str(raised.value)


def test_a_valid_small_file_reads(tmp_path: Path) -> None:
    from lightning_shard.checkpoint.interop.gguf import read_gguf

    file = read_gguf(small_gguf(tmp_path / "ok.gguf"))
    assert file.architecture == "gpt2" and sorted(file.tensors) == ["output_norm.weight", "token_embd.weight"]


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    ok = small_gguf(tmp_path / "ok.gguf")
    expected = {30: "claims 3 metadata pairs; the file holds at most 0",  # cut in the header
                ok.stat().st_size - 100: "past the end of the file"}  # cut in the tensor data
    for size, message in expected.items():
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(ok.read_bytes()[:size])
        assert message in refusal(cut)


def test_absurd_counts_and_lengths_are_refused_before_they_are_walked(tmp_path: Path) -> None:
    import time

    ok = small_gguf(tmp_path / "ok.gguf")
    tokens = gguf.GGUFReader(ok).fields["tokenizer.ggml.tokens"]
    array_count = tokens.offset + 8 + len("tokenizer.ggml.tokens") + 4 + 4
    cases = {
        (16, 2**62): "claims 4611686018427387904 metadata pairs",  # the header's kv count
        (8, 2**40): "claims 1099511627776 tensors",  # the header's tensor count
        (24, 2**62): "past the end of the file",  # the first key's length
        (array_count, 2**40): "claims an array of 1099511627776 values",
    }
    for (offset, value), expected in cases.items():
        started = time.monotonic()
        assert expected in refusal(patched(ok, offset, value))
        assert time.monotonic() - started < 1.0  # bounded work: nothing walked


def test_tensor_data_beyond_the_file_or_overlapping_is_refused(tmp_path: Path) -> None:
    ok = small_gguf(tmp_path / "ok.gguf")
    beyond = patched(ok, tensor_field_offset(ok, "output_norm.weight", "offset"), 2**40)
    assert "the data of tensor 'output_norm.weight' (bytes" in refusal(beyond)
    assert "goes past the end of the file" in refusal(beyond)
    overlapping = patched(ok, tensor_field_offset(ok, "output_norm.weight", "offset"), 0)
    assert "the data of tensors 'output_norm.weight' and 'token_embd.weight' overlap" in refusal(overlapping)


def test_unknown_and_unread_tensor_types_are_refused(tmp_path: Path) -> None:
    ok = small_gguf(tmp_path / "ok.gguf")
    unknown = patched(ok, tensor_field_offset(ok, "token_embd.weight", "type"), 999, "<I")
    assert "tensor 'token_embd.weight' has the unknown type 999" in refusal(unknown)
    q4 = small_gguf(tmp_path / "q4.gguf", gguf.GGMLQuantizationType.Q4_0)
    assert "tensors of a type not read here: token_embd.weight (Q4_0); the types read are F32, F16, BF16, Q8_0" \
        in refusal(q4)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(60))
    assert "is not a GGUF file" in refusal(tmp_path / "x.gguf")


def test_an_architecture_not_read_is_refused_on_every_rank(tmp_path: Path) -> None:
    import numpy as np

    writer = gguf.GGUFWriter(tmp_path / "bert.gguf", "bert")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for message in run_on_ranks(load_refused, 2, gpt2_config().to_dict(), str(tmp_path / "bert.gguf")):
        assert "the architecture 'bert' is not one GGUF is written or read for here" in message, message


def test_a_gguf_file_given_as_a_checkpoint_says_how_to_load_it(tmp_path: Path) -> None:
    from lightning_shard.checkpoint.open import detect

    with pytest.raises(CheckpointError, match=r"It looks like a GGUF model file: .*load_gguf_into"):
        detect(small_gguf(tmp_path / "m.gguf"))


def test_the_command_refuses_gguf_options_elsewhere_and_gguf_without_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_shard.cli import main

    assert main(["export", "ckpt", str(tmp_path / "hf"), "--dtype", "q8_0"]) == 2
    assert "--dtype q8_0 only apply to --format gguf" in capsys.readouterr().err
    assert main(["export", "ckpt", str(tmp_path / "hf"), "--tokenizer", "tok"]) == 2
    assert "--tokenizer only apply to --format gguf" in capsys.readouterr().err
    assert main(["export", "ckpt", str(tmp_path / "m.gguf"), "--format", "gguf"]) == 2
    assert "--format gguf needs --config, the model's config.json" in capsys.readouterr().err
    assert main(["export", "ckpt", str(tmp_path / "m.gguf"), "--format", "gguf", "--base", "b", "--config", "c"]) == 2
    assert "--base do not apply to --format gguf" in capsys.readouterr().err


def save_untrained(rank: int, world_size: int, config: dict[str, Any], path: str) -> None:
    from lightning_shard.fabric import ShardStrategy as FabricShardStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=FabricShardStrategy())
    fabric.launch()
    net = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    fabric.save(path, {"model": fabric.setup_module(net)})


def test_q8_0_falls_back_to_f16_by_the_rows_gguf_stores(tmp_path: Path) -> None:
    """GPT-2's Conv1D weights are stored transposed: whether their rows fill whole Q8_0 blocks is decided on the
    stored rows (n_embd = 48 values: f16), not on the Hugging Face ones (3 x 48 = 144 for c_attn, 4 x 48 for c_fc)."""
    config = {**gpt2_config().to_dict(), "n_embd": 48}
    run_on_ranks(save_untrained, 2, config, str(tmp_path / "ckpt"))
    transformers.AutoConfig.for_model(**config).to_json_file(str(tmp_path / "config.json"))
    result = lightning_shard.export_gguf(tmp_path / "ckpt", tmp_path / "q8.gguf", tmp_path / "config.json",
                                         dtype="q8_0")
    assert result.tensors["blk.0.attn_qkv.weight"] == result.tensors["blk.0.ffn_up.weight"] == "F16"
    assert result.tensors["blk.0.ffn_down.weight"] == "Q8_0"  # stored rows of 4 x 48 = 192 values
    assert gguf.GGUFReader(result.output).tensors
