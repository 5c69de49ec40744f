"""Checkpoints on object storage: saves and loads through fsspec URLs, over the real S3 protocol (moto's server on
127.0.0.1, ``tests/s3_server.py``) and ``memory://``. See [Note: committing to object storage]."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_shard.checkpoint import load_checkpoint, save_checkpoint
from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.checkpoint.io.storage import RemoteDirectory
from lightning_shard.engine import shard_model
from lightning_shard.testing import run_on_ranks
from tests.checkpoint_fits import fit, global_losses, module_full_state
from tests.checkpoint_scaling_fits import with_layout
from tests.models import GPTBlock, TinyGPT, make_dataset
from tests.s3_server import S3Server, running_s3_server

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with running_s3_server() as server:
        fs = _s3fs(server.env)
        fs.mkdir(BUCKET)
        yield server


def _options(env: dict[str, str], tag: str | None = None) -> dict[str, Any]:
    """s3fs options reaching the test server; ``tag`` marks this client's requests for the server's counts."""
    options: dict[str, Any] = {
        "key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"], "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": env["AWS_ENDPOINT_URL"]},
    }  # fmt: skip
    if tag is not None:
        options["config_kwargs"] = {"user_agent_extra": f"tag/{tag}"}
    return options


def _s3fs(env: dict[str, str]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**_options(env))


def _objects(env: dict[str, str], prefix: str) -> list[str]:
    fs = _s3fs(env)
    try:
        return sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/{prefix}", refresh=True))
    except FileNotFoundError:
        return []


def _use_server(env: dict[str, str]) -> None:
    """In a rank worker: reach the server through the usual environment variables (as a job would)."""
    os.environ.update(env)


def _model(seed: int, width: int = 16) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(d=width)
    shard_model(model, auto_wrap_policy={GPTBlock})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: TinyGPT, optimizer: torch.optim.Optimizer, rank: int) -> None:
    x, y = make_dataset("gpt")[rank * 3 : rank * 3 + 3]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def train_and_save(
    rank: int, world_size: int, url: str, options: dict[str, Any] | None, steps: int = 1, width: int = 16
) -> dict:
    model, optimizer = _model(0, width)
    for _ in range(steps):
        _step(model, optimizer, rank)
    save_checkpoint(url, model, [optimizer], {"step": steps}, storage_options=options)
    return module_full_state(model, [optimizer])


def load_and_report(rank: int, world_size: int, url: str, options: dict[str, Any] | None) -> dict:
    model, optimizer = _model(1)  # other weights: everything must come from the checkpoint
    values, result = load_checkpoint(url, model, [optimizer], storage_options=options)
    return {"values": values, "missing": result.missing_keys, "state": module_full_state(model, [optimizer])}


def _assert_same_state(loaded: dict, saved: dict) -> None:
    for part in ("params", "optimizer"):
        for name, t in saved[part].items():
            torch.testing.assert_close(loaded[part][name], t, rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------------------------------
# memory:// (one process)
# --------------------------------------------------------------------------------------------------


def memory_round_trip(rank: int, world_size: int, url: str, cwd: str) -> dict:
    os.chdir(cwd)
    saved = train_and_save(rank, world_size, url, None)
    names = RemoteDirectory(url).names()
    loaded = load_and_report(rank, world_size, url, None)
    return {"saved": saved, "loaded": loaded, "names": names}


def test_a_memory_url_saves_and_loads_through_fsspec_and_writes_nothing_local(tmp_path: Path) -> None:
    (r,) = run_on_ranks(memory_round_trip, 1, "memory://runs/job/ck", str(tmp_path))
    assert "index.json" in r["names"] and len(r["names"]) == 4  # index, one shard, the trainer state's two files
    assert all(n == "index.json" or n.split(".", 1)[0].isalnum() for n in r["names"])  # "<save-id>.<file>"
    assert r["loaded"]["values"] == {"step": 1} and r["loaded"]["missing"] == []
    _assert_same_state(r["loaded"]["state"], r["saved"])
    assert list(tmp_path.iterdir()) == []  # no directory named "memory:"


def save_to_missing_protocol(rank: int, world_size: int, url: str, cwd: str) -> str:
    os.chdir(cwd)
    model, optimizer = _model(0)
    try:
        save_checkpoint(url, model, [optimizer])
    except CheckpointError as err:
        return str(err)
    return ""


def test_a_protocol_whose_package_is_missing_is_refused_naming_it_and_nothing_is_written(tmp_path: Path) -> None:
    for message in run_on_ranks(save_to_missing_protocol, 2, "gs://bucket/run/ck", str(tmp_path)):
        assert "gs://" in message and "gcsfs" in message
    assert list(tmp_path.iterdir()) == []  # no "gs:" directory


# --------------------------------------------------------------------------------------------------
# The S3 protocol
# --------------------------------------------------------------------------------------------------


def test_a_checkpoint_saved_on_2_ranks_to_s3_loads_on_3(s3: S3Server, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"s3://{BUCKET}/engine/ck"
    saved = run_on_ranks(train_and_save, 2, url, _options(s3.env))[0]
    names = _objects(s3.env, "engine/ck")
    assert "index.json" in names and sum(n.endswith(".safetensors") for n in names) == 3  # 2 shards + trainer state
    for r in run_on_ranks(load_and_report, 3, url, _options(s3.env)):
        assert r["values"] == {"step": 1}
        _assert_same_state(r["state"], saved)
    assert not (tmp_path / "s3:").exists()


def load_refused_on_s3(rank: int, world_size: int, url: str, options: dict[str, Any]) -> dict:
    model, optimizer = _model(1)
    _step(model, optimizer, rank)
    before = module_full_state(model, [optimizer])
    try:
        load_checkpoint(url, model, [optimizer], storage_options=options)
        error = ""
    except CheckpointError as err:
        error = str(err)
    return {"error": error, "before": before, "after": module_full_state(model, [optimizer])}


def test_a_flipped_byte_in_an_object_is_refused_at_the_writers_world_size_and_another(s3: S3Server) -> None:
    """The bytes of one object of a shard file changed (its size kept): every load of it, on 2 ranks or 3, refuses
    it on every rank, naming it, and leaves the model and the optimizer as they were."""
    url = f"s3://{BUCKET}/engine/flipped"
    run_on_ranks(train_and_save, 2, url, _options(s3.env))
    fs = _s3fs(s3.env)
    (shard,) = [n for n in _objects(s3.env, "engine/flipped") if n.endswith("shard-00000-of-00002.safetensors")]
    data = bytearray(fs.cat(f"{BUCKET}/engine/flipped/{shard}"))
    data[-3] ^= 0x01  # in the last tensor of rank 0's file, which holds this small model's tensors whole
    fs.pipe(f"{BUCKET}/engine/flipped/{shard}", bytes(data))
    for world_size in (2, 3):
        for r in run_on_ranks(load_refused_on_s3, world_size, url, _options(s3.env)):
            assert f"{url}/{shard} is corrupted" in r["error"], r["error"]
            _assert_same_state(r["after"], r["before"])


def save_with_a_failure(rank: int, world_size: int, url: str, env: dict[str, str], where: str) -> str:
    """A save whose upload fails: on rank 1's data file (``"data"``), or at the commit, once every data file is
    uploaded (``"index"``: a save killed just before its index)."""
    from lightning_shard.checkpoint.io import storage

    _use_server(env)
    put_file, write_bytes = storage.RemoteDirectory.put_file, storage.RemoteDirectory.write_bytes

    def failing_put(self: Any, local: Path, name: str) -> None:
        if where == "data" and rank == 1:
            raise OSError("connection reset during upload")
        put_file(self, local, name)

    def failing_write(self: Any, name: str, data: bytes) -> None:
        if where == "index":
            raise OSError("killed before the commit")
        write_bytes(self, name, data)

    storage.RemoteDirectory.put_file = failing_put  # type: ignore[method-assign]
    storage.RemoteDirectory.write_bytes = failing_write  # type: ignore[method-assign]
    try:
        train_and_save(rank, world_size, url, _options(env), steps=2)
    except CheckpointError as err:
        return str(err)
    finally:
        storage.RemoteDirectory.put_file, storage.RemoteDirectory.write_bytes = put_file, write_bytes
    return ""


@pytest.mark.parametrize("where", ["data", "index"])
def test_a_save_that_fails_mid_upload_leaves_the_previous_checkpoint_loadable(s3: S3Server, where: str) -> None:
    url = f"s3://{BUCKET}/partial-{where}/ck"
    first = run_on_ranks(train_and_save, 2, url, _options(s3.env))[0]
    before = _objects(s3.env, f"partial-{where}/ck")
    for message in run_on_ranks(save_with_a_failure, 2, url, s3.env, where):
        assert "connection reset" in message or "killed before the commit" in message
    after = _objects(s3.env, f"partial-{where}/ck")
    assert set(before) <= set(after)  # nothing of the committed checkpoint was overwritten or removed
    if where == "index":
        assert len(after) > len(before)  # the dead save's data files are there, named by no index
    for r in run_on_ranks(load_and_report, 2, url, _options(s3.env)):
        assert r["values"] == {"step": 1}
        _assert_same_state(r["state"], first)
    second = run_on_ranks(train_and_save, 2, url, _options(s3.env), 3)[0]  # the next save cleans up
    assert len(_objects(s3.env, f"partial-{where}/ck")) == len(before)
    for r in run_on_ranks(load_and_report, 2, url, _options(s3.env)):
        assert r["values"] == {"step": 3}
        _assert_same_state(r["state"], second)


def load_uncommitted(rank: int, world_size: int, url: str, env: dict[str, str]) -> str:
    try:
        load_and_report(rank, world_size, url, _options(env))
    except CheckpointError as err:
        return str(err)
    return ""


def test_a_directory_without_its_index_is_ignored_saying_the_save_did_not_complete(s3: S3Server) -> None:
    url = f"s3://{BUCKET}/uncommitted/ck"
    run_on_ranks(save_with_a_failure, 2, url, s3.env, "index")
    assert _objects(s3.env, "uncommitted/ck")  # data files uploaded, no index
    for message in run_on_ranks(load_uncommitted, 2, url, s3.env):
        assert "the save there did not complete" in message and "no index.json" in message


def load_tagged(rank: int, world_size: int, url: str, env: dict[str, str]) -> int:
    model, optimizer = _model(1, width=128)
    load_checkpoint(url, model, [optimizer], storage_options=_options(env, f"rank-{rank}"))
    return 0


def test_a_sharded_load_downloads_about_each_ranks_share(s3: S3Server) -> None:
    url = f"s3://{BUCKET}/bytes/ck"
    # 4.8 MB: the index and headers are ~1% of it. Every tensor split by rows: by default this model's tensors (each
    # under 128 KiB) are stored whole, and a rank needing half of one reads the 64 KiB blocks that hold its half
    split = {"SPLIT_PIECE_MIN_BYTES": 0}
    run_on_ranks(with_layout, 2, split, train_and_save, url, _options(s3.env), 1, 128)
    sizes = {p.rsplit("/", 1)[1]: size for p, size in _s3fs(s3.env).du(f"{BUCKET}/bytes/ck", total=False).items()}
    share = sum(sizes.values()) / 2
    s3.reset_counts()
    run_on_ranks(load_tagged, 2, url, s3.env)
    counts = s3.counts()
    for rank in range(2):
        downloaded = counts[f"rank-{rank}"]["bytes"]
        assert 0 < downloaded <= 1.2 * share, (rank, downloaded, share, sizes)
        print(f"rank {rank}: downloaded {downloaded} bytes; its share {share:.0f} bytes ({downloaded / share:.2f}x)")


def fit_on_s3(rank: int, world_size: int, env: dict[str, str], url: str, epochs: int, resume: str | None,
              trainer_kwargs: dict | None = None) -> dict[str, Any]:  # fmt: skip
    _use_server(env)
    return fit(rank, world_size, url, epochs, resume, trainer_kwargs=trainer_kwargs)


def test_trainer_resume_from_s3_on_3_ranks_matches_the_uninterrupted_run(
    s3: S3Server, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    uninterrupted = run_on_ranks(fit, 2, str(tmp_path / "local"), 2)
    run_on_ranks(fit_on_s3, 2, s3.env, f"s3://{BUCKET}/fit", 1, None)
    assert "index.json" in _objects(s3.env, "fit/last.ckpt")
    resumed = run_on_ranks(fit_on_s3, 3, s3.env, f"s3://{BUCKET}/fit-resumed", 2, f"s3://{BUCKET}/fit/last.ckpt")
    torch.testing.assert_close(global_losses(resumed), global_losses(uninterrupted)[8:], rtol=0, atol=1e-5)
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "s3").exists()


def test_background_saves_upload_to_s3(s3: S3Server, tmp_path: Path, monkeypatch: Any) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    monkeypatch.chdir(tmp_path)
    results = run_on_ranks(fit_on_s3, 2, s3.env, f"s3://{BUCKET}/async", 1, None,
                           {"plugins": [AsyncCheckpointIO()]})  # fmt: skip
    assert "index.json" in _objects(s3.env, "async/last.ckpt")
    for r in run_on_ranks(load_trainer_end, 2, s3.env, f"s3://{BUCKET}/async/last.ckpt"):
        for name, t in results[0]["end"]["params"].items():
            torch.testing.assert_close(r[name], t, msg=name)
    assert not (tmp_path / "s3:").exists()


def load_trainer_end(rank: int, world_size: int, env: dict[str, str], url: str) -> dict[str, torch.Tensor]:
    _use_server(env)
    torch.manual_seed(1)
    wrapper = torch.nn.Module()  # keys as the LightningModule has them: "model.<name>"
    wrapper.model = TinyGPT()
    shard_model(wrapper, auto_wrap_policy={GPTBlock})
    load_checkpoint(url, wrapper, [])
    return module_full_state(wrapper, [])["params"]


def top_k_on_s3(rank: int, world_size: int, env: dict[str, str], url: str) -> list[str]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_shard import ShardStrategy
    from tests.checkpoint_fits import Snapshots

    _use_server(env)
    L.seed_everything(0)
    callback = ModelCheckpoint(dirpath=url, save_top_k=1, save_last=True, monitor="step", mode="max",
                               every_n_train_steps=2)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=ShardStrategy(auto_wrap_policy={"GPTBlock"}), max_steps=4,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(Snapshots("gpt"), train_dataloaders=DataLoader(make_dataset("gpt"), batch_size=6))
    dist.barrier()
    return [callback.best_model_path, callback.last_model_path]


def test_model_checkpoint_on_s3_keeps_the_top_k_and_last(s3: S3Server, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    best, last = run_on_ranks(top_k_on_s3, 2, s3.env, f"s3://{BUCKET}/topk")[0]
    fs = _s3fs(s3.env)
    dirs = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/topk", refresh=True))
    assert dirs == sorted({best.rsplit("/", 1)[1], last.rsplit("/", 1)[1]})  # step 2's checkpoint was deleted
    assert "step=4" in best
    for name in dirs:
        assert "index.json" in _objects(s3.env, f"topk/{name}")
    assert not (tmp_path / "s3:").exists()


def test_the_cli_inspects_and_consolidates_a_checkpoint_on_s3(
    s3: S3Server, tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    from safetensors.torch import load_file

    from lightning_shard.cli import main

    url = f"s3://{BUCKET}/cli/ck"
    saved = run_on_ranks(train_and_save, 2, url, _options(s3.env))[0]
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    assert main(["inspect", url]) == 0
    assert "verified: OK" in capsys.readouterr().out
    assert main(["consolidate", url, str(tmp_path / "model.safetensors")]) == 0
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert set(weights) and set(weights) <= set(saved["params"])  # a tied weight is stored once
    for name, t in weights.items():
        torch.testing.assert_close(t, saved["params"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tool", ["export_hf", "export_dcp", "convert", "load_from_checkpoint"])
def test_tools_that_read_local_files_refuse_a_url_naming_it(tool: str, tmp_path: Path, monkeypatch: Any) -> None:
    """A URL given to a tool that works on local files is refused with a message; it is never taken for a local path
    (``s3://bucket/ck`` as the relative directory ``s3:/bucket/ck``), and nothing is written."""
    from lightning_shard import export_hf, load_from_checkpoint
    from lightning_shard.checkpoint.convert import convert
    from lightning_shard.checkpoint.interop.dcp import export_dcp
    from tests.models import LitModel

    monkeypatch.chdir(tmp_path)
    calls = {
        "export_hf": lambda: export_hf("s3://bucket/ck", tmp_path / "out"),
        "export_dcp": lambda: export_dcp("s3://bucket/ck", tmp_path / "out"),
        "convert": lambda: convert("s3://bucket/ddp.ckpt", tmp_path / "out"),
        "load_from_checkpoint": lambda: load_from_checkpoint(LitModel, "s3://bucket/ck"),
    }
    with pytest.raises(CheckpointError, match=r"works on local paths, and 's3://bucket/.*' is a URL"):
        calls[tool]()
    assert list(tmp_path.iterdir()) == []


def save_resume_remove_with_strategy_options(rank: int, world_size: int, options: dict[str, Any], url: str) -> bool:
    """A Trainer whose ShardStrategy carries the storage options, with no credentials or endpoint in the environment:
    it saves to ``url``, a second fit resumes from it, and ``remove_checkpoint`` deletes it."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_shard import ShardStrategy
    from tests.checkpoint_fits import Snapshots

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        os.environ.pop(name, None)  # a pooled worker may hold them from another test

    def trainer(steps: int) -> L.Trainer:
        strategy = ShardStrategy(auto_wrap_policy={"GPTBlock"}, storage_options=options)
        return L.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip

    L.seed_everything(0)
    first = trainer(2)
    first.fit(Snapshots("gpt"), train_dataloaders=DataLoader(make_dataset("gpt"), batch_size=6))
    first.save_checkpoint(url)
    second = trainer(3)
    second.fit(Snapshots("gpt"), train_dataloaders=DataLoader(make_dataset("gpt"), batch_size=6), ckpt_path=url)
    resumed_at = second.global_step
    second.strategy.remove_checkpoint(url)
    dist.barrier()
    return resumed_at == 3


def test_the_strategys_storage_options_reach_saves_loads_and_removals(s3: S3Server) -> None:
    url = f"s3://{BUCKET}/options/ck"
    assert run_on_ranks(save_resume_remove_with_strategy_options, 2, _options(s3.env), url) == [True, True]
    assert _objects(s3.env, "options/ck") == []  # removed through the same options


def test_storage_options_must_be_a_dict() -> None:
    from lightning_shard import ShardStrategy

    with pytest.raises(TypeError, match="storage_options must be a dict of fsspec options or None, got str"):
        ShardStrategy(storage_options="anon")  # type: ignore[arg-type]


def test_storage_options_beside_a_remote_directory_are_refused_not_ignored() -> None:
    with pytest.raises(TypeError, match="storage_options were given with memory://runs/x, a RemoteDirectory"):
        load_checkpoint(RemoteDirectory("memory://runs/x"), torch.nn.Linear(2, 2), storage_options={"anon": True})


def averaged_full_saves_and_removal(rank: int, world_size: int, env: dict[str, str], url: str) -> list[list[str]]:
    """A fit with EMA weight averaging and ``state_dict_type="full"`` saves to ``url`` twice (the second save replaces
    the first), then ``remove_checkpoint`` deletes it; the objects there after each step (rank 0)."""
    import lightning as L
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from torch.utils.data import DataLoader

    from lightning_shard import ShardStrategy
    from tests.checkpoint_fits import Snapshots

    _use_server(env)
    L.seed_everything(0)
    strategy = ShardStrategy(auto_wrap_policy={"GPTBlock"}, state_dict_type="full")
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[EMAWeightAveraging(decay=0.8)],
    )  # fmt: skip
    trainer.fit(Snapshots("gpt"), train_dataloaders=DataLoader(make_dataset("gpt"), batch_size=6))
    seen = []
    for _ in range(2):
        trainer.save_checkpoint(url)
        dist.barrier()
        seen.append(_objects(env, url.removeprefix(f"s3://{BUCKET}/")))
    trainer.strategy.remove_checkpoint(url)
    dist.barrier()
    seen.append(_objects(env, url.removeprefix(f"s3://{BUCKET}/")))
    return seen


def test_a_full_save_with_averaged_weights_on_s3_is_replaced_and_removed_whole(s3: S3Server) -> None:
    """The averaged weights' file is one of the save's own objects: under its save id, named by the index, replaced
    by the next save there and deleted by a removal."""
    first, second, removed = run_on_ranks(averaged_full_saves_and_removal, 2, s3.env, f"s3://{BUCKET}/ema/ck")[0]
    for objects in (first, second):
        assert any(name.endswith(".average.safetensors") for name in objects), objects
        assert "average.safetensors" not in objects  # every data object carries its save's id
        save_ids = {name.split(".", 1)[0] for name in objects if name != "index.json"}
        assert len(save_ids) == 1, objects  # nothing of the first save is left beside the second
    assert removed == []
