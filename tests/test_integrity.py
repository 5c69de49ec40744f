"""Every byte that decides what a load produces is verified: a seeded generator alters a 2-rank save one way at a time
(bit flips in every region of every file, truncations, appended bytes, deleted files, stale files of an earlier save,
edited index, trainer-state and header fields, reordered lists, swapped tensor offsets, removed and renamed keys) and
each altered checkpoint is loaded at world sizes 2 and 3, from local files and from S3.

The outcome of each is one of two: the load is refused on every rank with the same ``CheckpointError``, naming the
altered file, and leaves every rank's model and optimizer as they were; or (an alteration that changes nothing a load
reads, such as the index's formatting) it loads exactly what the unaltered checkpoint loads. ``inspect`` agrees: it
reports damage exactly where the load refuses. See [Note: what a load verifies]."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_shard import inspect
from lightning_shard.checkpoint import load_checkpoint, save_checkpoint
from lightning_shard.checkpoint.format import CheckpointError
from lightning_shard.engine import shard_model
from lightning_shard.testing import run_on_ranks
from tests.checkpoint_fits import module_full_state
from tests.models import GPTBlock, TinyGPT, make_dataset
from tests.s3_server import S3Server, running_s3_server

SEED = 20261206
INDEX = "index.json"
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.safetensors"
SHARDS = ("shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors")
BUCKET = "integrity"


# --------------------------------------------------------------------------------------------------
# The ranks' side: save, and load each altered checkpoint into a model that has trained a step
# --------------------------------------------------------------------------------------------------


def _model(rank: int, seed: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    """A sharded TinyGPT whose embedding (2,048 x 16) is split by rows over the shard files (the other tensors are
    stored whole), after one AdamW step: its optimizer holds state a refused load must leave alone."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab=2048, d=16)
    shard_model(model, auto_wrap_policy={GPTBlock})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    x, y = make_dataset("gpt")[rank * 3 : rank * 3 + 3]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def save_two(rank: int, world_size: int, base: str, stale: str, env: dict[str, str] | None = None) -> None:
    """The checkpoint under test (``base``) and an earlier save of the same model (``stale``): files of equal names
    and, for the shard files, equal sizes, holding other values."""
    if env:
        os.environ.update(env)
    for path, steps in ((stale, 1), (base, 2)):
        model, optimizer = _model(rank, seed=steps)
        values = {"epoch": steps, "global_step": 10 * steps, "callbacks": {"ModelCheckpoint": {
            "best_model_score": torch.tensor(0.5 / steps), "monitor": "val_loss"}}}
        save_checkpoint(path, model, [optimizer], values)


def _local(model: TinyGPT, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's rows of the model, its buffers and its optimizer's state dict (the live tensors, not copies)."""
    return {"model": [*model.parameters(), *model.buffers()], "optimizer": optimizer.state_dict()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def load_each(rank: int, world_size: int, paths: list[str], env: dict[str, str] | None = None) -> list[dict]:
    """Load each checkpoint of ``paths`` into a model and optimizer that trained a step: what each load did."""
    if env:
        os.environ.update(env)
    outcomes = []
    model, optimizer, before = None, None, None
    for path in paths:
        if model is None:  # a new model after every load that changed one; a refused load must leave it as it was
            model, optimizer = _model(rank, seed=7)
            before = copy.deepcopy(_local(model, optimizer))
        try:
            values, _ = load_checkpoint(path, model, [optimizer])
        except CheckpointError as err:
            unchanged = _same(before, _local(model, optimizer))
            outcomes.append({"refused": str(err), "unchanged": unchanged})
            model = model if unchanged else None
            continue
        except Exception as err:  # noqa: BLE001 - a crash: reported, and the test fails on it
            outcomes.append({"crashed": f"{type(err).__name__}: {err}"})
            model = None
            continue
        state = module_full_state(model, [optimizer])
        loaded = {**state, "values": values, "groups": optimizer.state_dict()["param_groups"]}
        outcomes.append({"loaded": _fingerprint(loaded)})
        model = None
    return outcomes


def _fingerprint(value: Any) -> Any:
    """``value`` with each tensor replaced by its dtype, shape and the SHA-256 of its bytes (what the ranks send back
    is small, whatever a load produced)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", str(value.dtype), tuple(value.shape), hashlib.sha256(data).hexdigest())
    if isinstance(value, dict):
        return {k: _fingerprint(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fingerprint(v) for v in value)
    return value


# --------------------------------------------------------------------------------------------------
# The alterations
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alteration:
    """One way of altering a checkpoint: ``apply`` changes the copy at its argument; ``file`` is the file it alters
    (which a refusal must name); ``harmless``: it changes nothing a load reads, so the load must succeed."""

    name: str
    file: str
    apply: Callable[[Path, Path], None]  # (checkpoint, the stale save beside it)
    harmless: bool = False


def _safetensors_parts(data: bytes) -> tuple[int, dict[str, Any]]:
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length])


