"""The checkpoint format at scale: an index that grows with tensors + files (never tensors x files), loads that read
only the files holding their rows, a save that gathers the files' records on rank 0 alone and never writes an index a
load would refuse, and version-1 checkpoints (which listed every piece) still read.

Large worlds are simulated: ``lightning_shard.testing_checkpoints.simulate_save`` writes, in one process, the
directory ``world_size`` ranks would write, with the save's own code (checked here against a real 2-rank save)."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import types
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_shard import CheckpointError, consolidate, inspect
from lightning_shard.checkpoint import consolidate as consolidate_module
from lightning_shard.checkpoint import format as checkpoint_format
from lightning_shard.checkpoint import reader as reader_module
from lightning_shard.checkpoint.format import INDEX_FILE, MAX_JSON_BYTES, SMALL_PIECE_BYTES, shard_file_name
from lightning_shard.checkpoint.index import read_index
from lightning_shard.checkpoint.layout import shard_rows
from lightning_shard.checkpoint.reader import RowReads, read_rows
from lightning_shard.engine.param_shard import ShardedParam
from lightning_shard.testing import run_on_ranks
from lightning_shard.testing_checkpoints import simulate_save, simulated_index
from tests.checkpoint_scaling_fits import (
    EXPECTED_V1,
    FIXTURE_V1,
    TallGPT,
    load_counting,
    load_version_1_fixture,
    plain_state,
    save_sharded,
    trained_plain,
)
from tests.models import TinyGPT

SIMULATED_WORLD = 1024


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
    """TinyGPT after one AdamW step, saved by 2 ranks and by 8."""
    root = tmp_path_factory.mktemp("scaling")
    states = {ws: run_on_ranks(save_sharded, ws, str(root / f"w{ws}"), TinyGPT)[0] for ws in (2, 8)}
    return {"root": root, "states": states}


def test_an_index_grows_with_files_not_with_tensors_times_files(two_and_eight: dict[str, Any]) -> None:
    root = two_and_eight["root"]
    sizes = {ws: (root / f"w{ws}" / INDEX_FILE).stat().st_size for ws in (2, 8)}
    assert sizes[8] <= 1.5 * sizes[2], sizes
    index = {ws: json.loads((root / f"w{ws}" / INDEX_FILE).read_text()) for ws in (2, 8)}

    def entries(ws: int) -> dict[str, Any]:  # whole tensors name shard 0's file, whose name says the world size
        tensors = index[ws]["tensors"].items()
        return {k: {**e, "file": e.get("file", "").replace(f"-of-{ws:05d}", "")} for k, e in tensors}

    assert entries(8) == entries(2)  # one entry per tensor, whatever world wrote it
    assert index[8]["shard_files"] == [shard_file_name(s, 8) for s in range(8)]


def test_a_checkpoint_of_8_ranks_loads_on_2_with_exactly_its_tensors(two_and_eight: dict[str, Any]) -> None:
    for loaded in run_on_ranks(load_counting, 2, str(two_and_eight["root"] / "w8"), TinyGPT):
        _assert_equal_states(loaded, two_and_eight["states"][8])


def test_a_simulated_save_writes_what_a_real_save_writes(two_and_eight: dict[str, Any], tmp_path: Path) -> None:
    saved = two_and_eight["states"][2]  # the real 2-rank save's full state, into a plain model and optimizer
    model, optimizer = trained_plain(TinyGPT)
    model.load_state_dict(saved["params"])
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    for p, state in optimizer.state.items():
        for key in state:
            state[key] = saved["optimizer"][f"0/{names[id(p)]}/{key}"].clone()
    simulate_save(tmp_path / "simulated", model, 2, [optimizer], {"step": 1})
    real, simulated = two_and_eight["root"] / "w2", tmp_path / "simulated"
    assert sorted(p.name for p in simulated.iterdir()) == sorted(p.name for p in real.iterdir())
    for path in real.iterdir():
        assert (simulated / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.fixture(scope="module")
def tall(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """TallGPT after one AdamW step, saved as 1,024 FULL_SHARD ranks would save it."""
    model, optimizer = trained_plain(TallGPT)
    path = simulate_save(tmp_path_factory.mktemp("tall") / "ckpt", model, SIMULATED_WORLD, [optimizer], {"step": 1})
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
    real = checkpoint_format.parse_header

    def counting(text: bytes, path: Path | str, *args: Any) -> Any:
        reads.append(Path(path).name)
        return real(text, path, *args)

    monkeypatch.setattr(checkpoint_format, "parse_header", counting)
    out = consolidate(tall["path"], tmp_path / "model.safetensors")
    assert sorted(reads) == sorted(p.name for p in tall["path"].glob("shard-*.safetensors"))
    expected = tall["model"].state_dict()
    for name, value in load_file(str(out)).items():
        assert torch.equal(value, expected[name]), name
    reads.clear()
    assert inspect(tall["path"]).problems == []
    assert sorted(reads) == sorted(p.name for p in tall["path"].glob("shard-*.safetensors"))


_NOT_A_FILE_AT_A_TIME = {"_checked_parts": lambda group, segment: None}  # as files without running CRC-32s are read
_NOT_IN_PLACE = {"_SCATTERED_READS": False}  # as where the C library has no preadv (see [Note: checking pieces ...])
READ_PATHS = {"runs read in place": {},
              "runs read in place, 2 iovecs a call": {"scattered_reads._IOV_MAX": 2},
              "runs read in place, the iovecs of 5 built at once": {"scattered_reads._IOV_ROWS_AT_ONCE": 5},
              "runs read in place, gaps of at most 8 bytes": {"_GAP_BYTES": 8},
              "runs scattered": {"_SCATTER_PIECE_BYTES": 0, **_NOT_IN_PLACE},
              "runs scattered, 2 buffers a call": {"_IOV_MAX": 2, "_SCATTER_PIECE_BYTES": 0, **_NOT_IN_PLACE},
              "runs buffered": {"_scatters": lambda files: False, **_NOT_A_FILE_AT_A_TIME},
              "runs through 40 bytes": {"_scatters": lambda files: False, "_SPAN_BYTES": 40, **_NOT_A_FILE_AT_A_TIME},
              "runs checked a file at a time": {**_NOT_IN_PLACE},
              "runs checked a file at a time, gaps skipped": {"_CRC_GAP_BYTES": 0, **_NOT_IN_PLACE},
              "runs checked a file at a time, gaps skipped, 2 buffers a call": {"_CRC_GAP_BYTES": 0, "_IOV_MAX": 2,
                                                                                **_NOT_IN_PLACE},
              "runs checked a file at a time, buffered": {"_scatters": lambda files: False},
              "runs checked a file at a time, through 40 bytes": {"_scatters": lambda files: False, "_SPAN_BYTES": 40},
              "no runs": {"_RUN_PIECE_BYTES": 0}}


def _read_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make the reader take ``path`` of ``READ_PATHS``."""
    from lightning_shard.checkpoint import reader, scattered_reads

    for name, value in READ_PATHS[path].items():
        module, _, attribute = name.rpartition(".")
        monkeypatch.setattr(scattered_reads if module else reader, attribute, value)


