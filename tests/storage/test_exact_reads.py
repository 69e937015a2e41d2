"""Resharding reads fetch only what they need, verified: check units follow the tensors (small blocks
for small records, tiles of column groups x row groups for wide rows), so a column (dim 1) split and a
slice of a 1 MiB tensor read exactly their bytes -- and a damaged tile is still caught."""

from __future__ import annotations

import glob
import json
import os
import re
import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from damage import flip_byte
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_helpers import unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.errors import CheckpointCorrupt
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter
from smpckpt.storage.format._check_units import MIN_SEGMENT, Tiling, item_checks
from smpckpt.storage.format._checksum import BlockHasher, hash_parts
from smpckpt.storage.format.manifest import FileRecord, Manifest, MetadataRecord
from smpckpt.storage.read._fetch import BufferPool
from smpckpt.storage.tools import read_manifest, verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SPECS = {"m.col*": ShardSpec(1), "m.row*": ShardSpec(0)}


def _oracle(head: bytes, grid: np.ndarray, t: Tiling) -> tuple[list[int], list[int]]:
    """Unit ends and digests from the definition: the head as one block, then per row group, per
    column group, the tile's row segments in row order."""
    ends, digests = [len(head)], [xxhash.xxh3_64_intdigest(head)]
    seg = t.row_bytes // t.groups
    for r in range(0, t.rows, t.rows_per_group):
        rows = grid[r : r + t.rows_per_group]
        for g in range(t.groups):
            tile = np.ascontiguousarray(rows[:, g * seg : (g + 1) * seg]).tobytes()
            ends.append(ends[-1] + len(tile))
            digests.append(xxhash.xxh3_64_intdigest(tile))
    return ends, digests


@st.composite
def tiled_feeds(draw: st.DrawFn) -> tuple[tuple[int, int], int, int, list[int]]:
    cols = draw(st.sampled_from([2048, 3072, 4096, 8192]))
    rows = draw(st.integers(1, 24))
    block = draw(st.sampled_from([16 << 10, 64 << 10, 1 << 20]))
    head = draw(st.integers(1, 300))
    cuts = sorted(draw(st.lists(st.integers(0, rows * cols * 4), max_size=6)))
    return (rows, cols), block, head, cuts


@settings(max_examples=60, derandomize=True, deadline=None)
@given(tiled_feeds())
def test_tiles_match_their_definition_however_the_bytes_arrive(feed: Any) -> None:
    shape, block, head_len, cuts = feed
    checks = item_checks(shape, 4, block)
    assert checks.groups > 1  # rows of >= 8 KiB, columns divisible by 2
    head = bytes(range(256)) * 2
    head = head[:head_len]
    grid = np.random.default_rng(sum(shape) + head_len).integers(0, 256, (shape[0], shape[1] * 4), dtype=np.uint8)
    data = grid.tobytes()
    h = BlockHasher(block)
    h.start_item(len(head))
    h.update(memoryview(head))
    h.start_item(len(data), checks)
    for a, b in zip([0, *cuts], [*cuts, len(data)]):
        h.update(memoryview(data)[a:b])
    ends, digests = h.finish()
    t = Tiling(head_len, head_len + len(data), shape[1] * 4, checks.groups, checks.rows_per_group)
    assert h.tilings == [t]
    assert (ends, digests) == _oracle(head, grid, t)
    # the record accepts them, and hashing each unit's spans of the file gives its digest back
    rec = FileRecord("f", head_len + len(data), 0, tuple(ends), tuple(digests), tilings=(t,))
    whole = memoryview(head + data)
    assert [hash_parts(whole[a:b] for a, b in rec.spans(i)) for i in range(len(ends))] == digests
    assert [r[:2] for r in rec.unit_ranges()] == [(0, head_len)] + [
        (a, min(a + t.group_bytes, t.end)) for a in range(t.start, t.end, t.group_bytes)
    ]


def test_a_tiling_that_disagrees_with_the_block_list_is_refused() -> None:
    t = Tiling(0, 8 * 8192, 8192, 2, 4)
    ends = tuple(t.tile_ends())
    rec = FileRecord("f", t.end, 0, ends, (0,) * len(ends), tilings=(t,))
    m = Manifest("abcdef0123", "partial", "raw", MetadataRecord(".metadata.abcdef0123", 5, 7), (rec,), 1, "now")
    assert m.format_version == 2
    assert Manifest.from_bytes(m.to_bytes()) == m
    plain = FileRecord("g", 10, 0, (10,), (1,))
    assert Manifest("abcdef0123", "partial", "raw", m.metadata, (plain,), 1, "now").format_version == 1
    with pytest.raises(CheckpointCorrupt, match="tiling .* does not match its block list"):
        FileRecord("f", t.end, 0, (*ends[:-2], ends[-2] - 1, ends[-1]), (0,) * len(ends), tilings=(t,))
    with pytest.raises(CheckpointCorrupt, match="tiling .* does not match its block list"):
        FileRecord("f", t.end + 8192, 0, (*ends, t.end + 8192), (0,) * (len(ends) + 1), tilings=(t, t))
    # widening keeps row groups whole; cuts fall only between them
    assert rec.widen(8192 * 5 + 10, 8192 * 5 + 20) == (8192 * 4, 8192 * 8)
    assert rec.is_cut(8192 * 4) and not rec.is_cut(ends[0])


