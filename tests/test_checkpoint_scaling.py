"""The checkpoint format at scale: an index that grows with tensors + files (never tensors x files), loads that read
only the files holding their rows, a save that gathers the files' records on rank 0 alone and never writes an index a
load would refuse, and version-1 checkpoints (which listed every piece) still read.

Large worlds are simulated: ``lightning_shard.testing_checkpoints.simulate_save`` writes, in one process, the
directory ``world_size`` ranks would write, with the save's own code (checked here against a real 2-rank save).

Most tests here read rows split over many files: their saves split every tensor the shards hold by rows
(``SPLIT_PIECE_MIN_BYTES`` 0, as version-3 saves did before they stored small tensors whole, and as they still split
large ones); tests/test_checkpoint_small_tensors.py tests the rule of [Note: small tensors stored whole]."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_shard import CheckpointError, consolidate, inspect
from lightning_shard.checkpoint import format as checkpoint_format
from lightning_shard.checkpoint.format import INDEX_FILE, MAX_JSON_BYTES, shard_file_name
from lightning_shard.checkpoint.format.safetensors_header import BLOCK_BYTES
from lightning_shard.checkpoint.io import files as files_module
from lightning_shard.checkpoint.io import reader as reader_module
from lightning_shard.checkpoint.io import writer as writer_module
from lightning_shard.checkpoint.io.index import read_index
from lightning_shard.checkpoint.io.layout import shard_rows
from lightning_shard.checkpoint.io.reader import RowReads, read_rows
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.testing import run_on_ranks
from lightning_shard.testing_checkpoints import header_digest, reseal_index, simulate_save, simulated_index
from tests.checkpoint_scaling_fits import (
    FIXTURE_V1,
    FIXTURE_V2,
    TallGPT,
    load_counting,
    load_refused,
    load_version_1_fixture,
    plain_state,
    save_sharded,
    trained_plain,
    with_layout,
    write_version_1_fixture,
)
from tests.models import TinyGPT

SIMULATED_WORLD = 1024
SPLIT_ALL = {"SPLIT_PIECE_MIN_BYTES": 0}
# TinyGPT at 2 ranks and at 8: some tensors split by rows, and the others stored whole, dealt to every shard
MIXED = {"SPLIT_PIECE_MIN_BYTES": 256, "WHOLE_FILE_MIN_BYTES": 1}


@pytest.fixture(autouse=True)
def split_every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves in this process split every tensor the shards hold by rows (see the module's docstring)."""
    monkeypatch.setattr(checkpoint_format, "SPLIT_PIECE_MIN_BYTES", 0)


def _assert_equal_states(got: dict[str, dict[str, torch.Tensor]], expected: dict[str, dict[str, torch.Tensor]]) -> None:
    for part in ("params", "optimizer"):
        assert sorted(got[part]) == sorted(expected[part]), part
        for name, value in expected[part].items():
            assert torch.equal(got[part][name], value), f"{part} {name}"


def test_the_rows_a_shard_file_holds_are_the_rows_the_engine_gives_that_shard() -> None:
    for rows in (0, 1, 2, 3, 7, 37, 64, 2048):
        for shard_size in (1, 2, 3, 8, 1024):
            p = ShardedParam([], [], torch.Size([rows, 4]), torch.float32, True, shard_size, 0)
            for shard in range(shard_size):
                first, count = p.rows_held_by(shard)
                assert shard_rows(rows, shard_size, shard) == (min(first, rows), min(first, rows) + count)


