"""Column (dim 1) slices of a full artifact loaded at another TP degree: the streaming cost model (tier 1).

A TP=1 full export loaded by TP=4 ranks with ``ShardSpec(1)`` reads a column slice of every row. The
full reader used to read it a request per row, and verified, every check unit it touched whole, again
a request per unit row: a TP=4 load of a bf16 [32000, 4096] embedding issued 32,000 requests of 4 KiB.
It now takes the partial reader's decision (``storage/format/_columns.py``, ``storage/full/_files.py``):

* ``emb`` bf16 [1024, 4096] (rows of 8 KiB, tiles of 4 KiB x 32 rows; a rank's slice is 2 KiB of a
  tile): the unread gap per row is below ``request_cost_bytes``, so the rows stream -- pieces of whole
  tile rows of about ``STREAM_PIECE_BYTES``, one request each through one buffer, each piece's tiles
  verified before the slice's columns are copied out: 2 requests instead of 1,024.
* ``wide`` fp32 [64, 16384] (rows of 64 KiB, a rank's slice is 16 KiB, two whole tiles): a 48 KiB gap,
  past the request cost: a request per row, exactly the slice's bytes.

``last_read_stats`` and the file offsets of the reads are checked against requests worked out here,
so a load that quietly takes another path fails. A flipped byte in a tile a rank streams fails that
rank with :class:`~smpckpt.errors.CheckpointCorrupt`; one in a gap it streams past but does not use
does not.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from damage import flip_byte
from s3_env import serve_full_artifact
from sim import reset_dcp_caches, sim_save
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt import CheckpointCorrupt, ParallelLayout, ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FullArtifactReader, FullArtifactWriter
from smpckpt.storage.format._check_units import item_checks
from smpckpt.storage.format._columns import STREAM_PIECE_BYTES
from smpckpt.storage.full import _files
from smpckpt.storage.full._files import _pieces

TP = 4
KiB = 1 << 10
_g = torch.Generator().manual_seed(51)
EMB = torch.randn(1024, 4096, generator=_g).to(torch.bfloat16)
WIDE = torch.randn(64, 16384, generator=_g)
SPECS = {"m.emb": ShardSpec(1), "m.wide": ShardSpec(1)}
CHECK_BLOCK = 1 << 20  # the writer's default block: what item_checks cuts the tiles from


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TP=1 full export of ``EMB`` and ``WIDE`` (checksums on), shared by every test here."""
    folder = tmp_path_factory.mktemp("full_columns") / "tp1"
    reset_dcp_caches()
    sim_save(
        [{"m": {"emb": EMB, "wide": WIDE}}],
        [ParallelSavePlanner(ParallelLayout(), SPECS, rank=0)],
        [FullArtifactWriter(str(folder), sync_files=False)],
    )
    return folder


def columns(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = t.shape[1] // TP
    return t[:, rank * n : (rank + 1) * n]


def load(folder: Path, key: str, dest: torch.Tensor, rank: int, **reader: Any) -> Any:
    """Rank ``rank`` of TP=4 loads ``key``'s column slice into ``dest`` alone; the read's stats."""
    reset_dcp_caches()
    r = FsspecStorageReader(str(folder), **reader)
    planner = ParallelLoadPlanner(ParallelLayout(tp=TP), SPECS, rank=rank, allow_partial_load=True)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"m": {key: dest}}, storage_reader=r, planner=planner, no_dist=True)
    if r.last_read_stats is None:
        raise AssertionError("no read stats")
    return r.last_read_stats


def tensor_start(folder: Path, key: str) -> tuple[Path, int]:
    """The file holding artifact tensor ``key`` and the offset of its first byte there."""
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        if key in header:
            return path, 8 + n + header[key]["data_offsets"][0]
    raise AssertionError(f"{key} in no file")