@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_any_rows_of_a_split_tensor_read_exactly_as_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Every [start, stop) of every tensor: pieces cut at either end, whole pieces in runs across files whose
    headers differ (shards 0-1 hold rows of a 2-row weight, shard 5 a short piece, shard 6 nothing); read by each
    path: runs read in place (a file's pieces in one C ``preadv``, each run checked where it landed; also 2 iovecs a
    call, a file's read split at every gap), runs scattered into their targets (``os.preadv``, also 2 buffers a
    call), runs through a buffer (and one of 40 bytes: windows of one file, segments of one piece), each piece
    checked on its own or a file's pieces with one CRC-32 call (their spans read by ``preadv``, the bytes between
    them skipped, or by one read), every piece on its own."""
    _read_path(monkeypatch, path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(23, 2), torch.nn.Linear(2, 23))  # in shards 0-1, the 2 rows first
    ckpt = simulate_save(tmp_path / "ckpt", model, 7)  # 23 rows: 4 a shard, 3 in shard 5
    assert sorted(p.name for p in ckpt.glob("shard-*")) == [shard_file_name(s, 7) for s in range(6)]
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


@pytest.mark.parametrize("path", sorted(READ_PATHS))
def test_a_corrupted_piece_among_many_is_named_by_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    _read_path(monkeypatch, path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64))
    ckpt = simulate_save(tmp_path / "ckpt", model, 16)  # 4 rows of the weight and of the bias a file
    shard = ckpt / shard_file_name(9, 16)
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF  # in the last tensor of the file: the bias (4 rows, 16 bytes)
    shard.write_bytes(bytes(data))
    entry = read_index(ckpt)["tensors"]["model/0.bias"]
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted: 'model/0\.bias' does not match"):
        read_rows(entry, 0, 64)
    assert torch.equal(read_rows(entry, 0, 36), model.state_dict()["0.bias"][:36])  # shards 0-8 are intact
    problems = [f"{shard.name}: SHA-256 differs from the index",
                f"{shard.name}: model/0.bias rows [36, 40] fail their CRC-32"]
    assert inspect(ckpt).problems == problems
    monkeypatch.setattr(consolidate_module, "_BLOCK_BYTES", 7)  # pieces across blocks of the file
    assert inspect(ckpt).problems == problems


# Files read with one CRC-32 call each (see [Note: one checksum a file read] in lightning_shard/checkpoint/reader.py)


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


def _counting_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the reader's CRC-32 calls, and its calls of the functions that check pieces on their own."""
    from lightning_shard.checkpoint import reader

    calls = {"crc32": 0, "pieces checked on their own": 0}

    def counting(name: str, real: Any) -> Any:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return real(*args)
        return call

    monkeypatch.setattr(reader, "zlib", types.SimpleNamespace(crc32=counting("crc32", zlib.crc32)))
    monkeypatch.setattr(reader, "_scatter", counting("pieces checked on their own", reader._scatter))
    monkeypatch.setattr(reader, "_check_pieces_of", counting("pieces checked on their own", reader._check_pieces_of))
    return calls