def _rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """``edit`` the JSON header of the safetensors file ``path``, kept at its length (padded with spaces)."""
    data = path.read_bytes()
    length, header = _safetensors_parts(data)
    edit(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length, "an edit that lengthens the header cannot keep the data in place"
    path.write_bytes(data[:8] + encoded + b" " * (length - len(encoded)) + data[8 + length :])


def _edit_json(path: Path, edit: Callable[[Any], None]) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value, indent=1))


def _flip(name: str, lo: Callable[[bytes], int], hi: Callable[[bytes], int], rng: random.Random) -> Callable:
    """Flip one bit at a position of ``name`` drawn from ``[lo(data), hi(data))`` (drawn now, once per position)."""
    draw = rng.random()
    bit = rng.randrange(8)

    def apply(ckpt: Path, stale: Path) -> None:
        data = bytearray((ckpt / name).read_bytes())
        a, b = lo(bytes(data)), hi(bytes(data))
        data[a + int(draw * (b - a))] ^= 1 << bit
        (ckpt / name).write_bytes(bytes(data))

    return apply


def _header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _leaves(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every leaf of a JSON value (and every list, which can be reordered), with its path."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        if len(value) > 1:
            yield path, value
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path, value


def _changed(value: Any, rng: random.Random) -> Any:
    """Another value of the same kind: a number moved, a string with a character changed, a bool flipped, a list
    reordered."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([-1, 1, 7])
    if isinstance(value, float):
        return value * rng.choice([0.5, 2.0, 41.0]) + 1e-3
    if isinstance(value, str) and value:
        i = rng.randrange(len(value))
        return value[:i] + ("0" if value[i] != "0" else "1") + value[i + 1 :]
    if isinstance(value, list):
        return value[::-1] if value[::-1] != value else value[1:]
    return "x" if value is None else None


def _set_at(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _random_leaf_edit(file: str, rng: random.Random, header: bool = False) -> Callable:
    """Change one leaf (or reorder one list) of ``file``'s JSON (its header's, with ``header``), drawn when applied
    from a seed drawn now."""
    seed = rng.random()

    def apply(ckpt: Path, stale: Path) -> None:
        local = random.Random(seed)

        def edit(tree: Any) -> None:
            leaves = list(_leaves(tree))
            path, value = leaves[local.randrange(len(leaves))]
            _set_at(tree, path, _changed(value, local))

        if header:
            _rewrite_header(ckpt / file, edit)
        else:
            _edit_json(ckpt / file, edit)

    return apply


def _index_edit(edit: Callable[[dict[str, Any]], None]) -> Callable:
    return lambda ckpt, stale: _edit_json(ckpt / INDEX, edit)


def _key(index: dict[str, Any], ending: str) -> str:
    return next(k for k in index["tensors"] if k.endswith(ending))


def _swap_entries(a: str, b: str) -> Callable[[dict[str, Any]], None]:
    def edit(index: dict[str, Any]) -> None:
        ka, kb = _key(index, a), _key(index, b)
        index["tensors"][ka], index["tensors"][kb] = index["tensors"][kb], index["tensors"][ka]
    return edit


def _swap_offsets(ckpt: Path, stale: Path) -> None:
    """Swap the data offsets of two tensors of one shard file that take equal bytes (their CRCs still cover the
    bytes)."""
    def edit(header: dict[str, Any]) -> None:
        by_size: dict[int, list[str]] = {}
        for key, info in header.items():
            if key != "__metadata__":
                by_size.setdefault(info["data_offsets"][1] - info["data_offsets"][0], []).append(key)
        a, b = next(keys for keys in by_size.values() if len(keys) > 1)[:2]
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    _rewrite_header(ckpt / SHARDS[0], edit)


def _stored_name(index: dict[str, Any], name: str) -> str:
    """The key of ``name`` in the index's file table: the name itself, or on object storage ``<save-id>.name``."""
    return name if name in index["files"] else f"{index['save_id']}.{name}"