def test_small_records_and_narrow_rows_are_not_tiled() -> None:
    assert item_checks((256, 1024), 4, 1 << 20) == item_checks((1 << 18,), 4, 1 << 20)  # 4 KiB rows
    assert item_checks((1 << 18,), 4, 1 << 20).unit == 16 << 10  # a 1 MiB record: 64 units
    assert item_checks((1 << 26,), 4, 1 << 20).unit == 1 << 20  # large records: the writer's blocks
    wide = item_checks((8192, 8192), 4, 1 << 20)
    assert (wide.groups, wide.row_bytes // wide.groups, wide.rows_per_group) == (8, MIN_SEGMENT, 256)


def _save(tmp_path: Any, tensors: dict[str, torch.Tensor], mode: str = "partial") -> str:
    path = str(tmp_path / "ck")
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save(
        {"m": tensors},
        storage_writer=(FullArtifactWriter if mode == "full" else FsspecStorageWriter)(path),
        planner=planner,
    )
    return path


def _load(path: str, dest: dict[str, torch.Tensor], tp: int, rank: int, verify: bool = True, **kw: Any) -> Any:
    reader = FsspecStorageReader(path, verify_checksums=verify, **kw)
    planner = ParallelLoadPlanner(ParallelLayout(tp=tp), SPECS, rank=rank)
    dcp.load({"m": dest}, storage_reader=reader, planner=planner)
    return reader.last_read_stats


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "col": torch.randn(256, 8192, generator=gen),
        "col_bf16": torch.randn(64, 16384, generator=gen).to(torch.bfloat16),
        **{f"row{i}": torch.randn(256, 1024, generator=gen) for i in range(4)},
    }