@pytest.fixture(scope="module")
def two_and_eight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TinyGPT after one AdamW step, saved by 2 ranks and by 8, some tensors split by rows and some stored whole."""
    root = tmp_path_factory.mktemp("scaling")
    states = {ws: run_on_ranks(with_layout, ws, MIXED, save_sharded, str(root / f"w{ws}"), TinyGPT)[0]
              for ws in (2, 8)}
    return {"root": root, "states": states}


def test_an_index_grows_with_files_not_with_tensors_times_files(two_and_eight: dict[str, Any]) -> None:
    root = two_and_eight["root"]
    sizes = {ws: (root / f"w{ws}" / INDEX_FILE).stat().st_size for ws in (2, 8)}
    assert sizes[8] <= 1.5 * sizes[2], sizes
    index = {ws: json.loads((root / f"w{ws}" / INDEX_FILE).read_text()) for ws in (2, 8)}

    def entries(ws: int) -> dict[str, Any]:  # split by rows, or whole in a shard file (whose name says the world size)
        tensors = index[ws]["tensors"].items()
        return {k: {"shape": e["shape"], "dtype": e["dtype"], "in": e.get("split", e.get("file") in index[ws][
            "shard_files"] and e["key"] == k)} for k, e in tensors}

    assert {k: e["shape"] for k, e in entries(8).items()} == {k: e["shape"] for k, e in entries(2).items()}
    for ws in (2, 8):  # one entry per tensor, whatever world wrote it
        assert {e["in"] for e in entries(ws).values()} == {"rows", True}, ws
    assert index[8]["shard_files"] == [shard_file_name(s, 8) for s in range(8)]


def test_a_checkpoint_of_8_ranks_loads_on_2_with_exactly_its_tensors(two_and_eight: dict[str, Any]) -> None:
    for loaded in run_on_ranks(load_counting, 2, str(two_and_eight["root"] / "w8"), TinyGPT):
        _assert_equal_states(loaded, two_and_eight["states"][8])


def test_a_simulated_save_writes_what_a_real_save_writes(
    two_and_eight: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in MIXED.items():
        monkeypatch.setattr(checkpoint_format, name, value)
    saved = two_and_eight["states"][2]  # the real 2-rank save's full state, into a plain model and optimizer
    model, optimizer = trained_plain(TinyGPT)
    model.load_state_dict(saved["params"])
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    for p, state in optimizer.state.items():
        for key in state:
            state[key] = saved["optimizer"][f"0/{names[id(p)]}/{key}"].clone()
    real, simulated = two_and_eight["root"] / "w2", tmp_path / "simulated"
    save_id = json.loads((real / "index.json").read_text())["save_id"]
    simulate_save(simulated, model, 2, [optimizer], {"step": 1}, save_id)
    assert sorted(p.name for p in simulated.iterdir()) == sorted(p.name for p in real.iterdir())
    for path in real.iterdir():
        assert (simulated / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.fixture(scope="module")
def tall(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TallGPT after one AdamW step, saved as 1,024 FULL_SHARD ranks would save it, every tensor split by rows."""
    model, optimizer = trained_plain(TallGPT)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_format, "SPLIT_PIECE_MIN_BYTES", 0)
        path = simulate_save(tmp_path_factory.mktemp("tall") / "ckpt", model, SIMULATED_WORLD, [optimizer],
                             {"step": 1})
    return {"path": path, "state": plain_state(model, optimizer), "model": model, "optimizer": optimizer}