def _renamed_in_header(shard: str, a: str, b: str) -> Callable:
    """Two tensors of one shape exchange names in a shard file's header."""
    def edit(header: dict[str, Any]) -> None:
        header[a], header[b] = header[b], header[a]
    return lambda ckpt, stale: _rewrite_header(ckpt / shard, edit)


def _copy_from_stale(name: str) -> Callable:
    return lambda ckpt, stale: shutil.copyfile(stale / name, ckpt / name)


def _truncate(name: str, rng: random.Random) -> Callable:
    draw = rng.random()

    def apply(ckpt: Path, stale: Path) -> None:
        data = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(data[: int(draw * len(data))])

    return apply


def alterations(seed: int = SEED) -> list[Alteration]:
    """The alterations of the suite: every kind, in every file, positions and edits drawn from ``seed``."""
    rng = random.Random(seed)
    out: list[Alteration] = []
    for name in (INDEX, STATE_JSON, STATE_TENSORS, *SHARDS):
        regions = {"anywhere": (lambda d: 0, len)}
        if name.endswith(".safetensors"):
            regions = {"length": (lambda d: 0, lambda d: 8), "header": (lambda d: 8, _header_end),
                       "data": (_header_end, len)}
        for region, (lo, hi) in regions.items():
            for i in range(6 if region != "length" else 2):
                out.append(Alteration(f"bit flip {i} in the {region} of {name}", name, _flip(name, lo, hi, rng)))
        for i in range(2):
            out.append(Alteration(f"{name} truncated ({i})", name, _truncate(name, rng)))
        out.append(Alteration(f"bytes appended to {name}", name,
                              lambda c, s, n=name: (c / n).write_bytes((c / n).read_bytes() + b"\0" * 8)))
        out.append(Alteration(f"{name} deleted", name, lambda c, s, n=name: (c / n).unlink()))
        out.append(Alteration(f"{name} replaced by the earlier save's", name, _copy_from_stale(name)))
    for i in range(26):
        out.append(Alteration(f"index.json leaf edit {i}", INDEX, _random_leaf_edit(INDEX, rng)))
    for i in range(8):
        out.append(Alteration(f"trainer_state.json leaf edit {i}", STATE_JSON, _random_leaf_edit(STATE_JSON, rng)))
    for i in range(8):
        shard = SHARDS[i % 2]
        out.append(Alteration(f"{shard} header leaf edit {i}", shard, _random_leaf_edit(shard, rng, header=True)))
    named_index_edits: dict[str, Callable[[dict[str, Any]], None]] = {
        "lr 0.01 -> 0.41": lambda ix: ix["optimizers"][0]["param_groups"][0]["options"].update(lr=0.41),
        "weight decay": lambda ix: ix["optimizers"][0]["param_groups"][0]["options"].update(weight_decay=0.0),
        "eps": lambda ix: ix["optimizers"][0]["param_groups"][0]["options"].update(eps=1e-3),
        "betas beyond 1": lambda ix: ix["optimizers"][0]["param_groups"][0]["options"].update(
            betas={"__tuple__": [1.5, 0.95]}),
        "shard_files reordered": lambda ix: ix["shard_files"].reverse(),
        "a LayerNorm weight read from its bias": lambda ix: ix["tensors"].update(
            {_key(ix, "ln_f.weight"): ix["tensors"][_key(ix, "ln_f.bias")]}),
        "exp_avg and exp_avg_sq swapped": _swap_entries("wte.weight/exp_avg", "wte.weight/exp_avg_sq"),
        "an exp_avg removed": lambda ix: ix["tensors"].pop(_key(ix, "ln_f.weight/exp_avg")),
        "a step removed": lambda ix: ix["tensors"].pop(_key(ix, "ln_f.weight/step")),
        "a tensor renamed": lambda ix: ix["tensors"].update(
            {"model/renamed.weight": ix["tensors"].pop(_key(ix, "ln_f.weight"))}),
        "a file entry removed": lambda ix: ix["files"].pop(_stored_name(ix, STATE_TENSORS)),
        "a file's sha256 changed": lambda ix: ix["files"][_stored_name(ix, STATE_JSON)].update(sha256="0" * 64),
        "a header digest changed": lambda ix: ix["files"][_stored_name(ix, SHARDS[0])].update(header_sha256="0" * 64),
        "version 3 claimed": lambda ix: ix.update(version=3),
        "the seal removed": lambda ix: ix.pop("index_sha256"),
        "the save id changed": lambda ix: ix.update(save_id="0" * 12),
        "mesh changed": lambda ix: ix.update(world_size=4, mesh={"replicas": 2, "shard_size": 2}),
        "a dtype changed": lambda ix: ix["tensors"][_key(ix, "ln_f.weight")].update(dtype="float16"),
        "a parameter group reordered": lambda ix: ix["optimizers"][0]["param_groups"][0]["params"].reverse(),
        "the ties removed": lambda ix: ix.update(ties={}),
    }
    for label, edit in named_index_edits.items():
        out.append(Alteration(f"index.json: {label}", INDEX, _index_edit(edit)))
    out += [
        Alteration("two tensors' data_offsets swapped", SHARDS[0], _swap_offsets),
        Alteration("a LayerNorm's weight and bias renamed into each other in a header", SHARDS[0], _renamed_in_header(
            SHARDS[0], "model/blocks.0.ln1.weight", "model/blocks.0.ln1.bias")),
        Alteration("exp_avg and exp_avg_sq renamed into each other in a header", SHARDS[1], _renamed_in_header(
            SHARDS[1], "optimizer/0/wte.weight/exp_avg", "optimizer/0/wte.weight/exp_avg_sq")),
        Alteration("trainer_state.json: epoch", STATE_JSON, lambda c, s: _edit_json(c / STATE_JSON,
                                                                                  lambda v: v.update(epoch=9))),
        Alteration("trainer_state.json: global_step", STATE_JSON,
                   lambda c, s: _edit_json(c / STATE_JSON, lambda v: v.update(global_step=99))),
        Alteration("trainer_state.json: a monitored metric's key", STATE_JSON, lambda c, s: _edit_json(
            c / STATE_JSON, lambda v: v["callbacks"]["ModelCheckpoint"].update(
                best_model_score={"__tensor__": "/mepric"}))),
        Alteration("trainer_state.safetensors renamed a tensor", STATE_TENSORS, lambda c, s: _rewrite_header(
            c / STATE_TENSORS, lambda h: h.update({"/x": h.pop(next(k for k in h if k != "__metadata__"))}))),
        Alteration("every file replaced by the earlier save's but the index", INDEX, lambda c, s: [
            shutil.copyfile(s / n, c / n) for n in (STATE_JSON, STATE_TENSORS, *SHARDS)]),
        Alteration("index.json formatted otherwise", INDEX, lambda c, s: _edit_json(c / INDEX, lambda v: None),
                   harmless=True),
    ]
    return out


# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("integrity")
    run_on_ranks(save_two, 2, str(root / "base"), str(root / "stale"))
    return root / "base", root / "stale"


def _altered(saves: tuple[Path, Path], root: Path, found: list[Alteration]) -> list[Path]:
    base, stale = saves
    paths = []
    for i, alteration in enumerate(found):
        ckpt = root / f"a{i:03d}"
        shutil.copytree(base, ckpt)
        alteration.apply(ckpt, stale)
        paths.append(ckpt)
    return paths


def _check_outcomes(found: list[Alteration], per_rank: list[list[dict]], baseline: list[dict], where: str) -> None:
    """Each alteration refused on every rank alike (naming its file, nothing changed) or, if harmless, loaded as the
    unaltered checkpoint loads; inconsistent ranks, crashes and silent wrong loads are listed."""
    wrong = []
    for i, alteration in enumerate(found):
        outcomes = [rank[i] for rank in per_rank]
        label = f"{alteration.name} ({where})"
        if any("crashed" in o for o in outcomes):
            wrong.append(f"{label}: crashed: {[o.get('crashed') for o in outcomes]}")
        elif all("refused" in o for o in outcomes):
            messages = {o["refused"] for o in outcomes}
            message = next(iter(messages))
            if len(messages) != 1:
                wrong.append(f"{label}: the ranks were refused with different messages: {messages}")
            elif alteration.harmless:
                wrong.append(f"{label}: refused, though it changes nothing a load reads: {message}")
            elif alteration.file not in message:
                wrong.append(f"{label}: the refusal does not name {alteration.file}: {message}")
            elif not all(o["unchanged"] for o in outcomes):
                wrong.append(f"{label}: refused, but a model or optimizer changed: {message}")
        elif all("loaded" in o for o in outcomes):
            if not all(_same(o["loaded"], b["loaded"]) for o, b in zip(outcomes, baseline)):
                wrong.append(f"{label}: loaded silently with other values than the checkpoint holds")
        else:
            wrong.append(f"{label}: some ranks loaded, others were refused: {outcomes}")
    assert not wrong, f"{len(wrong)} of {len(found)} alterations:\n" + "\n".join(wrong)


def _inspect_refuses(path: str | Path) -> bool:
    try:
        return bool(inspect(path).problems)
    except CheckpointError:
        return True