@pytest.mark.parametrize(("mode", "verify"), [("partial", True), ("partial", False), ("full", True)])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_column_splits_and_small_row_slices_read_exactly_their_bytes(
    tmp_path: Any, tp: int, mode: str, verify: bool
) -> None:
    """Partial checkpoints, and full (safetensors) artifacts loaded into TP layouts."""
    g = _state()
    path = _save(tmp_path, g, mode)
    for rank in range(tp):
        dest = {k: torch.empty(v.shape[0] // tp, v.shape[1]) for k, v in g.items() if k.startswith("row")}
        dest["col"] = torch.empty(256, 8192 // tp)
        dest["col_bf16"] = torch.empty(64, 16384 // tp, dtype=torch.bfloat16)
        stats = _load(path, dest, tp, rank, verify)
        for k, v in dest.items():
            want = g[k].chunk(tp, dim=1 if k.startswith("col") else 0)[rank]
            assert torch.equal(v, want), (k, rank)
        assert stats.bytes_needed == sum(t.numel() * t.element_size() for t in dest.values())
        assert stats.bytes_read == stats.bytes_needed, (rank, stats.per_file)


def test_a_split_across_column_groups_reads_whole_groups_only(tmp_path: Any) -> None:
    # 6144 columns of fp32: 4 groups of 6 KiB per row; a third of the columns (8 KiB) spans 2 groups
    g = {"col": torch.randn(96, 6144)}
    path = _save(tmp_path, g)
    for rank in range(3):
        dest = {"col": torch.empty(96, 2048)}
        # read a request per row (the groups' 12 KiB gaps cost less than a request by default: streamed)
        stats = _load(path, dest, 3, rank, request_cost_bytes=0)
        assert torch.equal(dest["col"], g["col"][:, rank * 2048 : (rank + 1) * 2048])
        assert stats.bytes_read == 96 * 2 * 6144  # two of four column groups of every row
        assert stats.amplification == 1.5 and stats.requests == 96
        dest = {"col": torch.empty(96, 2048)}
        stats = _load(path, dest, 3, rank)
        assert torch.equal(dest["col"], g["col"][:, rank * 2048 : (rank + 1) * 2048])
        assert stats.bytes_read == 95 * 4 * 6144 + 2 * 6144 and stats.requests == 1  # one span, gaps included


def _flip(path: str, offset: int) -> None:
    """Flip a byte at ``offset`` of the checkpoint's one data file long enough to hold it."""
    (data_file,) = [f for f in glob.glob(os.path.join(path, "*.distcp")) if os.path.getsize(f) >= offset]
    flip_byte(data_file, offset)


def test_a_damaged_tile_fails_the_reads_that_touch_it_and_verify(tmp_path: Any) -> None:
    g = {"col": torch.randn(256, 8192)}
    path = _save(tmp_path, g)
    (rec,) = read_manifest(path).files
    (t,) = rec.tilings
    # a byte in row 40, column group 5 (columns 5120..6143): TP=4 rank 2 reads it, rank 0 does not
    _flip(path, t.start + 40 * t.row_bytes + 5 * t.segment + 100)
    dest = {"col": torch.empty(256, 2048)}
    stats = _load(path, dest, 4, 0)
    assert torch.equal(dest["col"], g["col"][:, :2048]) and stats.amplification == 1.0
    with pytest.raises(CheckpointException) as info:
        _load(path, {"col": torch.empty(256, 2048)}, 4, 2)
    assert isinstance(unwrap(info.value), CheckpointCorrupt)
    assert re.search(r"checksum mismatch .*: a tile, 32 runs .*\['m\.col'\]", str(unwrap(info.value)))
    with pytest.raises(CheckpointException) as info:
        _load(path, {"col": torch.empty(256, 8192)}, 1, 0)  # same layout: read into the destination
    assert isinstance(unwrap(info.value), CheckpointCorrupt) and "checksum mismatch" in str(unwrap(info.value))
    report = verify_checkpoint(path)
    assert not report.ok and len(report.problems) == 1 and "checksum mismatch" in report.problems[0]


def test_verify_names_the_bytes_of_a_damaged_tile(tmp_path: Any) -> None:
    """``verify_checkpoint`` named a damaged tile by its offsets in the block list, which are as if the
    tile were contiguous: bytes 640..768 KiB into the second row group, where the tile's bytes are a
    4 KiB segment of each of its 32 rows -- the flipped byte (20 KiB into that row group) lay outside
    the bytes named. It names the tile's first to last byte and its row segments."""
    path = _save(tmp_path, {"col": torch.randn(256, 8192)})
    (rec,) = read_manifest(path).files
    (t,) = rec.tilings
    assert (t.rows_per_group, t.groups, t.segment, t.row_bytes) == (32, 8, 4096, 32768)
    first = t.start + 32 * t.row_bytes + 5 * t.segment  # row 32 (row group 1), column group 5
    _flip(path, first + 100)
    block = rec.blocks_covering(t.start, t.start + 1)[0] + 8 + 5  # row group 1's sixth tile
    last = first + 31 * t.row_bytes + t.segment
    want = f"{rec.name}: checksum mismatch in bytes {first}..{last} (block {block}: a tile, 32 runs of 4096 bytes every 32768)"
    assert verify_checkpoint(path).problems == (want,)


def test_loads_name_the_bytes_of_a_damaged_tile(tmp_path: Any) -> None:
    """A load refused a damaged tile but named it by its block-list offsets, as if it were contiguous
    (rev59c F2): bytes 640..768 KiB into the row group for a flip 20 KiB in. A resharding read and a
    same-layout read name the tile's first to last byte and its row segments, as verify does."""
    path = _save(tmp_path, {"col": torch.randn(256, 8192)})
    (rec,) = read_manifest(path).files
    (t,) = rec.tilings
    first = t.start + 32 * t.row_bytes + 5 * t.segment  # row group 1, column group 5
    _flip(path, first + 20 * t.row_bytes + 100)  # its row 52
    block = rec.blocks_covering(t.start, t.start + 1)[0] + 8 + 5
    last = first + 31 * t.row_bytes + t.segment
    want = f"checksum mismatch in bytes {first}..{last} (block {block}: a tile, 32 runs of 4096 bytes every 32768) holding key(s) ['m.col']"
    for tp, rank, cols in ((4, 2, 2048), (1, 0, 8192)):  # a column reshard reading group 5; the same layout
        with pytest.raises(CheckpointException) as info:
            _load(path, {"col": torch.empty(256, cols)}, tp, rank)
        assert isinstance(unwrap(info.value), CheckpointCorrupt) and want in str(unwrap(info.value)), (tp, rank)


@pytest.mark.s3
def test_on_s3_a_column_slice_reads_its_row_groups_in_requests_of_at_most_max_request_bytes(
    s3: tuple[str, dict[str, Any]],
) -> None:
    """A column slice's span, widened to whole row groups, is one request when it fits in
    ``max_request_bytes`` (default 64 MiB on object stores); past that it goes in requests of whole row
    groups of at most that many bytes each (it used to be one request, the span in one buffer, however
    large): with 1 MiB, 8 requests of one row group (32 rows) each."""
    base, opts = s3
    g = {"col": torch.randn(256, 8192)}
    url = f"{base}/ck"
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save({"m": g}, storage_writer=FsspecStorageWriter(url, storage_options=opts), planner=planner)
    for cap, requests, nbytes in ((None, 1, 256 * 8192 * 4), (1 << 20, 8, 256 * 8192 * 4)):
        dest = {"col": torch.empty(256, 2048)}
        reader = FsspecStorageReader(url, storage_options=opts, max_request_bytes=cap)
        dcp.load({"m": dest}, storage_reader=reader, planner=ParallelLoadPlanner(ParallelLayout(tp=4), SPECS, rank=3))
        assert torch.equal(dest["col"], g["col"][:, 6144:])
        stats = reader.last_read_stats
        # the slice spans every row, so its span widened to whole row groups is the record
        assert stats.bytes_needed == 256 * 2048 * 4 and stats.bytes_read == nbytes, cap
        assert stats.requests == requests, cap


def _s3_load(url: str, opts: dict[str, Any], dest: dict[str, torch.Tensor], tp: int, rank: int, **kw: Any) -> Any:
    reader = FsspecStorageReader(url, storage_options=opts, **kw)
    dcp.load({"m": dest}, storage_reader=reader, planner=ParallelLoadPlanner(ParallelLayout(tp=tp), SPECS, rank=rank))
    return reader.last_read_stats


@pytest.mark.s3
def test_on_s3_a_column_slice_of_a_large_tensor_holds_a_bounded_buffer(
    s3: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=8 rank 1's columns of a 64 MiB fp32 matrix (rows of 64 KiB): its span (56 MiB) used to be one
    GET into one 56 MiB read buffer (at 1 GiB, +1 GiB of RSS per rank); now requests of at most
    ``max_request_bytes``, each copied into the destination as it lands, so the read buffers held at once
    are one per thread. (Counted at the reader's buffer pool: tracemalloc would count the loopback moto
    server too, which holds the whole object for every GET.)"""
    # copied into CPU destinations on the worker (under the CPU stand-in of the device stage every load
    # goes through the calling thread: up to two parts per thread in flight, tests/storage/test_staging.py)
    monkeypatch.delenv("SMPCKPT_TEST_DEVICE", raising=False)
    base, opts = s3
    g = {"col": torch.arange(1024 * 16384, dtype=torch.float32).view(1024, 16384)}  # 64 MiB, rows of 64 KiB
    url = f"{base}/ck"
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save({"m": g}, storage_writer=FsspecStorageWriter(url, storage_options=opts), planner=planner)
    held, lock = [0, 0], threading.Lock()  # bytes of read buffers out of the pool now, and at most
    take, give_back = BufferPool.take, BufferPool.give_back

    def counted_take(pool: BufferPool, n: int) -> bytearray:
        buf = take(pool, n)
        with lock:
            held[0] += len(buf)
            held[1] = max(held)
        return buf

    def counted_give_back(pool: BufferPool, data: memoryview) -> None:
        with lock:
            held[0] -= len(data.obj) if isinstance(data.obj, bytearray) else 0
        give_back(pool, data)

    monkeypatch.setattr(BufferPool, "take", counted_take)
    monkeypatch.setattr(BufferPool, "give_back", counted_give_back)
    dest = {"col": torch.empty(1024, 2048)}
    stats = _s3_load(url, opts, dest, 8, 1, max_request_bytes=8 << 20, thread_count=2)
    assert torch.equal(dest["col"], g["col"][:, 2048:4096])
    assert held[1] <= 16 << 20, f"{held[1] >> 20} MiB of read buffers held at once for an 8 MiB column slice"
    # a row group (128 rows, 8 MiB) per request, not a request per row (1,024 rows)
    assert stats.requests == 8 and stats.bytes_read == 64 << 20


def _s3_columns() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        # rows of 10,032 bytes: tiled in 2 column groups of 5,016 bytes, row groups of 6 rows; a TP=3 slice
        # (3,344 bytes a row) touches both groups of most rows
        "col_f32": torch.randn(300, 2508, generator=gen),
        # rows of 6,000 bytes: not tiled, 32 KiB blocks that straddle rows (and the requests' edges)
        "col_bf16": torch.randn(512, 3000, generator=gen).to(torch.bfloat16),
        # rows of 32 KiB in 8 groups: a TP=4 slice is 2 of them
        "col_wide": torch.randn(64, 8192, generator=gen),
        # split unevenly at TP=3 (834, 834, 832 columns: the vocabulary-padding case)
        "col_uneven": torch.randn(200, 2500, generator=gen),
    }


UNEVEN = {"m.col_uneven": ShardSpec(1, sizes=(834, 834, 832)), **SPECS}


@pytest.mark.s3
def test_on_s3_column_slices_read_in_bounded_requests_are_bit_exact(s3: tuple[str, dict[str, Any]]) -> None:
    base, opts = s3
    g = _s3_columns()
    url = f"{base}/ck"
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save({"m": g}, storage_writer=FsspecStorageWriter(url, storage_options=opts), planner=planner)
    span = sum(v.numel() * v.element_size() for v in g.values())
    for verify in (True, False):
        for tp, rank in ((3, 0), (3, 1), (3, 2), (4, 1)):
            # col_wide (8192 columns) at TP=4 only; col_uneven at TP=3 only
            want = {k: v.chunk(tp, dim=1)[rank] for k, v in g.items() if k in ("col_f32", "col_bf16")}
            if tp == 3:
                want["col_uneven"] = g["col_uneven"].split([834, 834, 832], dim=1)[rank]
            else:
                want["col_wide"] = g["col_wide"].chunk(tp, dim=1)[rank]
            dest = {k: torch.empty_like(v) for k, v in want.items()}
            reader = FsspecStorageReader(
                url, storage_options=opts, verify_checksums=verify, max_request_bytes=256 << 10
            )
            planner = ParallelLoadPlanner(
                ParallelLayout(tp=tp), UNEVEN if tp == 3 else SPECS, rank=rank, allow_partial_load=True
            )
            dcp.load({"m": dest}, storage_reader=reader, planner=planner)
            for k, v in dest.items():
                assert torch.equal(v, want[k]), (k, tp, rank, verify)
            stats = reader.last_read_stats
            # about the spans in requests of up to 256 KiB (widened to whole blocks when verified: up to 32
            # KiB each side), not one per row (1,076 rows), nor a request of a whole span
            assert stats.requests >= stats.bytes_read // (320 << 10), (tp, rank, verify, stats)
            assert stats.requests <= stats.bytes_read // (200 << 10) + 2 * len(dest), (tp, rank, verify, stats)
            assert stats.bytes_read <= span, (tp, rank, verify)


@pytest.mark.s3
def test_on_s3_rows_farther_apart_than_a_request_costs_are_read_a_request_each(s3: tuple[str, dict[str, Any]]) -> None:
    """rev69b: an S3 column slice shared a request between rows whenever their span fit
    ``max_request_bytes``, whatever the gap: TP=4 of fp32 rows of 64 KiB under a 256 KiB cap requested
    3.25x the bytes it needed (TP=8: 6.25x), and rows of 2 MiB at the 64 MiB default 4x (the whole record).
    Now object stores take the local disk's cost model (``streams``): rows whose unread gap costs more than
    one more request (``request_cost_bytes``; 1 MiB by default there) take a request each, of the slice's
    tile columns, so the bytes requested are the bytes needed; rows closer than that still share requests."""
    base, opts = s3
    gen = torch.Generator().manual_seed(11)
    g = {
        "col": torch.randn(64, 16384, generator=gen),  # rows of 64 KiB in 8 column groups
        "col_big": torch.randn(4, 1 << 19, generator=gen),  # rows of 2 MiB
        "col_bf16": torch.randn(512, 3000, generator=gen).to(torch.bfloat16),  # rows of 6,000 bytes, untiled
    }
    url = f"{base}/ck"

    def _partial(url: str, opts: dict[str, Any], dest: dict[str, torch.Tensor], tp: int, rank: int, **kw: Any) -> Any:
        reader = FsspecStorageReader(url, storage_options=opts, **kw)
        planner = ParallelLoadPlanner(ParallelLayout(tp=tp), SPECS, rank=rank, allow_partial_load=True)
        dcp.load({"m": dest}, storage_reader=reader, planner=planner)
        return reader.last_read_stats

    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save({"m": g}, storage_writer=FsspecStorageWriter(url, storage_options=opts), planner=planner)
    for key, tp, rank, cap, cost, rows in (
        ("col", 4, 1, 256 << 10, 16 << 10, 64),
        ("col", 8, 3, 256 << 10, 16 << 10, 64),
        ("col_big", 4, 1, None, None, 4),
        ("col_big", 8, 6, 256 << 10, None, 4),
    ):
        for verify in (True, False):
            want = g[key].chunk(tp, dim=1)[rank]
            dest = {key: torch.full_like(want, float("nan"))}
            kw = {"request_cost_bytes": cost} if cost is not None else {}
            stats = _partial(url, opts, dest, tp, rank, max_request_bytes=cap, verify_checksums=verify, **kw)
            assert torch.equal(dest[key], want), (key, tp, rank, verify)
            # the slice's own bytes (its tile columns are exactly its columns), a request a row
            assert stats.bytes_needed == want.numel() * 4, (key, tp, verify, stats)
            assert stats.bytes_read <= 1.05 * stats.bytes_needed, (key, tp, cap, verify, stats)
            assert stats.bytes_read == stats.bytes_needed and stats.requests == rows, (key, tp, cap, verify, stats)
    # rows closer than a request costs share requests as before: TP=4 of rows of 6,000 bytes (a gap of 4,500)
    # in about 256 KiB spans, not 512 requests of 1,500 bytes
    want = g["col_bf16"].chunk(4, dim=1)[1]
    dest = {"col_bf16": torch.empty_like(want)}
    stats = _partial(url, opts, dest, 4, 1, max_request_bytes=256 << 10, request_cost_bytes=16 << 10)
    assert torch.equal(dest["col_bf16"], want)
    assert stats.requests <= 16 and stats.bytes_read >= 512 * 6000 * 3 // 4, stats


@pytest.mark.s3
def test_on_s3_an_untiled_verified_slice_with_wide_gaps_reads_each_rows_blocks(s3: tuple[str, dict[str, Any]]) -> None:
    """Issue 47 (2): an untiled record (an odd column count: no tiles) verified on S3 read a column slice's
    whole span widened to blocks in one request, whatever the gap (TP=3 of rows of 360,012 bytes: 4 MiB for
    the 1.4 MB needed), because its blocks straddle rows. Now, where the gap between rows' runs widened to
    whole blocks costs more than a request, each row is one request of exactly the blocks its run touches,
    every one of them checked: a flipped byte in a block a run touches but does not use (another rank's
    columns) still refuses the load; unverified, the slice's own bytes load bit-exact."""
    base, opts = s3
    t = torch.randn(12, 3 * 30001, generator=torch.Generator().manual_seed(5))  # rows of 360,012 bytes
    url = f"{base}/odd"
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save({"m": {"col_odd": t}}, storage_writer=FsspecStorageWriter(url, storage_options=opts), planner=planner)
    md = FsspecStorageReader(url, storage_options=opts).read_metadata()
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == "m.col_odd"]
    (rec,) = [r for r in read_manifest(url, opts).files if r.name == info.relative_path]
    assert not rec.tilings  # the case in question: blocks, not tiles
    row, width, ends = 3 * 30001 * 4, 30001 * 4, [0, *rec.block_ends]
    widened = []  # each row's run of rank 1's columns, widened to the blocks it touches (file offsets)
    for r in range(12):
        a = info.offset + r * row + width
        widened.append((max(e for e in ends if e <= a), min(e for e in ends if e >= a + width)))
    assert all(row - (hi - lo) >= 16 << 10 for lo, hi in widened)  # gaps past the request cost below
    want = t.chunk(3, dim=1)[1]
    for verify, nbytes in ((True, sum(hi - lo for lo, hi in widened)), (False, 12 * width)):
        dest = {"col_odd": torch.full_like(want, float("nan"))}
        stats = _s3_load(url, opts, dest, 3, 1, request_cost_bytes=16 << 10, verify_checksums=verify)
        assert torch.equal(dest["col_odd"], want), verify
        assert (stats.bytes_needed, stats.bytes_requested, stats.requests) == (12 * width, nbytes, 12), stats
    # a request cost past the gaps between the widened runs (not the runs' own gaps): one request again (rev72d L2)
    assert all(200_000 > row - (hi - lo) for lo, hi in widened) and 200_000 <= row - width
    dest = {"col_odd": torch.full_like(want, float("nan"))}
    stats = _s3_load(url, opts, dest, 3, 1, request_cost_bytes=200_000)
    assert torch.equal(dest["col_odd"], want)
    assert (stats.bytes_requested, stats.requests) == (widened[-1][1] - widened[0][0], 1), stats
    # row 5's run is widened back into rank 0's columns: a byte there is read, checked, never used
    lo5 = widened[5][0]
    assert lo5 + 10 < info.offset + 5 * row + width
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    name = _flip_s3(fs, url, opts, t, lo5 + 10 - info.offset)
    dest = {"col_odd": torch.empty_like(want)}
    with pytest.raises(CheckpointException) as info_:
        _s3_load(url, opts, dest, 3, 1, request_cost_bytes=16 << 10)
    err = unwrap(info_.value)
    assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err), err
    assert name in str(err) and "m.col_odd" in str(err), err
    _s3_load(url, opts, dest, 3, 1, request_cost_bytes=16 << 10, verify_checksums=False)
    assert torch.equal(dest["col_odd"], want)


@pytest.mark.s3
def test_on_s3_a_damaged_block_across_two_requests_of_a_column_slice_is_refused(
    s3: tuple[str, dict[str, Any]],
) -> None:
    base, opts = s3
    g = {k: v for k, v in _s3_columns().items() if k in ("col_f32", "col_bf16")}
    url = f"{base}/ck"
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save({"m": g}, storage_writer=FsspecStorageWriter(url, storage_options=opts), planner=planner)
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    # TP=3 rank 2 reads columns 2000..2999 (bytes 4000..6000 of each 6,000-byte row) in requests of 43
    # rows (256 KiB): the first ends at row 42's last byte, the next starts at row 43's byte 4000. The
    # 32 KiB block at 229,376..262,144 of the record holds both, and between them row 43's byte 100,
    # which neither request's rows use: flipped, the block's check still refuses the load.
    assert 229376 <= 43 * 6000 + 100 < 262144
    name = _flip_s3(fs, url, opts, g["col_bf16"], 43 * 6000 + 100)
    dest = {k: torch.empty_like(v.chunk(3, dim=1)[2]) for k, v in g.items()}
    with pytest.raises(CheckpointException) as info:
        _s3_load(url, opts, dest, 3, 2, max_request_bytes=256 << 10)
    err = unwrap(info.value)
    assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err), err
    assert name in str(err) and "m.col_bf16" in str(err), err
    # unverified, the slice's own bytes are intact: bit-exact
    dest = {k: torch.empty_like(v.chunk(3, dim=1)[2]) for k, v in g.items()}
    _s3_load(url, opts, dest, 3, 2, verify_checksums=False, max_request_bytes=256 << 10)
    assert all(torch.equal(v, g[k].chunk(3, dim=1)[2]) for k, v in dest.items())
    _flip_s3(fs, url, opts, g["col_bf16"], 43 * 6000 + 100)  # flipped back
    # a flipped byte inside a tiled slice's own columns (col_f32 row 100, column 1,000: TP=3 rank 1's)
    name = _flip_s3(fs, url, opts, g["col_f32"], 100 * 10032 + 1000 * 4)
    dest = {k: torch.empty_like(v.chunk(3, dim=1)[1]) for k, v in g.items()}
    with pytest.raises(CheckpointException) as info:
        _s3_load(url, opts, dest, 3, 1, max_request_bytes=256 << 10)
    err = unwrap(info.value)
    assert isinstance(err, CheckpointCorrupt) and name in str(err) and "m.col_f32" in str(err), err


def _flip_s3(fs: Any, url: str, opts: dict[str, Any], t: torch.Tensor, offset: int) -> str:
    """Flip byte ``offset`` of ``t``'s record in the S3 data file that holds it; returns the file's name."""
    head = t.view(torch.uint8).numpy().tobytes()[:64]
    for rec in read_manifest(url, opts).files:
        data = bytearray(fs.cat_file(f"{url}/{rec.name}"))
        if (start := bytes(data).find(head)) >= 0:
            data[start + offset] ^= 0x10
            fs.pipe_file(f"{url}/{rec.name}", bytes(data))
            return str(rec.name)
    raise AssertionError("no data file holds the tensor")


@pytest.mark.s3
@pytest.mark.parametrize("stand_in", [False, True], ids=["in-place", "cpu-stand-in"])
def test_on_s3_a_row_group_past_max_request_bytes_is_read_as_runs_of_the_slices_columns(
    s3: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, stand_in: bool
) -> None:
    """A tiled row group larger than ``max_request_bytes`` (a fused QKV's rows of 128 MiB at a 70B shape,
    one row a group) was one request of the whole group, of which a TP=8 rank used an eighth (rev68e):
    8x the bytes, in one buffer per reader thread. Now the slice's column groups of each row are read
    (rows sharing a request while their span fits the cap; a run past the cap cut at column groups), each
    tile verified where it landed. Scaled down: rows of 256 KiB, 16 KiB check units (tiles of one row), a
    64 KiB cap; and rows of 64 KiB in row groups of 8 rows (512 KiB) under a 128 KiB cap."""
    if stand_in:  # every destination through a read buffer and the device stage's CPU stand-in
        monkeypatch.setenv("SMPCKPT_TEST_DEVICE", "cpu")
    else:
        monkeypatch.delenv("SMPCKPT_TEST_DEVICE", raising=False)
    base, opts = s3
    gen = torch.Generator().manual_seed(7)
    g = {"col": torch.randn(16, 65536, generator=gen), "col_b": torch.randn(64, 16384, generator=gen)}
    url = f"{base}/ck"
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    writer = FsspecStorageWriter(url, storage_options=opts, block_size=16 << 10)
    dcp.save({"m": {"col": g["col"]}}, storage_writer=writer, planner=planner)
    url_b = f"{base}/ck_b"
    writer = FsspecStorageWriter(url_b, storage_options=opts)
    dcp.save({"m": {"col": g["col_b"]}}, storage_writer=writer, planner=planner)
    tilings = {
        t.row_bytes: t for f in read_manifest(url, opts).files + read_manifest(url_b, opts).files for t in f.tilings
    }
    assert [(t.rows_per_group, t.segment) for t in tilings.values()] == [(1, 32 << 10), (8, 8 << 10)]
    # (url, tp, rank, cap) -> requests, bytes requested: TP=8 one 32 KiB run per row; TP=2 a 128 KiB run per
    # row past the cap, in pieces of two column groups; row groups of 8 rows, two rows a request (72 KiB)
    for where, tp, rank, cap, requests, nbytes in (
        (url, 8, 1, 64 << 10, 16, 16 * (32 << 10)),
        (url, 2, 1, 64 << 10, 32, 16 * (128 << 10)),
        (url_b, 8, 5, 128 << 10, 32, 32 * (72 << 10)),
    ):
        src = g["col"] if where == url else g["col_b"]
        dest = {"col": torch.empty(src.shape[0], src.shape[1] // tp)}
        stats = _s3_load(where, opts, dest, tp, rank, max_request_bytes=cap)
        assert torch.equal(dest["col"], src.chunk(tp, dim=1)[rank]), (where, tp, rank)
        # before: a request of each whole row group, 8 (or 4) times the bytes the slice uses
        assert (stats.requests, stats.bytes_read) == (requests, nbytes), (where, tp, rank, stats)
    # an uneven split (TP=3: 21,846 columns of 65,536) reads the column groups its columns touch
    dest = {"col": torch.empty(16, 21846)}
    reader = FsspecStorageReader(url, storage_options=opts, max_request_bytes=64 << 10)
    specs = {"m.col": ShardSpec(1, sizes=(21845, 21846, 21845))}
    dcp.load({"m": dest}, storage_reader=reader, planner=ParallelLoadPlanner(ParallelLayout(tp=3), specs, rank=1))
    assert torch.equal(dest["col"], g["col"][:, 21845:43691])
    assert reader.last_read_stats.bytes_read == 16 * 4 * (32 << 10)  # column groups 2..5 of each row
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    # a flipped byte in row 5, column group 1 (TP=8 rank 1's): refused, naming the tile and the key; the
    # same flip in column group 3, which rank 1 does not read, leaves its load bit-exact
    for group, refused in ((3, False), (1, True)):
        name = _flip_s3(fs, url, opts, g["col"], 5 * 65536 * 4 + group * (32 << 10) + 100)
        dest = {"col": torch.empty(16, 8192)}
        if refused:
            with pytest.raises(CheckpointException) as info:
                _s3_load(url, opts, dest, 8, 1, max_request_bytes=64 << 10)
            err = unwrap(info.value)
            assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err), err
            assert name in str(err) and "m.col" in str(err), err
        else:
            _s3_load(url, opts, dest, 8, 1, max_request_bytes=64 << 10)
            assert torch.equal(dest["col"], g["col"][:, 8192:16384])
        _flip_s3(fs, url, opts, g["col"], 5 * 65536 * 4 + group * (32 << 10) + 100)  # back


@pytest.mark.s3
def test_on_s3_a_full_artifact_loads_a_column_split_with_few_spanning_reads(s3: tuple[str, dict[str, Any]]) -> None:
    base, opts = s3
    g = {"col": torch.randn(256, 8192)}
    url = f"{base}/full"
    planner = ParallelSavePlanner(ParallelLayout(), SPECS)
    dcp.save({"m": g}, storage_writer=FullArtifactWriter(url, storage_options=opts), planner=planner)
    for rank in range(4):
        dest = {"col": torch.empty(256, 2048)}
        reader = FsspecStorageReader(url, storage_options=opts)
        planner = ParallelLoadPlanner(ParallelLayout(tp=4), SPECS, rank=rank)
        dcp.load({"m": dest}, storage_reader=reader, planner=planner)
        assert torch.equal(dest["col"], g["col"][:, rank * 2048 : (rank + 1) * 2048])
        stats = reader.last_read_stats
        # each tile's rows come in one enclosing GET: at most the tensor, counted as fetched
        assert stats.bytes_needed == 256 * 2048 * 4 < stats.bytes_read <= 256 * 8192 * 4


def test_a_full_artifact_loads_in_place_and_a_damaged_tile_fails_only_its_reads(tmp_path: Any) -> None:
    g = {"col": torch.randn(256, 8192)}
    path = _save(tmp_path, g, "full")
    dest = {"col": torch.empty(256, 8192)}
    stats = _load(path, dest, 1, 0)  # same layout: read straight into the destination, tiles checked there
    assert torch.equal(dest["col"], g["col"]) and stats.bytes_read == stats.bytes_needed == 256 * 8192 * 4
    (art,) = glob.glob(os.path.join(path, "*.safetensors"))
    with open(art, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    (key,) = [k for k in header if k.endswith("col")]
    start = 8 + n + header[key]["data_offsets"][0]
    # row 40, bytes 5 * 4096 + 100 of the row: column group 5 of 8 -- TP=4 rank 2 reads it, rank 0 not
    flip_byte(art, start + 40 * 8192 * 4 + 5 * 4096 + 100)
    dest = {"col": torch.empty(256, 2048)}
    stats = _load(path, dest, 4, 0)
    assert torch.equal(dest["col"], g["col"][:, :2048]) and stats.amplification == 1.0
    for tp, rank, cols in ((4, 2, 2048), (1, 0, 8192)):
        with pytest.raises(CheckpointException) as info:
            _load(path, {"col": torch.empty(256, cols)}, tp, rank)
        err = unwrap(info.value)
        assert isinstance(err, CheckpointCorrupt) and "checksum mismatch in tensor" in str(err), err
        assert os.path.basename(art) in str(err)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.float64, torch.int64, torch.bfloat16])
def test_slices_of_records_at_odd_offsets(tmp_path: Any, dtype: torch.dtype) -> None:
    """Raw records are packed back to back, so one can start at any byte (here after a 1,001-byte bool
    tensor). A column slice of it is decoded from a read buffer; torch copied complex128 from such an
    address assuming 16-byte alignment and the process died (SIGSEGV)."""
    z = torch.randn(6, 10, dtype=torch.complex128, generator=torch.Generator().manual_seed(0)) * 100
    z = z.to(dtype) if dtype.is_complex else z.real.to(dtype)
    state = {"a": torch.ones(1001, dtype=torch.bool), "z": z}
    path = str(tmp_path)
    dcp.save(
        state,
        storage_writer=FsspecStorageWriter(path, thread_count=1),
        planner=ParallelSavePlanner(ParallelLayout(), rank=0),
        no_dist=True,
    )
    md = FsspecStorageReader(path).read_metadata()
    offsets = [info.offset for index, info in md.storage_data.items() if index.fqn == "z"]
    assert offsets and offsets[0] % 16, offsets  # the case this test is about: an unaligned record
    for rank in (0, 1):
        out = {"a": torch.zeros(1001, dtype=torch.bool), "z": torch.zeros(6, 5, dtype=dtype)}
        dcp.load(
            out,
            storage_reader=FsspecStorageReader(path),
            planner=ParallelLoadPlanner(ParallelLayout(tp=2), {"z": ShardSpec(1)}, rank=rank),
            no_dist=True,
        )
        assert torch.equal(out["z"], z[:, 5 * rank : 5 * rank + 5]) and torch.equal(out["a"], state["a"])
