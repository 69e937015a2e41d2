"""Strided (column, dim >= 1) slices on local disk: a request per row, spread over the reader's threads
and with no read-ahead on their descriptors; rows closer than a page (or than ``coalesce_gap``) share
requests, the gaps read into a scratch buffer; rows whose gaps cost less than a request
(``request_cost_bytes``, the planner's cost model) are read as sequential spans of whole rows.
``last_read_stats`` says what was asked of storage (``bytes_requested``, ``requests``) and what the
device read (``device_bytes``), and on a cold load the two agree: no read-ahead past what was asked, for
column slices and for scattered row slices alike."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from storage_helpers import unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.errors import CheckpointCorrupt
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter
from smpckpt.storage.format._reading import ReadStats, in_memory
from smpckpt.storage.read import _plan, _run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB, MiB = 1 << 10, 1 << 20
SAVE_SPECS = {"m.col*": ShardSpec(1), "m.row*": ShardSpec(0)}


def _save(path: str, tensors: dict[str, torch.Tensor], writer: Any = FsspecStorageWriter, **kw: Any) -> None:
    planner = ParallelSavePlanner(ParallelLayout(), SAVE_SPECS)
    dcp.save({"m": tensors}, storage_writer=writer(path, **kw), planner=planner)


def _load(
    path: str, dest: dict[str, torch.Tensor], tp: int, rank: int, specs: Any = None, cast: bool = False, **kw: Any
) -> ReadStats:
    reader = FsspecStorageReader(path, **kw)
    planner = ParallelLoadPlanner(ParallelLayout(tp=tp), specs or SAVE_SPECS, rank=rank, allow_dtype_cast=cast)
    dcp.load({"m": dest}, storage_reader=reader, planner=planner)
    assert reader.last_read_stats is not None
    return reader.last_read_stats


def test_wide_rows_are_read_a_request_each_on_several_threads_without_read_ahead(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = {"col": torch.randn(256, 16384, generator=torch.Generator().manual_seed(1))}  # rows of 64 KiB
    path = str(tmp_path / "ck")
    _save(path, g)
    # parts of 1 MiB (64 rows of 16 KiB here): four of them for the slice
    monkeypatch.setattr(_run, "PIECE_BYTES", MiB)
    threads: set[int] = set()
    both = threading.Barrier(2, timeout=60)  # the first reads of two threads must be under way at once
    asked: list[int] = []
    advice: list[int] = []
    lock = threading.Lock()
    preadv, fadvise = os.preadv, os.posix_fadvise

    def spy_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        with lock:
            asked.append(sum(len(b) for b in buffers))
            first = threading.get_ident() not in threads and len(threads) < 2
            threads.add(threading.get_ident())
        if first:
            both.wait()  # a serial reader never brings the second party: BrokenBarrierError
        return preadv(fd, buffers, offset, *flags)

    def spy_fadvise(fd: int, offset: int, length: int, what: int) -> None:
        advice.append(what)
        fadvise(fd, offset, length, what)

    monkeypatch.setattr(os, "preadv", spy_preadv)
    monkeypatch.setattr(os, "posix_fadvise", spy_fadvise)
    dest = {"col": torch.full((256, 4096), -1.0)}
    stats = _load(path, dest, 4, 2, thread_count=4)
    monkeypatch.undo()
    assert torch.equal(dest["col"], g["col"][:, 8192:12288])
    assert len(threads) >= 2
    # a row of the slice is two of the eight 8 KiB column groups: 16 KiB, exactly what is needed
    assert stats.bytes_requested == stats.bytes_needed == 256 * 16 * KiB and stats.requests == 256
    assert asked.count(16 * KiB) == 256 and max(asked) == 16 * KiB
    assert advice and set(advice) == {os.POSIX_FADV_RANDOM}


def test_rows_closer_than_a_page_share_requests(tmp_path: Any) -> None:
    """Unverified: rank 0 of an uneven split wants 14 KiB of every 16 KiB row; the 2 KiB gaps are read."""
    g = {"col": torch.randn(1024, 4096, generator=torch.Generator().manual_seed(2))}
    path = str(tmp_path / "ck")
    _save(path, g)
    uneven = {"m.col": ShardSpec(1, sizes=[3584, 512])}
    dest = {"col": torch.zeros(1024, 3584)}
    stats = _load(path, dest, 2, 0, uneven, verify_checksums=False)
    assert torch.equal(dest["col"], g["col"][:, :3584])
    width, gap = 14 * KiB, 2 * KiB
    batches = [_plan.ROWS_PER_CALL, _plan.ROWS_PER_CALL, 1024 - 2 * _plan.ROWS_PER_CALL]  # iovecs per preadv
    assert stats.requests == len(batches)
    assert stats.bytes_requested == sum(n * width + (n - 1) * gap for n in batches)
    assert stats.bytes_needed == 1024 * width


def test_coalesce_gap_merges_wider_gaps_verified(tmp_path: Any) -> None:
    """bf16 rows of 8 KiB: tiles of 4 KiB; TP=4 wants 2 KiB per row and reads its tile: streamed (the gap
    is below a request's cost), in two sequential requests of 4 MiB; with ``coalesce_gap=4096`` each row
    group of 32 rows is one request, gaps included."""
    g = {"col_bf16": torch.randn(1024, 4096, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    path = str(tmp_path / "ck")
    _save(path, g)
    streamed = 2 * (511 * 8 + 4) * KiB  # rows 0-511 and 512-1023, each from its tile's first byte
    for gap_opt, requests, requested in [(0, 2, streamed), (4096, 32, 32 * (32 * 4 + 31 * 4) * KiB)]:
        for rank in range(4):
            dest = {"col_bf16": torch.zeros(1024, 1024, dtype=torch.bfloat16)}
            stats = _load(path, dest, 4, rank, coalesce_gap=gap_opt)
            assert torch.equal(dest["col_bf16"], g["col_bf16"][:, rank * 1024 : (rank + 1) * 1024]), (gap_opt, rank)
            assert (stats.requests, stats.bytes_requested) == (requests, requested), (gap_opt, rank)
            assert stats.bytes_needed == 1024 * 2 * KiB and stats.amplification == requested / stats.bytes_needed


def test_small_runs_are_read_as_sequential_spans(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rows of 8 KiB, TP=4: each rank needs 2 KiB of every row, whose 4 KiB tile it must verify. A
    request per row costs more than reading the 4 KiB gap (``_plan.streams``), so each part of whole
    rows is one sequential request: few large requests, values bit-exact, whether the rows are copied
    into the destination on the worker (TP=4, TP=2: the tile is the slice), or delivered from a buffer
    (a cast destination; a turn at the device), and every tile used verified (a flipped byte in one
    fails the load; one in a column group not used does not)."""
    g = {"col_bf16": torch.randn(1024, 4096, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    path = str(tmp_path / "ck")
    _save(path, g)
    monkeypatch.setattr(_run, "STREAM_PART_BYTES", 2 * MiB)  # parts of 256 rows (8 row groups of 32)
    asked: list[int] = []
    preadv = os.preadv

    def spy(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        asked.append(sum(len(b) for b in buffers))
        return preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", spy)
    span = 255 * 8 * KiB + 4 * KiB  # first row's tile column to the last row's: one request per part
    for tp, dtype, kw in [
        (4, torch.bfloat16, {}),
        (2, torch.bfloat16, {}),
        (4, torch.float32, {"cast": True}),
        (4, torch.bfloat16, {"reads_in_flight": 1, "thread_count": 2}),
    ]:
        width = 4096 // tp
        for rank in range(tp):
            asked.clear()
            dest = {"col_bf16": torch.zeros(1024, width, dtype=dtype)}
            stats = _load(path, dest, tp, rank, **kw)
            want = g["col_bf16"][:, rank * width : (rank + 1) * width].to(dtype)
            assert torch.equal(dest["col_bf16"], want), (tp, dtype, kw, rank)
            assert (stats.requests, stats.bytes_requested) == (4, 4 * span), (tp, dtype, kw, rank, stats)
            assert asked == [span] * 4, (tp, dtype, kw, rank)
            assert stats.bytes_needed == 1024 * width * 2
    # unverified (no tiles): fp32 rows of 16 KiB needing 8 KiB stream too, in parts of whole rows of the
    # part size (2 MiB: 128 rows), not of ROWS_PER_CALL rows (511 rows of any width: 511 MiB of 1 MiB rows)
    g32 = {"col": torch.randn(512, 4096, generator=torch.Generator().manual_seed(10))}
    upath = str(tmp_path / "unverified")
    _save(upath, g32)
    asked.clear()
    stats = _load(upath, dest := {"col": torch.zeros(512, 2048)}, 2, 1, verify_checksums=False)
    assert torch.equal(dest["col"], g32["col"][:, 2048:])
    assert asked == [(127 * 16 + 8) * KiB] * 4  # 4 parts of 128 rows, each one request
    assert (stats.requests, stats.bytes_requested) == (4, sum(asked))
    monkeypatch.undo()
    # rows of 64 KiB needing 16 KiB (a 48 KiB gap): a request per row however cold
    wide = {"col": torch.randn(64, 16384, generator=torch.Generator().manual_seed(8))}
    wpath = str(tmp_path / "wide")
    _save(wpath, wide)
    stats = _load(wpath, {"col": torch.zeros(64, 4096)}, 4, 1)
    assert (stats.requests, stats.bytes_requested) == (64, 64 * 16 * KiB)
    # the data file holds the record from offset 0 on (one tensor): flip a byte of rank 1's tile (row 5,
    # byte 100 of the row), then one of the column group rank 1 does not use (row 5, byte 6000)
    (data,) = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
    for at, fails in [(5 * 8 * KiB + 6000, False), (5 * 8 * KiB + 100, True)]:
        with open(data, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        dest = {"col_bf16": torch.zeros(1024, 1024, dtype=torch.bfloat16)}
        if fails:
            with pytest.raises(CheckpointException) as info:
                _load(path, dest, 4, 1)
            err = unwrap(info.value)
            assert isinstance(
                err, CheckpointCorrupt
            ) and "checksum mismatch in bytes 0..258048 (block 0: a tile, 32 runs of 4096 bytes every 8192)" in str(
                err
            ), err
        else:
            _load(path, dest, 4, 1)
            assert torch.equal(dest["col_bf16"], g["col_bf16"][:, 1024:2048])


def _cold(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _device_read_bytes_work(tmp_path: Any) -> bool:
    """Whether this test's folder sits on a block device whose cache can be dropped (not tmpfs)."""
    probe = tmp_path / "probe"
    probe.write_bytes(os.urandom(MiB))
    if in_memory(os.stat(probe).st_dev):
        return False
    _cold(str(tmp_path))
    before = int(open("/proc/self/io").read().split("read_bytes:")[1].split()[0])
    probe.read_bytes()
    after = int(open("/proc/self/io").read().split("read_bytes:")[1].split()[0])
    return after - before >= MiB


def test_cold_loads_read_from_the_device_what_they_asked_for(tmp_path: Any) -> None:
    if not os.path.exists("/proc/self/io") or not _device_read_bytes_work(tmp_path):
        pytest.skip("needs a block device whose page cache can be dropped (/proc/self/io, not tmpfs)")
    gen = torch.Generator().manual_seed(4)
    col = {"col": torch.randn(512, 16384, generator=gen)}  # 32 MiB, rows of 64 KiB
    rows = {f"row{i:02d}": torch.randn(256, 1024, generator=gen) for i in range(32)}  # 1 MiB each
    for name, tensors, tp, rank, shape in [
        ("col", col, 4, 1, (512, 4096)),
        ("rows", rows, 4, 2, (64, 1024)),
    ]:
        path = str(tmp_path / name)
        _save(path, tensors)
        _cold(path)
        dest = {k: torch.zeros(shape) for k in tensors}
        stats = _load(path, dest, tp, rank)
        for k, v in tensors.items():
            assert torch.equal(dest[k], v.chunk(tp, dim=1 if k == "col" else 0)[rank]), k
        assert stats.bytes_requested == stats.bytes_needed, name
        assert stats.device_bytes is not None and stats.device_amplification is not None
        # what the device read is what was asked for: no read-ahead past the slices
        assert stats.bytes_requested <= stats.device_bytes <= stats.bytes_requested * 1.05 + 64 * KiB, (name, stats)
        warm = _load(path, {k: torch.zeros(shape) for k in tensors}, tp, rank)
        assert warm.device_bytes == 0, name


def test_cold_small_runs_read_from_the_device_the_spans_they_asked_for(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed bf16 column slice on a real dropped page cache: the device reads the spans asked for
    and no more (no read-ahead past them); warm, the same requests and no device bytes."""
    if not os.path.exists("/proc/self/io") or not _device_read_bytes_work(tmp_path):
        pytest.skip("needs a block device whose page cache can be dropped (/proc/self/io, not tmpfs)")
    g = {"col_bf16": torch.randn(1024, 4096, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)}
    path = str(tmp_path / "ck")
    _save(path, g)
    monkeypatch.setattr(_run, "STREAM_PART_BYTES", 2 * MiB)
    _cold(path)
    want = g["col_bf16"][:, 2048:3072]
    for temp in ("cold", "warm"):
        dest = {"col_bf16": torch.zeros(1024, 1024, dtype=torch.bfloat16)}
        stats = _load(path, dest, 4, 2)
        assert torch.equal(dest["col_bf16"], want), temp
        assert (stats.requests, stats.bytes_requested) == (4, 4 * (255 * 8 * KiB + 4 * KiB)), (temp, stats)
        assert stats.device_bytes is not None, temp
        if temp == "cold":
            assert stats.bytes_requested <= stats.device_bytes <= stats.bytes_requested * 1.05 + 64 * KiB, stats
        else:
            assert stats.device_bytes == 0, stats


def test_full_artifacts_report_device_bytes_too(tmp_path: Any) -> None:
    g = {"col": torch.randn(64, 8192, generator=torch.Generator().manual_seed(5))}
    path = str(tmp_path / "full")
    _save(path, g, FullArtifactWriter)
    dest = {"col": torch.zeros(64, 4096)}
    stats = _load(path, dest, 2, 1)
    assert torch.equal(dest["col"], g["col"][:, 4096:])
    assert stats.device_bytes is not None and stats.bytes_requested == stats.bytes_read >= stats.bytes_needed


@pytest.mark.s3
def test_on_s3_device_bytes_are_not_reported(s3: tuple[str, dict[str, Any]]) -> None:
    base, opts = s3
    g = {"col": torch.randn(64, 8192, generator=torch.Generator().manual_seed(6))}
    url = f"{base}/ck"
    _save(url, g, storage_options=opts)
    dest = {"col": torch.zeros(64, 2048)}
    stats = _load(url, dest, 4, 3, storage_options=opts)
    assert torch.equal(dest["col"], g["col"][:, 6144:])
    assert stats.device_bytes is None and stats.device_amplification is None


def test_read_ahead_is_turned_off_only_for_requests_no_neighbour_continues(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A same-layout load reads its files end to end (read-ahead helps); a row split's slices are apart."""
    gen = torch.Generator().manual_seed(7)
    rows = {f"row{i:02d}": torch.randn(1024, 1024, generator=gen) for i in range(6)}  # 4 MiB each
    path = str(tmp_path / "ck")
    _save(path, rows, thread_count=1)  # one data file
    advice: list[int] = []
    fadvise = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, what: int) -> None:
        advice.append(what)
        fadvise(fd, offset, length, what)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    same = {k: torch.zeros_like(v) for k, v in rows.items()}
    _load(path, same, 1, 0)
    assert all(torch.equal(same[k], v) for k, v in rows.items())
    assert os.POSIX_FADV_RANDOM not in advice
    split = {k: torch.zeros(256, 1024) for k in rows}
    _load(path, split, 4, 1)
    assert all(torch.equal(split[k], v[256:512]) for k, v in rows.items())
    assert advice.count(os.POSIX_FADV_RANDOM) >= len(rows)  # each slice is followed by another rank's


def test_requests_followed_by_unread_bytes_are_scattered() -> None:
    from smpckpt.storage.format._reading import Fetch, Need

    spans = [("x", 0, 10), ("x", 5, 6), ("x", 30, 40), ("y", 10, 20)]
    fetch = [_plan.FetchTask(n, Fetch(a, b, ())) for n, a, b in spans]
    direct = [_plan.DirectCandidate(n, Need(a, b, None)) for n, a, b in [("x", 10, 20), ("y", 25, 30)]]
    fs, ds = _plan._mark_scattered(fetch, direct, {"x": 40, "y": 100})
    # x: [0, 10) (holding [5, 6)) runs on into [10, 20), which a gap follows; [30, 40) ends the file;
    # y: [10, 20) and [25, 30) are followed by unread bytes
    assert [t.scattered for t in fs] == [False, False, False, True]
    assert [d.scattered for d in ds] == [True, True]
    # a file of unknown size: nothing after its last request counts as unread
    assert not _plan._mark_scattered([_plan.FetchTask("z", Fetch(0, 5, ()))], [], {})[0][0].scattered
