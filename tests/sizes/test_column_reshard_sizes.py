"""Column (dim 1) reshards at a Llama-7B's real sizes: a TP=1 save loaded by one TP=4 rank.

The strided-read paths were tested only on tensors of 16 MiB or less (``tests/storage/test_strided_reads.py``).
Here one TP=1 checkpoint of real shapes is loaded by column (``ShardSpec(1)``) into TP=4 ranks (one
process, the planner's ``rank=``), every slice compared bit-exact (``torch.equal``) with the source's
columns, and ``last_read_stats`` checked against the requests each path issues, so a load that quietly
takes another path fails here:

* ``emb`` bf16 [32000, 4096] (rows of 8 KiB, a column-sharded embedding): the unread gap per row is
  below ``request_cost_bytes``, so the rows stream -- parts of whole rows of ``STREAM_PART_BYTES``, each
  read in pieces of ``STREAM_PIECE_BYTES`` through one buffer, each piece's 4 KiB tiles (wider than
  the 2 KiB slice) verified before its columns are copied into the destination. Into a destination
  that is not contiguous, or of another dtype, each part is one request into a buffer instead.
* ``o_proj`` fp32 [4096, 4096] (rows of 16 KiB, a row-parallel attention output): streams too, the
  tile is the slice; unverified, its parts are cut in 1-row units.
* ``down`` fp32 [4096, 11008] (rows of 43 KiB, a row-parallel MLP weight): a request per row, exactly
  the slice's bytes, verified or not; the same weight in bf16 (rows of 21.5 KiB: a gap of 16,512 bytes,
  just past the 16 KiB request cost) too.

A flipped byte in the middle of ``emb``'s record, inside the tile a rank reads, fails that rank's
streamed load with :class:`~smpckpt.errors.CheckpointCorrupt`; one in a tile it does not read does
not. About 570 MiB saved once per module; the whole file runs in seconds."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from column_reads import streamed
from damage import flip_byte
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.errors import CheckpointCorrupt
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.storage.format._reading import ReadStats

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TP = 4
SHAPES = {
    "emb": ((32000, 4096), torch.bfloat16),
    "o_proj": ((4096, 4096), torch.float32),
    "down": ((4096, 11008), torch.float32),
    "down_bf16": ((4096, 11008), torch.bfloat16),
}
SPECS = {f"m.{k}": ShardSpec(1) for k in SHAPES}


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(45)
    return {k: torch.randn(*shape, generator=g).to(dtype) for k, (shape, dtype) in SHAPES.items()}


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    return _source()


@pytest.fixture(scope="module")
def saved(source: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The TP=1 checkpoint of ``source`` (default options: checksums on), shared by every test here."""
    path = str(tmp_path_factory.mktemp("column_sizes") / "tp1")
    dcp.save(
        {"m": source}, storage_writer=FsspecStorageWriter(path), planner=ParallelSavePlanner(ParallelLayout(), SPECS)
    )
    return path


def _load(path: str, key: str, dest: torch.Tensor, rank: int, cast: bool = False, **reader: Any) -> ReadStats:
    """Load ``key``'s TP=4 column slice of ``rank`` into ``dest`` alone (the other keys left out: one
    tensor's read in the stats); the read's stats."""
    r = FsspecStorageReader(path, **reader)
    planner = ParallelLoadPlanner(
        ParallelLayout(tp=TP), SPECS, rank=rank, allow_dtype_cast=cast, allow_partial_load=True
    )
    dcp.load({"m": {key: dest}}, storage_reader=r, planner=planner)
    if r.last_read_stats is None:
        raise AssertionError("no read stats")
    return r.last_read_stats


def _columns(t: torch.Tensor, rank: int) -> torch.Tensor:
    width = t.shape[1] // TP
    return t[:, rank * width : (rank + 1) * width]


KiB = 1 << 10


def test_bf16_embedding_columns_stream_verified(saved: str, source: dict[str, torch.Tensor]) -> None:
    """Each TP=4 rank's 1024 columns of the 32000 x 4096 bf16 embedding (rows of 8 KiB): its 4 KiB tile
    column (two ranks share each) of every row streamed in 4 MiB pieces, verified, copied out."""
    emb = source["emb"]
    # 63 requests: 31 parts of 1024 rows (8 MiB) in two pieces of 512 rows each, then the last 256 rows
    want = streamed(32000, 8 * KiB, 4 * KiB, 64, pieces=True)
    assert want[0] == 63
    for rank in range(TP):
        dest = torch.zeros(32000, 1024, dtype=torch.bfloat16)
        stats = _load(saved, "emb", dest, rank)
        assert torch.equal(dest, _columns(emb, rank)), rank
        assert (stats.requests, stats.bytes_requested) == want, (rank, stats)
        assert stats.bytes_needed == 32000 * 2 * KiB, (rank, stats)


@pytest.mark.parametrize(
    "name, make, cast",
    [
        ("transposed", lambda: torch.zeros(1024, 32000, dtype=torch.bfloat16).t(), False),
        ("column view", lambda: torch.zeros(32000, 2048, dtype=torch.bfloat16)[:, 512:1536], False),
        ("fp32 cast", lambda: torch.zeros(32000, 1024), True),
    ],
)
def test_bf16_embedding_columns_into_other_destinations(
    saved: str, source: dict[str, torch.Tensor], name: str, make: Callable[[], torch.Tensor], cast: bool
) -> None:
    """A destination the rows cannot be copied into as stored (not contiguous; another dtype): each
    streamed part is one request into a buffer (32 of 1024 rows), verified, then copied into place."""
    dest = make()
    base = dest._base if dest._base is not None else dest
    before = base.clone()
    stats = _load(saved, "emb", dest, 2, cast=cast)
    assert torch.equal(dest, _columns(source["emb"], 2).to(dest.dtype)), name
    assert (stats.requests, stats.bytes_requested) == streamed(32000, 8 * KiB, 4 * KiB, 64, pieces=False), name
    if name == "column view":  # the columns beside the view are untouched
        assert torch.equal(base[:, :512], before[:, :512]) and torch.equal(base[:, 1536:], before[:, 1536:])