def _expected_work(rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[set[str], int]:
    """The files a loading rank of 2 must read (those holding its rows, and shard 0's, which holds whole tensors) and
    the pieces it checks, counted from the shapes alone."""
    files: set[str] = set()
    pieces = 0

    def rows(n: int, splits: int) -> None:
        nonlocal pieces
        mine = math.ceil(n / 2)
        lo, hi = min(n, rank * mine), min(n, (rank + 1) * mine)
        if hi > lo:
            per = math.ceil(n / SIMULATED_WORLD)
            shards = range(lo // per, math.ceil(hi / per))
            files.update(shard_file_name(s, SIMULATED_WORLD) for s in shards)
            pieces += splits * len(shards)

    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            rows(p.shape[0] if p.dim() else 1, 1 + sum(v.dim() > 0 for v in optimizer.state.get(p, {}).values()))
    whole = len(list(model.buffers())) + sum(v.dim() == 0 for s in optimizer.state.values() for v in s.values())
    files.add(shard_file_name(0, SIMULATED_WORLD))
    return files, pieces + whole


def test_a_checkpoint_of_1024_ranks_loads_on_2_reading_only_the_files_holding_their_rows(tall: dict[str, Any]) -> None:
    path = tall["path"]
    assert len(list(path.glob("shard-*.safetensors"))) == SIMULATED_WORLD
    for rank, loaded in enumerate(run_on_ranks(load_counting, 2, str(path), TallGPT)):
        _assert_equal_states(loaded, tall["state"])
        files, pieces = _expected_work(rank, tall["model"], tall["optimizer"])
        assert sorted(loaded["headers_read"]) == sorted(files)  # each once: a header is read once per load
        assert loaded["pieces_checked"] == pieces
        opened = {Path(p).name for p in loaded["opened"]}
        assert opened == files | {INDEX_FILE, "trainer_state.json", "trainer_state.safetensors"}
        assert len(files) < 0.6 * SIMULATED_WORLD, len(files)


def test_a_load_of_model_and_optimizer_together_opens_each_file_it_reads_twice(tall: dict[str, Any]) -> None:
    """``load_checkpoint`` (``fabric.load``, and the Trainer when a fit restores its optimizers): the header, then the
    model's and the optimizer's bytes in one read; apart, the bytes are read in two."""
    for rank, (together, apart) in enumerate(zip(run_on_ranks(load_counting, 2, str(tall["path"]), TallGPT, True),
                                                 run_on_ranks(load_counting, 2, str(tall["path"]), TallGPT))):
        _assert_equal_states(together, tall["state"])
        files, _ = _expected_work(rank, tall["model"], tall["optimizer"])
        for loaded, opens in ((together, 2), (apart, 3)):
            counts = Counter(Path(p).name for p in loaded["opened"] if Path(p).name in files)
            assert set(counts) == files
            assert sum(n == opens for n in counts.values()) >= 0.9 * len(files), (rank, opens, Counter(counts.values()))
            first = counts.pop(shard_file_name(0, SIMULATED_WORLD))  # also holds whole tensors: read apart, once a pass
            assert first <= 2 * opens - 1 and max(counts.values()) <= opens + 1  # +1: a cut piece (a rank's edge)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def loads_within_a_descriptor_limit(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """``load_counting`` of ``path`` with this process allowed only 96 descriptors more than it holds; the
    descriptors it holds before and after."""
    import resource

    before = _open_descriptors()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 96, hard))
    try:
        loaded = load_counting(rank, world_size, path, TallGPT, together=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {**loaded, "before": before, "after": _open_descriptors()}


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")
def test_a_load_of_1024_files_holds_few_descriptors_and_closes_every_one(tall: dict[str, Any]) -> None:
    for loaded in run_on_ranks(loads_within_a_descriptor_limit, 2, str(tall["path"])):
        _assert_equal_states(loaded, tall["state"])
        assert loaded["after"] == loaded["before"]


def test_consolidate_and_inspect_read_each_header_once(
    tall: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    real = files_module.parse_header

    def counting(text: bytes, path: Path | str, *args: Any) -> Any:
        reads.append(Path(path).name)
        return real(text, path, *args)

    monkeypatch.setattr(files_module, "parse_header", counting)
    out = consolidate(tall["path"], tmp_path / "model.safetensors")
    assert sorted(reads) == sorted(p.name for p in tall["path"].glob("shard-*.safetensors"))
    expected = tall["model"].state_dict()
    for name, value in load_file(str(out)).items():
        assert torch.equal(value, expected[name]), name
    reads.clear()
    assert inspect(tall["path"]).problems == []
    assert sorted(reads) == sorted(p.name for p in tall["path"].glob("shard-*.safetensors"))


@pytest.fixture(params=[None, 16, 40], ids=["blocks of 64 KiB", "blocks of 16 bytes", "blocks of 40 bytes"])
def block_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The size of the checksummed blocks the saves of a test write (a reader takes it from each file's header)."""
    if request.param is not None:
        monkeypatch.setattr(writer_module, "BLOCK_BYTES", request.param)
    return request.param or BLOCK_BYTES


@pytest.mark.parametrize("window", [None, 40], ids=["windows of 8 MiB", "windows of 40 bytes"])
def test_any_rows_of_a_split_tensor_read_exactly_as_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block_bytes: int, window: int | None
) -> None:
    """Every [start, stop) of every tensor: pieces cut at either end, whole pieces in runs across files whose headers
    differ (shards 0-1 hold rows of a 2-row weight, shard 5 a short piece, shard 6 nothing), blocks that cut pieces,
    windows of one file and a few bytes."""
    if window is not None:
        monkeypatch.setattr(reader_module, "_WINDOW_BYTES", window)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(23, 2), torch.nn.Linear(2, 23))  # in shards 0-1, the 2 rows first
    ckpt = simulate_save(tmp_path / "ckpt", model, 7)  # 23 rows: 4 a shard, 3 in shard 5
    assert sorted(p.name for p in ckpt.glob("shard-*")) == [shard_file_name(s, 7) for s in range(7)]  # 6: empty
    index = read_index(ckpt)
    for name, value in model.state_dict().items():
        entry = index["tensors"]["model/" + name]
        for start in range(entry.rows + 1):
            for stop in range(start, entry.rows + 1):
                assert torch.equal(read_rows(entry, start, stop), value[start:stop]), (name, start, stop)
    state = model.state_dict()
    for names in (list(state), list(state)[::2]):  # in one read: runs of several tensors a file, and gaps between
        reads = RowReads()
        for name in names:
            reads.add(index["tensors"]["model/" + name], 0, state[name].shape[0])
        for name, value in zip(names, reads.run()):
            assert torch.equal(value, state[name]), name