def test_a_shard_file_holds_its_small_pieces_first_in_each_part(tmp_path: Path) -> None:
    """See [Note: small pieces together] in lightning_shard/checkpoint/save.py."""
    model, optimizer = trained_plain(TinyGPT)
    ckpt = simulate_save(tmp_path / "ckpt", model, 16, [optimizer])
    module_order = [name for name, _ in model.named_parameters()]
    for shard in sorted(ckpt.glob("shard-*.safetensors")):
        raw = shard.read_bytes()
        header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
        header.pop("__metadata__")
        in_order = sorted(header, key=lambda key: header[key]["data_offsets"])
        parts = [key.split("/")[0] for key in in_order]
        assert parts == sorted(parts, key=["model", "optimizer"].index), shard.name  # the model's part first
        for part in ("model", "optimizer"):
            keys = [key for key in in_order if key.startswith(part)]
            small = [(lambda b, e: e - b <= SMALL_PIECE_BYTES)(*header[key]["data_offsets"]) for key in keys]
            assert small == sorted(small, reverse=True), (shard.name, part)  # small ones first
            for group in (True, False):  # each in the module's order
                names = [key.split("/")[-1] if part == "model" else key.split("/")[2]
                         for key, s in zip(keys, small) if s is group]
                assert names == sorted(names, key=module_order.index), (shard.name, part, group)
        assert any(small) and not all(small), shard.name


def test_a_shard_file_records_the_running_crc32_of_its_data_at_each_tensor_end(tmp_path: Path) -> None:
    model, optimizer = trained_plain(TinyGPT)
    ckpt = simulate_save(tmp_path / "ckpt", model, 2, [optimizer])
    for shard in sorted(ckpt.glob("shard-*.safetensors")):
        raw = shard.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + length])
        metadata, data = header.pop("__metadata__"), raw[8 + length :]
        in_order = sorted(header, key=lambda key: header[key]["data_offsets"])
        running = metadata["crc32_running"]
        assert len(running) == 8 * len(in_order)
        for i, key in enumerate(in_order):
            assert int(running[8 * i : 8 * i + 8], 16) == zlib.crc32(data[: header[key]["data_offsets"][1]]), key
        assert int(running[-8:], 16) == zlib.crc32(data)  # the last: the whole data section


@pytest.mark.parametrize(("in_place", "calls"), [(True, 2), (False, 16)])
def test_small_pieces_are_checked_with_one_crc32_call_a_run_or_a_file_and_a_corrupted_byte_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool, calls: int
) -> None:
    """32 pieces: read in place, one call for each tensor's 16; through a buffer, one call a file."""
    model, ckpt = _linear_16(tmp_path)
    monkeypatch.setattr(reader_module, "_SCATTERED_READS", in_place and reader_module._SCATTERED_READS)
    counted = _counting_calls(monkeypatch)
    for name, value in _read_all(ckpt).items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert counted == {"crc32": calls if reader_module._SCATTERED_READS == in_place else 16,  # no C preadv: 16
                       "pieces checked on their own": 0}
    shard = ckpt / shard_file_name(9, 16)
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0x01  # one bit of the weight's piece (the bias is the last 16 bytes)
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted: 'model/0\.weight' does not match"):
        _read_all(ckpt)