def test_bf16_embedding_unverified_streams_its_short_runs(saved: str, source: dict[str, torch.Tensor]) -> None:
    """Unverified, a 2 KiB run per row (below a page) streams in 1-row units like longer runs: parts of
    8 MiB read in 4 MiB pieces. It was read as the slice's enclosing span -- 250 MiB, every row from its
    first to its last column -- in one request into one buffer (4x the slice in memory; 4.1 GiB for a
    1 GiB slice of a 4 GiB tensor)."""
    want = streamed(32000, 8 * KiB, 2 * KiB, 1, pieces=True)
    assert want[0] == 63
    for rank in (0, 3):
        dest = torch.zeros(32000, 1024, dtype=torch.bfloat16)
        stats = _load(saved, "emb", dest, rank, verify_checksums=False)
        assert torch.equal(dest, _columns(source["emb"], rank)), rank
        assert (stats.requests, stats.bytes_requested) == want, (rank, stats)


def test_fp32_attention_columns_stream_verified_and_unverified(saved: str, source: dict[str, torch.Tensor]) -> None:
    """fp32 [4096, 4096], rows of 16 KiB, each rank's 4 KiB of them (a 12 KiB gap): streamed, in parts of
    512 rows read in two pieces; verified the tile is the slice (row groups of 256 rows), unverified the
    units are single rows -- the same requests either way here."""
    w = source["o_proj"]
    for verify, unit in [(True, 256), (False, 1)]:
        want = streamed(4096, 16 * KiB, 4 * KiB, unit, pieces=True)
        assert want[0] == 16
        for rank in range(TP):
            dest = torch.zeros(4096, 1024)
            stats = _load(saved, "o_proj", dest, rank, verify_checksums=verify)
            assert torch.equal(dest, _columns(w, rank)), (verify, rank)
            assert (stats.requests, stats.bytes_requested) == want, (verify, rank, stats)
            assert stats.bytes_needed == 4096 * 4 * KiB


@pytest.mark.parametrize("key", ["down", "down_bf16"])
def test_mlp_down_columns_read_a_request_per_row(saved: str, source: dict[str, torch.Tensor], key: str) -> None:
    """[4096, 11008] (fp32 rows of 43 KiB; bf16 rows of 21.5 KiB, a gap of 16,512 bytes: just past
    the 16 KiB a request costs): a request per row of exactly the slice's bytes (the tile is the
    slice), verified or not, into a contiguous destination and (fp32) a transposed one."""
    w = source[key]
    width = 11008 // TP
    cases = [(True, 1, False), (False, 3, False)] + ([(True, 2, True)] if key == "down" else [])
    for verify, rank, transposed in cases:
        dest = torch.zeros(width, 4096, dtype=w.dtype).t() if transposed else torch.zeros(4096, width, dtype=w.dtype)
        stats = _load(saved, key, dest, rank, verify_checksums=verify)
        assert torch.equal(dest, _columns(w, rank)), (verify, rank, transposed)
        assert stats.requests == 4096, (verify, rank, stats)
        assert stats.bytes_requested == stats.bytes_needed == 4096 * width * w.element_size(), (verify, rank)


def _record(path: str, key: str) -> tuple[str, int]:
    """``(data file, offset)`` of ``key``'s record (one chunk at TP=1)."""
    r = FsspecStorageReader(path)
    info = r.read_metadata().storage_data[MetadataIndex(key, [0, 0])]
    return os.path.join(path, info.relative_path), info.offset


def test_flipped_byte_mid_file_fails_the_streamed_load(saved: str, source: dict[str, torch.Tensor]) -> None:
    """Row 16000 of ``emb`` (the middle of its 250 MiB record): a byte flipped in the tile column ranks 0
    and 1 read fails their streamed load with CheckpointCorrupt; ranks 2 and 3 read the other tile
    column and load bit-exact. The byte is restored afterwards (the checkpoint is shared)."""
    file, offset = _record(saved, "m.emb")
    at = offset + 16000 * 8 * KiB + 2 * KiB + 100  # rank 1's own columns (bytes 2048..4095 of the row)
    flip_byte(file, at, 0x5A)
    try:
        for rank in (0, 1):
            with pytest.raises(CheckpointException) as info:
                _load(saved, "emb", torch.zeros(32000, 1024, dtype=torch.bfloat16), rank)
            (err,) = [e for e, _tb in info.value.failures.values()]
            assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err), (rank, err)
            assert Path(file).name in str(err), err
        for rank in (2, 3):
            dest = torch.zeros(32000, 1024, dtype=torch.bfloat16)
            _load(saved, "emb", dest, rank)
            assert torch.equal(dest, _columns(source["emb"], rank)), rank
    finally:
        flip_byte(file, at, 0x5A)
    dest = torch.zeros(32000, 1024, dtype=torch.bfloat16)
    _load(saved, "emb", dest, 1)
    assert torch.equal(dest, _columns(source["emb"], 1))