def test_large_pieces_read_in_place_exactly_as_saved_and_a_flipped_byte_in_one_is_refused(tmp_path: Path) -> None:
    """Pieces of at least 64 KiB are read straight into their targets, the bytes of the blocks around them aside:
    every [start, stop) of such a weight reads back exactly, beside a small bias read through a window, and a byte
    flipped in a piece fails exactly the reads whose blocks hold it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4200, 23))  # 4 rows a shard: 67,200-byte pieces, then the bias's
    ckpt = simulate_save(tmp_path / "ckpt", model, 7)
    index, state = read_index(ckpt), model.state_dict()
    weight = index["tensors"]["model/0.weight"]
    for start in range(24):
        for stop in range(start, 24):
            reads = RowReads()
            reads.add(weight, start, stop)
            reads.add(index["tensors"]["model/0.bias"], start, stop)
            got_weight, got_bias = reads.run()
            assert torch.equal(got_weight, state["0.weight"][start:stop]), (start, stop)
            assert torch.equal(got_bias, state["0.bias"][start:stop]), (start, stop)
    shard = ckpt / shard_file_name(2, 7)  # rows 8-11
    header = read_index(ckpt)["tensors"]["model/0.weight"].files.header(shard.name)
    assert header.entries["model/0.weight"].begin == 0 and header.table.data_bytes == 4 * 4200 * 4 + 16
    _flip(shard, header.data_start + 66000)  # in row 11 (bytes [50400, 67200)), in the second block
    weight = read_index(ckpt)["tensors"]["model/0.weight"]
    for start, stop, refused in ((0, 23, True), (8, 9, False), (10, 12, True), (12, 23, False), (0, 8, False)):
        if refused:
            with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted: bytes \[65536, 67216\)"):
                read_rows(weight, start, stop)
        else:
            assert torch.equal(read_rows(weight, start, stop), state["0.weight"][start:stop]), (start, stop)


def test_two_targets_of_the_same_rows_in_one_read_each_get_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64))
    ckpt = simulate_save(tmp_path / "ckpt", model, 16)  # 4 rows a file
    entry = read_index(ckpt)["tensors"]["model/0.weight"]
    reads = RowReads()
    for start, stop in ((0, 64), (8, 40), (0, 64)):  # the same bytes of files 2-9, three times
        reads.add(entry, start, stop)
    weight = model.state_dict()["0.weight"]
    assert [torch.equal(got, weight[a:b]) for got, (a, b) in zip(reads.run(), ((0, 64), (8, 40), (0, 64)))] == [
        True] * 3


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_by_every_read_that_lands_bytes_its_checksum_covers(
    tmp_path: Path, block_bytes: int
) -> None:
    """Whatever rows a read asks for (a reader of any world size), a byte flipped in a file fails every read of rows
    whose bytes share a checksummed block with it, naming the file and the tensor; every other read lands the saved
    values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64))
    ckpt = simulate_save(tmp_path / "ckpt", model, 16)  # 4 rows of the weight (64 bytes), then of the bias (16)
    shard = ckpt / shard_file_name(9, 16)
    header = json.loads(shard.read_bytes()[8 : 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]])
    data_start = shard.stat().st_size - 80
    flipped = 64 + 2 * 4 + 1  # in the bias's row 38 (rows 36-39 are shard 9's)
    _flip(shard, data_start + flipped)
    assert header["model/0.bias"]["data_offsets"] == [64, 80]
    index = read_index(ckpt)
    state = model.state_dict()
    for name, row_bytes, begin in (("0.bias", 4, 64), ("0.weight", 16, 0)):
        entry = index["tensors"]["model/" + name]
        for start in range(0, 64, 3):
            for stop in range(start + 1, 65, 5):
                lo, hi = max(start, 36), min(stop, 40)  # the rows read from shard 9
                lands = lo < hi and (begin + (lo - 36) * row_bytes) // block_bytes <= flipped // block_bytes <= (
                    begin + (hi - 36) * row_bytes - 1) // block_bytes
                if lands:
                    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted: bytes \[\d+, \d+\) of its"
                                       r" tensor data \(of .*'model/0\.bias'.*\) do not match their checksum"):
                        read_rows(entry, start, stop)
                else:
                    assert torch.equal(read_rows(entry, start, stop), state[name][start:stop]), (name, start, stop)
    assert inspect(ckpt).problems == [f"{shard.name}: SHA-256 differs from the index"]