@pytest.mark.parametrize("damage", ["other digits", "not hex", "too short", "a number"])
def test_a_damaged_running_crc32_in_a_header_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    _, ckpt = _linear_16(tmp_path)
    monkeypatch.setattr(reader_module, "_SCATTERED_READS", False)  # reads in place check each tensor's CRC-32s
    shard = ckpt / shard_file_name(9, 16)

    def edit(header: dict[str, Any]) -> None:
        running = header["__metadata__"]["crc32_running"]
        header["__metadata__"]["crc32_running"] = {
            "other digits": running[:-8] + f"{int(running[-8:], 16) ^ 1:08x}",  # the whole data section's
            "not hex": running[:-1] + "g", "too short": running[:-8], "a number": 7}[damage]

    _edit_header(shard, edit)
    if damage == "other digits":  # the data and each tensor's CRC-32 agree: the running CRC-32 is what is damaged
        message = rf"{shard.name} is corrupted: its tensor data do not match the running CRC-32s its header records"
    else:
        message = rf"{shard.name}: the header's 'crc32_running' metadata is not 8 hex digits for each of its 2 tensors"
    with pytest.raises(CheckpointError, match=message):
        _read_all(ckpt)


@pytest.mark.parametrize("damage", ["other digits", "not hex", "too short", "a number"])
@pytest.mark.parametrize("in_place", [True, False])
def test_damaged_crc32s_in_a_header_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, in_place: bool
) -> None:
    model, ckpt = _linear_16(tmp_path)
    monkeypatch.setattr(reader_module, "_SCATTERED_READS", in_place and reader_module._SCATTERED_READS)
    shard = ckpt / shard_file_name(9, 16)

    def edit(header: dict[str, Any]) -> None:
        crcs = header["__metadata__"]["crc32"]  # the weight's, then the bias's
        header["__metadata__"]["crc32"] = {
            "other digits": crcs[:-8] + f"{int(crcs[-8:], 16) ^ 1:08x}", "not hex": crcs[:-1] + "g",
            "too short": crcs[:-8], "a number": 7}[damage]

    _edit_header(shard, edit)
    if not in_place and damage in ("other digits", "not hex"):  # read checking the running CRC-32s: the data hold
        assert inspect(ckpt).problems  # ... but inspect, which checks every piece, does not pass them
        for name, value in _read_all(ckpt).items():
            assert torch.equal(value, model.state_dict()[name]), name
        return
    if damage == "other digits":
        message = rf"{shard.name} is corrupted: 'model/0\.bias' does not match its checksum"
    else:
        message = rf"{shard.name}: the header's 'crc32' metadata is not 8 hex digits for each of its 2 tensors"
    with pytest.raises(CheckpointError, match=message):
        _read_all(ckpt)


def _strip_running_crc32s(ckpt: Path) -> None:
    """Make ``ckpt``'s shard files what a save wrote before the running CRC-32s were recorded."""
    for shard in ckpt.glob("shard-*.safetensors"):
        _edit_header(shard, lambda header: header["__metadata__"].pop("crc32_running"))


def test_files_without_running_crc32s_are_read_checking_each_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, ckpt = _linear_16(tmp_path)
    _strip_running_crc32s(ckpt)
    monkeypatch.setattr(reader_module, "_SCATTERED_READS", False)  # reads in place do not use running CRC-32s
    calls = _counting_calls(monkeypatch)
    for name, value in _read_all(ckpt).items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert calls == {"crc32": 32, "pieces checked on their own": 16}  # one call a piece; 16 files
    shard = ckpt / shard_file_name(9, 16)
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupted: 'model/0\.bias' does not match"):
        _read_all(ckpt)


def test_a_checkpoint_without_running_crc32s_loads_on_2_ranks_with_exactly_its_tensors(tmp_path: Path) -> None:
    model, optimizer = trained_plain(TallGPT)
    ckpt = simulate_save(tmp_path / "ckpt", model, 64, [optimizer], {"step": 1})
    _strip_running_crc32s(ckpt)
    for loaded in run_on_ranks(load_counting, 2, str(ckpt), TallGPT):
        _assert_equal_states(loaded, plain_state(model, optimizer))


def test_a_version_1_checkpoint_still_loads_at_any_world_size() -> None:
    expected = load_file(str(EXPECTED_V1))
    assert json.loads((FIXTURE_V1 / INDEX_FILE).read_text())["version"] == 1
    for world_size in (2, 3):
        for loaded in run_on_ranks(load_version_1_fixture, world_size, str(FIXTURE_V1)):
            assert loaded["values"] == {"step": 1}
            for part in ("params", "optimizer"):
                for name, value in loaded[part].items():
                    assert torch.equal(value, expected[f"{part}/{name}"]), f"{part} {name} at {world_size} ranks"


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
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["files"][shard.name]["size"] = shard.stat().st_size
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{shard.name} records no CRC-32 of '.*': it is damaged"):
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