def expected_stream(t: torch.Tensor, rank: int, verified: bool) -> list[tuple[int, int]]:
    """``(offset in the tensor, bytes)`` of each request of a streamed column read of ``rank``'s slice,
    worked out from the writer's tiling: pieces of whole tile rows of at most ``STREAM_PIECE_BYTES``
    (at least one tile row), each from the first needed column of its first row to the last of its
    last; verified, the needed columns are the tiles' the slice touches, else the slice's own."""
    rows, itemsize = t.shape[0], t.element_size()
    row_bytes = t.shape[1] * itemsize
    width = row_bytes // TP
    c0, c1 = rank * width, (rank + 1) * width
    unit_rows = 1
    if verified:
        checks = item_checks(list(t.shape), itemsize, CHECK_BLOCK)
        seg = row_bytes // checks.groups
        c0, c1 = c0 // seg * seg, -(-c1 // seg) * seg
        unit_rows = checks.rows_per_group
    step = max(1, STREAM_PIECE_BYTES // (row_bytes * unit_rows)) * unit_rows
    out = []
    for p0 in range(0, rows, step):
        n = min(rows, p0 + step) - p0
        out.append((p0 * row_bytes + c0, (n - 1) * row_bytes + c1 - c0))
    return out


@pytest.fixture()
def preads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(file offset, bytes)`` of every read the full reader issues on local files."""
    seen: list[tuple[int, int]] = []
    real = _files.pread_into

    def record(fd: int, views: Any, offset: int, n: int) -> int:
        seen.append((offset, n))
        return real(fd, views, offset, n)

    monkeypatch.setattr(_files, "pread_into", record)
    return seen


DESTS: dict[str, Callable[[torch.dtype], torch.Tensor]] = {
    "contiguous": lambda dt: torch.zeros(1024, 1024, dtype=dt),
    "transposed": lambda dt: torch.zeros(1024, 1024, dtype=dt).t(),
    "column view": lambda dt: torch.zeros(1024, 2048, dtype=dt)[:, 512:1536],
}


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("dest_kind", sorted(DESTS))
def test_bf16_columns_stream_in_pieces(
    artifact: Path, preads: list[tuple[int, int]], verify: bool, dest_kind: str
) -> None:
    """Every TP=4 rank's bf16 slice (2 KiB of each 8 KiB row) streams: 2 requests of 512 rows instead
    of 1,024 one-row requests (verified: of the 4 KiB tile holding the slice, read whole per unit
    row), bit-exact into contiguous and strided destinations alike."""
    _, start = tensor_start(artifact, "m.emb")
    for rank in range(TP):
        want = expected_stream(EMB, rank, verify)
        assert len(want) == 2
        dest = DESTS[dest_kind](torch.bfloat16)
        base = dest._base if dest._base is not None else dest
        before = base.clone()
        preads.clear()
        stats = load(artifact, "emb", dest, rank, verify_checksums=verify)
        assert torch.equal(dest, columns(EMB, rank)), (rank, dest_kind)
        # the pieces are drawn by the reader's threads side by side: in any order
        assert sorted(preads) == [(start + at, n) for at, n in want], (rank, preads[:4])
        assert (stats.requests, stats.bytes_requested) == (2, sum(n for _, n in want)), (rank, stats)
        assert stats.bytes_needed == 1024 * 2 * KiB
        if dest_kind == "column view":  # the columns beside the view are untouched
            assert torch.equal(base[:, :512], before[:, :512]) and torch.equal(base[:, 1536:], before[:, 1536:])


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_fp32_wide_rows_keep_a_request_per_row(artifact: Path, preads: list[tuple[int, int]], verify: bool) -> None:
    """fp32 rows of 64 KiB, a slice of 16 KiB (whole tiles): a 48 KiB gap costs more than a request, so
    each row is one request of exactly the slice's bytes, verified or not."""
    _, start = tensor_start(artifact, "m.wide")
    for rank in range(TP):
        for dest in (torch.zeros(64, 4096), torch.zeros(4096, 64).t()):
            preads.clear()
            stats = load(artifact, "wide", dest, rank, verify_checksums=verify)
            assert torch.equal(dest, columns(WIDE, rank)), rank
            rows = [(start + r * 64 * KiB + rank * 16 * KiB, 16 * KiB) for r in range(64)]
            assert preads == rows, (rank, preads[:4])
            assert (stats.requests, stats.bytes_requested, stats.bytes_needed) == (64, 1 << 20, 1 << 20), stats


def test_request_cost_zero_reads_a_request_per_row(artifact: Path, preads: list[tuple[int, int]]) -> None:
    """``request_cost_bytes=0``: never stream -- the bf16 slice's tile is read a request per unit row
    (1,024 requests of 4 KiB), the fewest bytes a verified read can take."""
    stats = load(artifact, "emb", torch.zeros(1024, 1024, dtype=torch.bfloat16), 1, request_cost_bytes=0)
    assert (stats.requests, stats.bytes_requested) == (1024, 1024 * 4 * KiB), stats
    assert all(n == 4 * KiB for _, n in preads)


@pytest.mark.parametrize("col", [100, 1500, 3000], ids=["in rank 0's slice", "beside it in its tile", "another tile"])
def test_flipped_byte_in_a_streamed_piece_is_refused_before_its_columns_are_used(
    artifact: Path, tmp_path: Path, col: int
) -> None:
    """A byte flipped in row 700 (the second of two pieces), column ``col``. Every rank streams that row
    whole, but verifies only its own tile (columns 0-2047: ranks 0 and 1; 2048-4095: ranks 2 and 3):
    the ranks of the damaged tile refuse the load with CheckpointCorrupt -- the piece's columns never
    copied out, the first piece's are -- and the others, which read the byte as a gap, load bit-exact."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in artifact.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    path, start = tensor_start(copy, "m.emb")
    flip_byte(path, start + (700 * 4096 + col) * 2, 0x10)
    tile_ranks = {0, 1} if col < 2048 else {2, 3}
    for rank in range(TP):
        dest = torch.zeros(1024, 1024, dtype=torch.bfloat16)
        if rank in tile_ranks:
            with pytest.raises(CheckpointException) as info:
                load(copy, "emb", dest, rank)
            (failure,) = [exc for exc, _ in info.value.failures.values()]
            assert isinstance(failure, CheckpointCorrupt), failure
            tile = f"[672, {col // 2048 * 2048}]+[32, 2048]"
            assert f"checksum mismatch in tensor 'm.emb' at box {tile}" in str(failure), failure
            assert torch.equal(dest[:512], columns(EMB, rank)[:512]), rank  # the first piece verified, copied
            assert not dest[512:].any(), rank  # the damaged piece: nothing copied
        else:
            load(copy, "emb", dest, rank)
            assert torch.equal(dest, columns(EMB, rank)), rank


def test_pieces_never_cut_a_unit() -> None:
    """Pieces end only where no unit spans the cut; a unit taller than a piece makes one piece."""
    urows = np.array([[0, 3], [3, 6], [6, 9], [0, 3]], dtype=np.int64)
    assert _pieces(0, 9, urows, 4) == [(0, 3), (3, 6), (6, 9)]
    assert _pieces(0, 9, urows, 1) == [(0, 3), (3, 6), (6, 9)]
    assert _pieces(0, 9, urows, 7) == [(0, 6), (6, 9)]
    overlapping = np.array([[0, 5], [2, 8], [8, 9]], dtype=np.int64)  # no cut inside [0, 8)
    assert _pieces(0, 9, overlapping, 3) == [(0, 8), (8, 9)]
    assert _pieces(2, 7, np.zeros((0, 2), dtype=np.int64), 2) == [(2, 4), (4, 6), (6, 7)]


# -- a box's parts on several threads ---------------------------------------------------------------
#: the three ways a column box is read, each cut into parts here by small part sizes (monkeypatched):
#: ``emb`` streamed (pieces of 32 tile rows of 8 KiB), ``wide`` a request per row (row groups of about
#: 64 KiB: whole 16-row tiles), ``emb`` at ``request_cost_bytes=0`` unit by unit (half a tile each)
PATHS = {
    "streamed": ("emb", {}),
    "a request per row": ("wide", {}),
    "unit by unit": ("emb", {"request_cost_bytes": 0}),
}


@pytest.fixture()
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_files, "STREAM_PIECE_BYTES", 256 * KiB)
    monkeypatch.setattr(_files, "PART_BYTES", 64 * KiB)


def _dest(key: str, kind: str) -> torch.Tensor:
    t = EMB if key == "emb" else WIDE
    rows, cols = t.shape[0], t.shape[1] // TP
    if kind == "contiguous":
        return torch.zeros(rows, cols, dtype=t.dtype)
    return torch.zeros(cols, rows, dtype=t.dtype).t()  # strided: read into a buffer, then copied


def _thread_of_reads(
    monkeypatch: pytest.MonkeyPatch, hold: Callable[[int, int], None]
) -> dict[tuple[int, int], set[int]]:
    """The threads that issued each pread (by file offset and bytes), ``hold(offset, bytes)`` called
    first on each."""
    seen: dict[tuple[int, int], set[int]] = {}
    real = _files.pread_into

    def record(fd: int, views: Any, offset: int, n: int) -> int:
        seen.setdefault((offset, n), set()).add(threading.get_ident())
        hold(offset, n)
        return real(fd, views, offset, n)

    monkeypatch.setattr(_files, "pread_into", record)
    return seen


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
@pytest.mark.parametrize("dest_kind", ["contiguous", "transposed"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_column_box_is_read_by_several_threads(
    artifact: Path, small_parts: None, monkeypatch: pytest.MonkeyPatch, path: str, dest_kind: str, verify: bool
) -> None:
    """A column box cut into parts is read by more than one of the reader's threads, bit-exact. The
    first two threads to read wait for each other (a barrier with a timeout): read by one thread, as
    before, the load fails; the work each thread then does is whatever it draws."""
    key, options = PATHS[path]
    barrier = threading.Barrier(2, timeout=20)
    waited: set[int] = set()
    lock = threading.Lock()

    def hold(offset: int, n: int) -> None:
        me = threading.get_ident()
        with lock:
            first = me not in waited and len(waited) < 2
            waited.add(me)
        if first:
            barrier.wait()  # BrokenBarrierError (the load fails) unless a second thread reads too

    seen = _thread_of_reads(monkeypatch, hold)
    t = EMB if key == "emb" else WIDE
    for rank in (1, 2):
        waited.clear()
        barrier.reset()
        seen.clear()
        dest = _dest(key, dest_kind)
        stats = load(artifact, key, dest, rank, verify_checksums=verify, **options)
        assert torch.equal(dest, columns(t, rank)), (path, rank)
        assert len(set().union(*seen.values())) > 1, seen
        assert stats.bytes_needed == t.numel() * t.element_size() // TP


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_flipped_byte_in_a_part_another_thread_reads_is_refused(
    artifact: Path, tmp_path: Path, small_parts: None, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A byte flipped in rank 1's columns of the box's last row. The thread that reads the first part
    waits until another thread has read the damaged last one, so that one is read elsewhere: the load
    fails with CheckpointCorrupt naming the file and the damaged unit."""
    key, options = PATHS[path]
    t = EMB if key == "emb" else WIDE
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in artifact.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    file, start = tensor_start(copy, f"m.{key}")
    rows, row_bytes, itemsize = t.shape[0], t.shape[1] * t.element_size(), t.element_size()
    col = t.shape[1] // TP + 5  # in rank 1's slice
    bad = start + (rows - 1) * row_bytes + col * itemsize
    flip_byte(file, bad, 0x10)
    damaged_read = threading.Event()
    first: list[int] = []
    lock = threading.Lock()

    def hold(offset: int, n: int) -> None:
        with lock:
            if not first:
                first.append(threading.get_ident())
            mine = first[0] == threading.get_ident()
        if offset <= bad < offset + n:
            damaged_read.set()
        elif mine and not damaged_read.wait(timeout=20):
            raise AssertionError("no other thread read the damaged part")

    seen = _thread_of_reads(monkeypatch, hold)
    dest = _dest(key, "contiguous")
    with pytest.raises(CheckpointException) as info:
        load(copy, key, dest, 1, **options)
    (failure,) = [exc for exc, _ in info.value.failures.values()]
    assert isinstance(failure, CheckpointCorrupt), failure
    assert str(file) in str(failure) and f"checksum mismatch in tensor 'm.{key}'" in str(failure), failure
    damaged = [threads for (o, n), threads in seen.items() if o <= bad < o + n]
    assert damaged and first[0] not in set().union(*damaged), (damaged, first)


@pytest.mark.parametrize("threads", [1, 6])
@pytest.mark.parametrize("direct", [True, False], ids=["FullArtifactReader", "through FsspecStorageReader"])
def test_the_full_reader_reads_on_thread_count_threads(
    artifact: Path, small_parts: None, monkeypatch: pytest.MonkeyPatch, threads: int, direct: bool
) -> None:
    """``thread_count`` sets the full reader's threads (``FsspecStorageReader`` passes its own on):
    at 1 every part of a streamed column box is read on one thread; at 6 the first six threads to read
    wait for each other (a barrier with a timeout), so the load fails unless six read (the default is
    4). Bit-exact either way."""
    barrier = threading.Barrier(threads, timeout=20)
    waited: set[int] = set()
    lock = threading.Lock()

    def hold(offset: int, n: int) -> None:
        me = threading.get_ident()
        with lock:
            first = me not in waited and len(waited) < threads
            waited.add(me)
        if first and threads > 1:
            barrier.wait()  # BrokenBarrierError (the load fails) unless `threads` threads read

    seen = _thread_of_reads(monkeypatch, hold)
    dest = _dest("emb", "contiguous")
    reset_dcp_caches()
    if direct:
        reader: Any = FullArtifactReader(str(artifact), thread_count=threads)
    else:
        reader = FsspecStorageReader(str(artifact), thread_count=threads)
    planner = ParallelLoadPlanner(ParallelLayout(tp=TP), SPECS, rank=1, allow_partial_load=True)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"m": {"emb": dest}}, storage_reader=reader, planner=planner, no_dist=True)
    assert torch.equal(dest, columns(EMB, 1))
    assert len(set().union(*seen.values())) == threads, seen