def _edit_header(path: Path, edit: Any) -> None:
    """Apply ``edit`` to the JSON header of the safetensors file ``path``, in place: the header keeps its length
    (padded with spaces, as the writer pads it), so the data does not move and the index's size still holds."""
    data = bytearray(path.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[8 : 8 + length] = text + b" " * (length - len(text))
    path.write_bytes(bytes(data))


def test_a_shard_file_records_the_crc32_of_each_block_of_its_data(tmp_path: Path, block_bytes: int) -> None:
    model, optimizer = trained_plain(TinyGPT)
    ckpt = simulate_save(tmp_path / "ckpt", model, 2, [optimizer])
    for shard in sorted(ckpt.glob("shard-*.safetensors")):
        raw = shard.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        assert raw[8:].startswith(b'{"__metadata__":{"crc32_blocks":"')  # first: found without parsing the JSON
        metadata, data = json.loads(raw[8 : 8 + length])["__metadata__"], raw[8 + length :]
        assert set(metadata) == {"crc32_blocks", "crc32_block_bytes", "save_id"}
        assert metadata["save_id"] == json.loads((ckpt / "index.json").read_text())["save_id"]
        assert int(metadata["crc32_block_bytes"]) == block_bytes
        blocks = [data[at : at + block_bytes] for at in range(0, len(data), block_bytes)]
        assert metadata["crc32_blocks"] == "".join(f"{zlib.crc32(block):08x}" for block in blocks)


def _linear_16(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """A Linear(4, 64) saved as 16 ranks save it: 4 rows of the weight (64 bytes) and of the bias (16 bytes) a file."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64))
    return model, simulate_save(tmp_path / "ckpt", model, 16)


def _read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors = read_index(ckpt)["tensors"]
    reads = RowReads()
    for key in ("model/0.weight", "model/0.bias"):
        reads.add(tensors[key], 0, 64)
    weight, bias = reads.run()
    return {"0.weight": weight, "0.bias": bias}


def _digits(edit: Any) -> Any:
    return lambda metadata: metadata.__setitem__("crc32_blocks", edit(metadata["crc32_blocks"]))


HEADER_DAMAGE = {
    "other digits": (_digits(lambda v: v[:-8] + f"{int(v[-8:], 16) ^ 1:08x}"),
                     r"is corrupted: bytes \[0, 80\) of its tensor data"),
    "not hex": (_digits(lambda v: v[:-1] + "g"), "not 8 hex digits for each of its 1 checksums"),
    "too short": (_digits(lambda v: v[:-8]), "not 8 hex digits for each of its 1 checksums"),
    "a number": (_digits(lambda v: 7), "not 8 hex digits for each of its 1 checksums"),
    "no digits": (lambda metadata: metadata.pop("crc32_blocks"), "not 8 hex digits for each of its 1 checksums"),
    "block size zero": (lambda metadata: metadata.__setitem__("crc32_block_bytes", "0"),
                        "'crc32_block_bytes' metadata is '0', not a block size"),
    "block size not a number": (lambda metadata: metadata.__setitem__("crc32_block_bytes", "x"),
                                "metadata is 'x', not a block size"),
    "block size beyond the limit": (lambda metadata: metadata.update(crc32_blocks="", crc32_block_bytes="99999999"),
                                    "metadata is '99999999', not a block size of at most 67108864 bytes"),
    "no block size": (lambda metadata: metadata.pop("crc32_block_bytes"), "metadata is None, not a block size"),
}


@pytest.mark.parametrize("damage", sorted(HEADER_DAMAGE))
def test_damaged_checksums_in_a_header_are_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    edit, message = HEADER_DAMAGE[damage]
    _, ckpt = _linear_16(tmp_path)
    shard = ckpt / shard_file_name(9, 16)
    _edit_header(shard, lambda header: edit(header["__metadata__"]))
    # the index vouches for the edited header: the checks beneath the seal (all that guards versions 2 and 3) refuse it
    reseal_index(ckpt, lambda index: index["files"][shard.name].update(header_sha256=header_digest(shard)))
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*{message}"):
        _read_all(ckpt)


@pytest.mark.parametrize("fixture", [FIXTURE_V1, FIXTURE_V2], ids=["version 1", "version 2"])
def test_a_checkpoint_of_an_earlier_version_still_loads_at_any_world_size(fixture: Path) -> None:
    expected = load_file(str(fixture.parent / "expected.safetensors"))
    assert json.loads((fixture / INDEX_FILE).read_text())["version"] == (1 if fixture == FIXTURE_V1 else 2)
    for world_size in (1, 2, 3):
        for loaded in run_on_ranks(load_version_1_fixture, world_size, str(fixture)):
            assert loaded["values"] == {"step": 1}
            for part in ("params", "optimizer"):
                for name, value in loaded[part].items():
                    assert torch.equal(value, expected[f"{part}/{name}"]), f"{part} {name} at {world_size} ranks"


def _flip_in(ckpt: Path, shard: int, key: str, at: int) -> Path:
    """Flip a bit of byte ``at`` of ``key``'s data in the file of shard ``shard`` of ``ckpt`` (of 2), or in the file
    that holds it whole; that file."""
    path = ckpt / json.loads((ckpt / INDEX_FILE).read_text())["tensors"][key].get("file", shard_file_name(shard, 2))
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8 : 8 + length])[key]["data_offsets"]
    assert 0 <= at < end - begin
    _flip(path, 8 + length + begin + at)
    return path


@pytest.mark.parametrize("version", [2, 4, "4, small tensors whole"])
@pytest.mark.parametrize(("shard", "key", "at"), [
    (0, "model/mix.weight", 13), (0, "optimizer/0/mix.bias/exp_avg_sq", 5), (1, "model/embed.weight", 2)],
    ids=["a weight, in the row a third rank reads alone", "an optimizer moment of a bias",
         "a file that not every rank reads"])
def test_a_flipped_byte_is_refused_at_any_world_size_and_the_model_and_optimizer_keep_their_state(
    tmp_path: Path, version: int | str, shard: int, key: str, at: int
) -> None:
    """Written on 2 ranks, one bit flipped in one shard's file (or in the file holding the tensor whole), loaded on
    1, 2 and 3 ranks: refused on every rank, naming the file; the model and the optimizer hold what they held before
    the load (and train on), also on the ranks that read only intact files."""
    ckpt = tmp_path / "ckpt"
    if version == 2:
        shutil.copytree(FIXTURE_V2, ckpt)
    else:  # today's writer, splitting every tensor or by its rule (this model's tensors are all stored whole)
        run_on_ranks(with_layout, 2, SPLIT_ALL if version == 4 else {}, write_version_1_fixture, str(ckpt))
    assert json.loads((ckpt / INDEX_FILE).read_text())["version"] == (2 if version == 2 else 4)
    damaged = _flip_in(ckpt, shard, key, at)
    for world_size in (1, 2, 3):
        for rank, result in enumerate(run_on_ranks(load_refused, world_size, str(ckpt))):
            assert f"{damaged} is corrupted" in result["error"], (world_size, rank, result["error"])
            assert result["unchanged"], (world_size, rank)


def _first_piece(edit: Any) -> Any:
    return lambda index: edit(index["tensors"]["model/mix.weight"]["pieces"][0])


VERSION_1_DAMAGE = {
    "piece file is a list": (_first_piece(lambda p: p.__setitem__("file", [p["file"]])), r"has a malformed piece"),
    "crc32 is a string": (_first_piece(lambda p: p.__setitem__("crc32", "abc")), r"has a malformed piece"),
    "piece in an unlisted file": (_first_piece(lambda p: p.__setitem__("file", "other.safetensors")),
                                  r"refers to the file 'other\.safetensors', which the index does not list"),
    "gap": (_first_piece(lambda p: p.__setitem__("rows", [0, 1])), r"rows \[2, 3\) leaves a gap before it"),
    "rows beyond the tensor": (lambda index: index["tensors"]["model/mix.weight"]["pieces"][1].__setitem__(
        "rows", [2, 4]), r"rows \[2, 4\) lies beyond the tensor's 3 rows"),
    "piece crc differs": (_first_piece(lambda p: p.__setitem__("crc32", p["crc32"] ^ 1)), r"is corrupted"),
}


@pytest.mark.parametrize("case", sorted(VERSION_1_DAMAGE))
def test_a_damaged_version_1_index_is_refused(tmp_path: Path, case: str) -> None:
    edit, pattern = VERSION_1_DAMAGE[case]
    ckpt = tmp_path / "bad"
    shutil.copytree(FIXTURE_V1, ckpt)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    edit(index)
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=pattern):
        consolidate(ckpt, tmp_path / "m.safetensors")


def test_a_shard_file_without_the_checksum_of_a_piece_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model, optimizer = trained_plain(TinyGPT)
    ckpt = simulate_save(tmp_path / "ckpt", model, 2, [optimizer])
    shard = ckpt / shard_file_name(1, 2)
    save_file(load_file(str(shard)), str(shard))  # the same tensors, no CRC-32s in the header
    reseal_index(ckpt, lambda index: index["files"][shard.name].update(
        size=shard.stat().st_size, header_sha256=header_digest(shard)))
    with pytest.raises(CheckpointError, match=rf"{shard.name} records no checksum of '.*': it is damaged"):
        consolidate(ckpt, tmp_path / "m.safetensors")


def saves_over_the_limit(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Save TinyGPT; then, with the JSON limit just below that index's size, save again (refused), load the first
    checkpoint (refused: the same limit), and save a trainer state above the limit (refused)."""
    from lightning_shard.checkpoint import load_checkpoint, save_checkpoint
    from lightning_shard.engine import shard_model

    torch.manual_seed(0)
    model = TinyGPT()
    shard_model(model)
    save_checkpoint(path, model, values={"note": "first"})
    first = (Path(path) / INDEX_FILE).read_bytes()
    errors = {}
    original = checkpoint_format.MAX_JSON_BYTES
    checkpoint_format.MAX_JSON_BYTES = len(first) - 1
    try:
        for what, call in (("save", lambda: save_checkpoint(path, model, values={"note": "second"})),
                           ("load", lambda: load_checkpoint(path, model)),
                           ("state", lambda: save_checkpoint(path, model, values={"note": "x" * len(first)}))):
            try:
                call()
                errors[what] = ""
            except CheckpointError as err:
                errors[what] = str(err)
    finally:
        checkpoint_format.MAX_JSON_BYTES = original
    values, _ = load_checkpoint(path, model)
    return {"errors": errors, "limit": len(first) - 1, "values": values,
            "unchanged": (Path(path) / INDEX_FILE).read_bytes() == first}


def test_a_save_whose_json_exceeds_the_limit_a_load_reads_fails_before_anything_is_committed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    for result in run_on_ranks(saves_over_the_limit, 2, str(path)):
        limit = result["limit"]
        assert f"index would take {limit + 1} bytes" in result["errors"]["save"]
        assert f"above the {limit} bytes a load reads; nothing was saved" in result["errors"]["save"]
        assert f"larger than {limit} bytes" in result["errors"]["load"]
        assert "The trainer state would take" in result["errors"]["state"]
        assert result["unchanged"] and result["values"] == {"note": "first"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind


LLAMA_70B = {"vocab": 128256, "hidden": 8192, "intermediate": 28672, "layers": 80, "kv": 1024}


def llama_70b_shapes() -> dict[str, tuple[int, ...]]:
    h, i, v = LLAMA_70B["hidden"], LLAMA_70B["intermediate"], LLAMA_70B["vocab"]
    layer = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (LLAMA_70B["kv"], h),
             "self_attn.v_proj.weight": (LLAMA_70B["kv"], h), "self_attn.o_proj.weight": (h, h),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
             "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(LLAMA_70B["layers"]):
        shapes |= {f"model.layers.{n}.{name}": shape for name, shape in layer.items()}
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def test_the_index_of_a_70b_model_saved_by_4096_ranks_is_far_below_the_limit(tmp_path: Path) -> None:
    shapes = llama_70b_shapes()
    assert len(shapes) == 723 and sum(math.prod(s) for s in shapes.values()) > 70e9
    data = simulated_index(shapes, 4096)
    assert len(data) < MAX_JSON_BYTES / 100, len(data)  # about 2 MiB against 256 MiB
    (tmp_path / INDEX_FILE).write_bytes(data)
    index = read_index(tmp_path)  # opens nothing but the index
    assert len(index["tensors"]) == 4 * 723 and len(index["shard_files"]) == 4096
