"""A column (dim 1) reshard past 32-bit byte offsets and element counts (opt in: ``--run-slow``; 40-110 s
on the project's shared 2-vCPU VM, 4.6 GiB peak RSS).

One bf16 tensor of 360,448 x 6144 elements: 2,214,592,512 elements (past 2**31) and 4.125 GiB, so its
record runs past 2**32 bytes. Its rows are 12 KiB, and a TP=4 rank's 3 KiB of each sits in a 6 KiB tile
column: the unread gap per row is below ``request_cost_bytes``, so the verified load streams -- parts of
whole rows read in pieces of about 4 MiB through one buffer, each piece's tiles verified, then its
columns copied out -- and its pieces straddle the file's 2 GiB and 4 GiB offsets (checked here from
the record's offset, not assumed). Each TP=4 rank's slice is 1.03 GiB; a TP=2 rank's, 2.06 GiB, is
past 2**31 bytes itself (its 6 KiB per row is a whole tile column: streamed in place, verified or,
in 1-row units, not). Unverified, a TP=4 rank's 3 KiB run per row streams in 1-row units too (it was
read as the slice's enclosing span, all 4.125 GiB, in one request into one buffer). Then
``verify_checkpoint`` reads every tile, and names each tile holding a byte flipped either side of 2 and
of 4 GiB by its own bytes (first to last, row segments).

Every element holds a 14-bit function of its row and its column (a finite bf16 bit pattern: hashed
row bits plus hashed column bits), so a shifted, repeated or lost run of rows or columns shows; values are
compared as int16 bit patterns (bit-exact), a block of rows at a time, the source rebuilt from the
row and column (never held beside the slices). Run it
with ``python -m pytest --run-slow tests/sizes/test_columns_past_32_bits.py``."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from column_reads import streamed_spans
from torch.distributed.checkpoint.metadata import MetadataIndex

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, read_manifest, verify_checkpoint
from smpckpt.storage.format._reading import ReadStats

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ROWS, COLS, TP = 360_448, 6144, 4
SPECS = {"m.w": ShardSpec(1)}
#: the verified read's tiles: two column groups of 6 KiB, row groups of 170 rows (a 1 MiB check unit
#: over tile rows of 6 KiB: ``_check_units.item_checks``)
TILE_BYTES, TILE_ROWS = 6144, 170
#: rows generated or compared at once: 12 M elements, 24 MiB
BLOCK_ROWS = 2048


def _hash14(i: torch.Tensor) -> torch.Tensor:
    """14 scrambled bits of each index (Knuth's multiplicative hash), as int16."""
    return ((i.to(torch.int64) * 2654435761 >> 11) & 0x3FFF).to(torch.int16)


#: element (r, c) holds ``(ROW_BITS[r] + COL_BITS[c]) & 0x3FFF``: 14 bits, a finite bf16 (the exponent's
#: top bit is 0), computed in int16 a block at a time (int64 arithmetic per element took minutes here)
ROW_BITS = _hash14(torch.arange(ROWS))
COL_BITS = _hash14(torch.arange(COLS) + ROWS)


def _pattern(r0: int, r1: int, cols: slice) -> torch.Tensor:
    return (ROW_BITS[r0:r1, None] + COL_BITS[None, cols]) & 0x3FFF


def _indexed() -> torch.Tensor:
    bits = torch.empty(ROWS, COLS, dtype=torch.int16)
    for r0 in range(0, ROWS, BLOCK_ROWS):
        r1 = min(ROWS, r0 + BLOCK_ROWS)
        bits[r0:r1] = _pattern(r0, r1, slice(None))
    return bits.view(torch.bfloat16)


def _check_columns(dest: torch.Tensor, tp: int, rank: int) -> None:
    """``dest`` holds rank ``rank``'s columns of every row at TP=``tp``, bit-exact."""
    width = COLS // tp
    got = dest.view(torch.int16)
    cols = slice(rank * width, (rank + 1) * width)
    for r0 in range(0, ROWS, BLOCK_ROWS):
        r1 = min(ROWS, r0 + BLOCK_ROWS)
        want = _pattern(r0, r1, cols)
        if not torch.equal(got[r0:r1], want):
            bad = (got[r0:r1] != want).nonzero()[0].tolist()
            raise AssertionError(f"TP={tp} rank {rank}: row {r0 + bad[0]}, column {bad[1]} of its slice differs")


def _load(path: str, tp: int, rank: int, verify: bool) -> ReadStats:
    """Load TP rank ``rank``'s columns, check them and let them go; the read's stats."""
    dest = torch.empty(ROWS, COLS // tp, dtype=torch.bfloat16)
    reader = FsspecStorageReader(path, verify_checksums=verify)
    planner = ParallelLoadPlanner(ParallelLayout(tp=tp), SPECS, rank=rank)
    dcp.load({"m": {"w": dest}}, storage_reader=reader, planner=planner)
    _check_columns(dest, tp, rank)
    del dest
    gc.collect()
    if reader.last_read_stats is None:
        raise AssertionError("no read stats")
    return reader.last_read_stats


def test_column_slices_of_a_tensor_past_4_gib(tmp_path: Path) -> None:
    row_bytes = COLS * 2
    assert ROWS * COLS > 2**31 and ROWS * row_bytes > 2**32
    path = str(tmp_path / "tp1")
    w = _indexed()
    dcp.save(
        {"m": {"w": w}}, storage_writer=FsspecStorageWriter(path), planner=ParallelSavePlanner(ParallelLayout(), SPECS)
    )
    del w
    gc.collect()

    info = FsspecStorageReader(path).read_metadata().storage_data[MetadataIndex("m.w", [0, 0])]
    base = info.offset
    assert os.path.getsize(os.path.join(path, info.relative_path)) >= base + ROWS * row_bytes > 2**32

    # streamed, verified: TP=4 ranks 1 and 2 read the first and the second tile column (each 6 KiB, twice
    # their slice: copied out of the piece buffer); TP=2 rank 1's slice is the second tile column, a
    # destination of 2.06 GiB (past 2**31 bytes) filled in place; unverified, TP=2 rank 0 streams too,
    # in 1-row units
    for tp, rank, verify, unit in [
        (4, 1, True, TILE_ROWS),
        (4, 2, True, TILE_ROWS),
        (2, 1, True, TILE_ROWS),
        (2, 0, False, 1),
    ]:
        stats = _load(path, tp, rank, verify)
        width = COLS // tp * 2
        assert stats.bytes_needed == ROWS * width
        col0 = rank * width // TILE_BYTES * TILE_BYTES  # the first byte of the tile column read
        spans = streamed_spans(ROWS, row_bytes, TILE_BYTES, unit, pieces=True)
        assert (stats.requests, stats.bytes_requested) == (len(spans), sum(n for _, n in spans)), (tp, rank, stats)
        for edge in (2**31, 2**32):  # a streamed piece reads across each edge
            assert any(base + col0 + s < edge < base + col0 + s + n for s, n in spans), (tp, rank, edge)

    # unverified, TP=4: a 3 KiB run per row (below a page) streams in 1-row units, parts of bounded size
    # (it was one request of the slice's whole enclosing span into one 4.1 GiB buffer)
    stats = _load(path, 4, 3, verify=False)
    spans = streamed_spans(ROWS, row_bytes, COLS // 4 * 2, 1, pieces=True)
    assert (stats.requests, stats.bytes_requested) == (len(spans), sum(n for _, n in spans)), stats

    _verify_tiles(path, os.path.join(path, info.relative_path), base)


def _verify_tiles(path: str, data_file: str, base: int) -> None:
    """``verify_checkpoint`` reads every tile of the record (row groups straddling 2 and 4 GiB among
    them), then names each tile holding a flipped byte -- either side of 2 and of 4 GiB -- by its first
    to last byte and its row segments (the file's bytes, not the block list's contiguous stand-ins)."""
    report = verify_checkpoint(path)
    assert report.ok and report.bytes_checked == read_manifest(path).total_bytes, report.problems
    (rec,) = [r for r in read_manifest(path).files if os.path.join(path, r.name) == data_file]
    (tiling,) = rec.tilings
    assert tiling.start == base and (tiling.rows_per_group, tiling.segment) == (TILE_ROWS, TILE_BYTES)
    first_tile = rec.blocks_covering(base, base + 1)[0]
    flipped = [2**31 - 1, 2**31, 2**32 - 1, 2**32]
    want = []
    for off in flipped:
        row, col = divmod(off - base, COLS * 2)
        group, column = row // TILE_ROWS, col // TILE_BYTES
        rows = min(TILE_ROWS, ROWS - group * TILE_ROWS)
        first = base + group * TILE_ROWS * COLS * 2 + column * TILE_BYTES
        last = first + (rows - 1) * COLS * 2 + TILE_BYTES
        tile = first_tile + group * 2 + column
        text = f"bytes {first}..{last} (block {tile}: a tile, {rows} runs of {TILE_BYTES} bytes every {COLS * 2})"
        want.append((tile, f"{rec.name}: checksum mismatch in {text}"))
    flip = [(off, open_byte(data_file, off)) for off in flipped]
    try:
        for off, b in flip:
            write_byte(data_file, off, b ^ 0xFF)
        assert list(verify_checkpoint(path).problems) == [text for _, text in sorted(set(want))]
    finally:
        for off, b in flip:
            write_byte(data_file, off, b)


def open_byte(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(1)[0]


def write_byte(path: str, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes([value]))