@pytest.fixture(scope="module")
def local_runs(saves: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    found = alterations()
    paths = _altered(saves, tmp_path_factory.mktemp("altered"), found)
    runs = {"found": found, "paths": paths}
    for world_size in (2, 3):
        baseline = run_on_ranks(load_each, world_size, [str(saves[0])], timeout=120)
        runs[world_size] = ([rank[0] for rank in baseline],
                            run_on_ranks(load_each, world_size, [str(p) for p in paths], timeout=600))
    return runs


def test_the_generator_covers_every_file_and_kind_of_alteration() -> None:
    found = alterations()
    assert len(found) >= 150 and len({a.name for a in found}) == len(found)
    assert {a.file for a in found} == {INDEX, STATE_JSON, STATE_TENSORS, *SHARDS}
    for kind in ("bit flip", "truncated", "appended", "deleted", "earlier save", "leaf edit", "reordered",
                 "data_offsets swapped", "removed", "renamed"):
        assert any(kind in a.name for a in found), kind
    assert alterations(SEED + 1) != found  # positions and edits come from the seed


def test_the_unaltered_checkpoint_loads_the_saved_values(saves: tuple[Path, Path], local_runs: dict) -> None:
    baseline, _ = local_runs[2]
    assert all("loaded" in o for o in baseline)
    assert baseline[0]["loaded"]["values"]["global_step"] == 20
    assert baseline[0]["loaded"]["groups"][0]["lr"] == 1e-2


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_alteration_is_refused_naming_its_file_and_changing_nothing(local_runs: dict, world_size: int) -> None:
    baseline, per_rank = local_runs[world_size]
    _check_outcomes(local_runs["found"], per_rank, baseline, f"local, world size {world_size}")


def test_inspect_reports_damage_exactly_where_the_load_refuses(local_runs: dict) -> None:
    _, per_rank = local_runs[2]
    disagree = [f"{a.name}: inspect {'refuses' if _inspect_refuses(p) else 'accepts'}, load {next(iter(o))}"
                for a, p, o in zip(local_runs["found"], local_runs["paths"], per_rank[0])
                if _inspect_refuses(p) != ("refused" in o)]
    assert not disagree, "\n".join(disagree)


@pytest.fixture(scope="module")
def s3() -> Iterator[tuple[S3Server, Any]]:
    import s3fs

    with running_s3_server() as server:
        fs = s3fs.S3FileSystem(key=server.env["AWS_ACCESS_KEY_ID"], secret=server.env["AWS_SECRET_ACCESS_KEY"],
                               client_kwargs={"endpoint_url": server.env["AWS_ENDPOINT_URL"]})
        fs.mkdir(BUCKET)
        yield server, fs


def test_alterations_of_a_checkpoint_on_s3_are_refused_as_local_ones(
    s3: tuple[S3Server, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save to S3 (its objects named under the save's id), altered object by object, loaded through its URL."""
    server, fs = s3
    run_on_ranks(save_two, 2, f"s3://{BUCKET}/base", f"s3://{BUCKET}/stale", server.env)
    stored_as = {p.rsplit("/", 1)[1].split(".", 1)[1]: p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/base/")
                 if not p.endswith("/" + INDEX)} | {INDEX: INDEX}
    local = {}
    for name in ("base", "stale"):
        fs.get(f"{BUCKET}/{name}/", str(tmp_path / name), recursive=True)
        local[name] = tmp_path / name
        for stored in list(local[name].iterdir()):  # "<save-id>.shard-..." -> the names the alterations use
            if stored.name != INDEX:
                stored.rename(stored.with_name(stored.name.split(".", 1)[1]))
    rng = random.Random(SEED + 2)
    found = rng.sample([a for a in alterations(SEED + 2) if not a.harmless], 16)
    found.append(next(a for a in alterations() if "data_offsets" in a.name))
    urls = []
    for i, ckpt in enumerate(_altered((local["base"], local["stale"]), tmp_path, found)):
        for item in ckpt.iterdir():
            fs.put_file(str(item), f"{BUCKET}/m{i:02d}/{stored_as[item.name]}")
        urls.append(f"s3://{BUCKET}/m{i:02d}")
    baseline = [r[0] for r in run_on_ranks(load_each, 2, [f"s3://{BUCKET}/base"], server.env, timeout=120)]
    _check_outcomes(found, run_on_ranks(load_each, 2, urls, server.env, timeout=600), baseline, "S3")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    assert all(_inspect_refuses(url) for url in urls)