# -- on S3: the same cost model (issue 47) ---------------------------------------------------------------
#: fp32 rows of 2 MiB (tiles of 256 KiB, one row a group): TP=8's 256 KiB of a row leaves a 1.75 MiB gap,
#: past S3's default request cost (1 MiB); ``WIDE_S3`` fp32 rows of 64 KiB (tiles of 8 KiB x 2 rows)
BIG = torch.randn(3, 1 << 19, generator=_g)
WIDE_S3 = torch.randn(16, 16384, generator=_g)


@pytest.mark.s3
def test_on_s3_rows_farther_apart_than_a_request_costs_take_a_get_each(
    tmp_path: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47 (1): a full artifact's column box on S3 was fetched as one enclosing span whatever the gap
    (TP=8 rank 1 of ``big``: 6.25 MiB for the 768 KiB needed). It now takes the partial reader's cost
    model (``streams``, ``request_cost_bytes``): rows whose unread gap costs more than a GET are a GET each,
    of the slice's tile columns (verified; a tile a box cuts is read whole, a row's tiles in one GET) or its
    own columns; closer rows still share spans. The GETs are checked offset by offset."""
    folder = tmp_path / "tp1"
    reset_dcp_caches()
    sim_save(
        [{"m": {"big": BIG, "wide": WIDE_S3}}],
        [ParallelSavePlanner(ParallelLayout(), {"m.big": ShardSpec(1), "m.wide": ShardSpec(1)}, rank=0)],
        [FullArtifactWriter(str(folder), sync_files=False)],
    )
    _, big0 = tensor_start(folder, "m.big")
    _, wide0 = tensor_start(folder, "m.wide")
    opts, gets = serve_full_artifact(monkeypatch, folder, moto_endpoint, "smpckpt-full-reshard", None)
    big_row, wide_row = 2 << 20, 64 * KiB

    def rows(start: int, row: int, n: int, c0: int, width: int) -> list[tuple[int, int]]:
        return [(start + r * row + c0, width) for r in range(n)]

    # (tp, rank, request cost, verified): the GETs as (file offset, bytes)
    cases = {
        # big a GET per row; wide's rows stream under the default cost: one span, as before
        (8, 1, None, True): rows(big0, big_row, 3, 256 * KiB, 256 * KiB) + [(wide0 + 8 * KiB, 15 * wide_row + 8 * KiB)],
        (8, 1, 16 * KiB, False): rows(big0, big_row, 3, 256 * KiB, 256 * KiB)
        + rows(wide0, wide_row, 16, 8 * KiB, 8 * KiB),
        # TP=16 cuts the tiles: verified, each row's tile is read whole (big: its 2nd, wide: its 2nd)
        (16, 3, 16 * KiB, True): rows(big0, big_row, 3, 256 * KiB, 256 * KiB)
        + rows(wide0, wide_row, 16, 8 * KiB, 8 * KiB),
        (16, 3, 16 * KiB, False): rows(big0, big_row, 3, 384 * KiB, 128 * KiB)
        + rows(wide0, wide_row, 16, 12 * KiB, 4 * KiB),
    }
    specs = {"m.big": ShardSpec(1), "m.wide": ShardSpec(1)}
    for (tp, rank, cost, verify), want in cases.items():
        gets.clear()
        dest = {
            k: torch.full_like(t.chunk(tp, dim=1)[rank], float("nan")) for k, t in (("big", BIG), ("wide", WIDE_S3))
        }
        reader = FsspecStorageReader(
            "s3://smpckpt-full-reshard/ck", storage_options=opts, request_cost_bytes=cost, verify_checksums=verify
        )
        planner = ParallelLoadPlanner(ParallelLayout(tp=tp), specs, rank=rank)
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"m": dest}, storage_reader=reader, planner=planner, no_dist=True)
        case = (tp, rank, cost, verify)
        assert torch.equal(dest["big"], BIG.chunk(tp, dim=1)[rank]), case
        assert torch.equal(dest["wide"], WIDE_S3.chunk(tp, dim=1)[rank]), case
        assert sorted((start, end - start) for _, start, end in gets) == sorted(want), (case, gets[:4])
        stats = reader.last_read_stats
        needed = (BIG.numel() + WIDE_S3.numel()) * 4 // tp
        assert (stats.bytes_needed, stats.bytes_requested, stats.requests) == (
            needed,
            sum(n for _, n in want),
            len(want),
        ), (case, stats)
    # TP=3 rank 1 cuts two neighbouring tiles per row: verified, a row's two tiles come in one GET
    # (RunFiles.holding; a GET per tile without it: 6, rev72d L1), 1 MiB a row
    sizes = tuple(c.shape[1] for c in BIG.chunk(3, dim=1))
    dest = {"big": torch.full_like(BIG.chunk(3, dim=1)[1], float("nan"))}
    gets.clear()
    reader = FsspecStorageReader("s3://smpckpt-full-reshard/ck", storage_options=opts, request_cost_bytes=16 * KiB)
    planner = ParallelLoadPlanner(
        ParallelLayout(tp=3), {"m.big": ShardSpec(1, sizes=sizes)}, rank=1, allow_partial_load=True
    )
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"m": dest}, storage_reader=reader, planner=planner, no_dist=True)
    assert torch.equal(dest["big"], BIG.chunk(3, dim=1)[1])
    assert sorted((start, end - start) for _, start, end in gets) == rows(big0, big_row, 3, 512 * KiB, 1024 * KiB)
    # a flipped byte in big's row 2, rank 3's columns of TP=16 (the second tile): TP=16 rank 2 reads that
    # tile whole and refuses; unverified it loads its own columns bit-exact
    import fsspec

    fs = fsspec.filesystem("s3", **opts)
    (art,) = [p for p in fs.ls("smpckpt-full-reshard/ck", detail=False) if p.endswith(".safetensors")]
    data = bytearray(fs.cat_file(art))
    data[big0 + 2 * big_row + 400 * KiB] ^= 0x10
    fs.pipe_file(art, bytes(data))
    for verify in (True, False):
        dest = {"big": torch.empty_like(BIG.chunk(16, dim=1)[2])}
        reader = FsspecStorageReader("s3://smpckpt-full-reshard/ck", storage_options=opts, verify_checksums=verify)
        planner = ParallelLoadPlanner(ParallelLayout(tp=16), specs, rank=2, allow_partial_load=True)
        with pytest.warns(UserWarning, match="single process"):
            if verify:
                with pytest.raises(CheckpointException) as info:
                    dcp.load({"m": dest}, storage_reader=reader, planner=planner, no_dist=True)
                (failure,) = [exc for exc, _ in info.value.failures.values()]
                assert isinstance(failure, CheckpointCorrupt), failure
                assert "checksum mismatch in tensor 'm.big' at box [2, 65536]+[1, 65536]" in str(failure), failure
            else:
                dcp.load({"m": dest}, storage_reader=reader, planner=planner, no_dist=True)
                assert torch.equal(dest["big"], BIG.chunk(16, dim=1)[2])


@pytest.mark.parametrize("bad", [0, -1])
def test_a_full_reader_thread_count_below_one_is_refused_naming_it(artifact: Path, bad: int) -> None:
    with pytest.raises(ValueError, match="thread_count"):
        FullArtifactReader(str(artifact), thread_count=bad)
    with pytest.raises(TypeError, match="thread_count"):
        FullArtifactReader(str(artifact), thread_count=2.0)  # type: ignore[arg-type]
