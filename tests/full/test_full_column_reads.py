"""Column shards read back from a full artifact at the layout that saved them (tier 1).

A column (dim 1) shard is one run per row in the row-major artifact. Read at its own layout, every
check unit it touches lies inside it: rows far apart (gap past the request cost) are read once straight
into the destination, a request per row, each unit verified where it lies there; rows close together
stream as sequential spans (``storage/full/_files.py``). These tests pin what those paths must keep:
values bit-exact, the bytes each path reads, a damaged byte in the shard found, and a damaged byte in
another rank's columns never used. On S3 (loopback moto) the rows share ranged GETs, and the bytes read
are reported GET for GET, through both the shared spans and boxes too large for one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from damage import flip_byte
from s3_env import serve_full_artifact
from sim import reset_dcp_caches, sim_save
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt import CheckpointCorrupt, ParallelLayout, ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FullArtifactWriter

TP = 4
#: rows of 32 KiB: a rank's column shard is one 8 KiB run per row, checked in tiles of two column
#: groups, so units lie at column offsets inside the shard too
WIDE = torch.arange(96 * 8192, dtype=torch.float32).reshape(96, 8192) * 0.5 + 0.25
#: rows of 1 KiB (256 B per shard row): column runs far shorter than a page
NARROW = torch.arange(40 * 256, dtype=torch.float32).reshape(40, 256) - 7.0
SPECS = {"model.wide": ShardSpec(1), "model.narrow": ShardSpec(1)}


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = t.shape[1] // TP
    return t[:, rank * n : (rank + 1) * n].contiguous()


@pytest.fixture()
def artifact(tmp_path: Path) -> Path:
    reset_dcp_caches()
    layout = ParallelLayout(tp=TP)
    sds = [{"model": {"wide": shard(WIDE, r), "narrow": shard(NARROW, r)}} for r in range(TP)]
    sim_save(
        sds,
        [ParallelSavePlanner(layout, SPECS, rank=r) for r in range(TP)],
        [FullArtifactWriter(str(tmp_path), sync_files=False) for _ in range(TP)],
    )
    return tmp_path


def load_rank(folder: Path, rank: int) -> tuple[dict[str, torch.Tensor], Any]:
    """Rank ``rank`` of the TP layout loads its shards alone (one process, no process group)."""
    dest = {"wide": torch.full_like(shard(WIDE, rank), float("nan")), "narrow": torch.zeros_like(shard(NARROW, rank))}
    reader = FsspecStorageReader(str(folder))
    planner = ParallelLoadPlanner(ParallelLayout(tp=TP), SPECS, rank=rank)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": dest}, storage_reader=reader, planner=planner, no_dist=True)
    return dest, reader.last_read_stats


def element_offset(folder: Path, key: str, row: int, col: int) -> tuple[Path, int]:
    """The file and byte offset of ``key[row, col]`` (float32) in the artifact."""
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        if key in header:
            start = header[key]["data_offsets"][0]
            width = header[key]["shape"][1]
            return path, 8 + n + start + (row * width + col) * 4
    raise AssertionError(f"{key} in no file")


@pytest.mark.parametrize("rank", range(TP))
def test_column_shards_load_bit_exact_by_the_streaming_cost_model(artifact: Path, rank: int) -> None:
    """``wide`` (an 8 KiB run in rows of 32 KiB: a gap past the 16 KiB request cost) reads exactly its
    bytes, a request per row; ``narrow`` (256 B in rows of 1 KiB) streams its rows as one sequential
    span, gaps included (the partial reader's cost model), instead of 40 requests of 256 B."""
    got, stats = load_rank(artifact, rank)
    assert torch.equal(got["wide"], shard(WIDE, rank))
    assert torch.equal(got["narrow"], shard(NARROW, rank))
    wide, narrow = WIDE.numel() * 4 // TP, NARROW.numel() * 4 // TP
    assert stats.bytes_needed == wide + narrow
    narrow_span = (NARROW.shape[0] - 1) * NARROW.shape[1] * 4 + NARROW.shape[1] * 4 // TP
    assert stats.bytes_read == wide + narrow_span, stats
    assert stats.requests == WIDE.shape[0] + 1, stats


@pytest.mark.parametrize("key", ["wide", "narrow"])
def test_damaged_byte_in_a_column_shard_is_found_by_its_rank_only(artifact: Path, key: str) -> None:
    t = WIDE if key == "wide" else NARROW
    owner, width = 2, t.shape[1] // TP
    path, offset = element_offset(artifact, f"model.{key}", row=t.shape[0] - 3, col=owner * width + width - 1)
    flip_byte(path, offset, 0x10)
    with pytest.raises(CheckpointException) as info:
        load_rank(artifact, owner)
    (failure,) = [exc for exc, _ in info.value.failures.values()]
    assert isinstance(failure, CheckpointCorrupt)
    assert f"checksum mismatch in tensor 'model.{key}'" in str(failure)
    for rank in range(TP):
        if rank != owner:  # never read the damaged columns: they load, bit-exact
            got, _ = load_rank(artifact, rank)
            assert torch.equal(got[key], shard(t, rank))


@pytest.mark.s3
@pytest.mark.parametrize("span_limit", [None, 4096], ids=["spans", "boxes-over-the-span-limit"])
def test_column_shards_from_s3_report_exactly_the_bytes_their_gets_fetched(
    artifact: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, span_limit: int | None
) -> None:
    """On an object store a column box's rows share ranged GETs (whole spans, other ranks' columns
    included), so more is fetched than needed: ``bytes_read`` must say how much, GET for GET. With a
    small span limit every box is larger than a span, and its rows are fetched in groups instead."""
    bucket = "smpckpt-full-columns"
    opts, gets = serve_full_artifact(monkeypatch, artifact, moto_endpoint, bucket, span_limit)
    for rank in range(TP):
        gets.clear()
        dest = {
            "wide": torch.full_like(shard(WIDE, rank), float("nan")),
            "narrow": torch.zeros_like(shard(NARROW, rank)),
        }
        reader = FsspecStorageReader(f"s3://{bucket}/ck", storage_options=opts)
        planner = ParallelLoadPlanner(ParallelLayout(tp=TP), SPECS, rank=rank)
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"model": dest}, storage_reader=reader, planner=planner, no_dist=True)
        assert torch.equal(dest["wide"], shard(WIDE, rank)) and torch.equal(dest["narrow"], shard(NARROW, rank))
        stats = reader.last_read_stats
        assert stats is not None and gets
        assert all(start is not None and end is not None for _, start, end in gets), gets  # ranged GETs only
        assert stats.bytes_needed == (WIDE.numel() + NARROW.numel()) * 4 // TP
        assert stats.bytes_read == sum(end - start for _, start, end in gets), (rank, stats)
        assert stats.requests == len(gets)


@pytest.mark.s3
def test_a_span_get_of_a_data_file_deleted_meanwhile_is_called_missing(
    artifact: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev72n L2 (38fcc51, untested until then): a box past the span limit reads its rows in a batch of ranged GETs
    (``_spans``), whose failures come back as results; one of a data file deleted after the metadata was read was
    raised as a bare ``FileNotFoundError``. It is ``CheckpointCorrupt`` "data file is missing", naming the file,
    as on every other read path."""
    import s3fs

    bucket = "smpckpt-full-missing"
    opts, gets = serve_full_artifact(monkeypatch, artifact, moto_endpoint, bucket, 4096)
    fs = s3fs.S3FileSystem(**opts)
    doomed = sorted(p for p in fs.ls(f"{bucket}/ck") if p.endswith(".safetensors"))

    class Meanwhile(ParallelLoadPlanner):  # runs after the metadata is read, before any data read
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            super().set_up_planner(*args, **kwargs)
            fs.rm(doomed)

    dest = {"wide": torch.zeros_like(shard(WIDE, 1))}  # 8 KiB of each 32 KiB row: a box past the 4 KiB span limit
    reader = FsspecStorageReader(f"s3://{bucket}/ck", storage_options=opts)
    planner = Meanwhile(ParallelLayout(tp=TP), SPECS, rank=1, allow_partial_load=True)
    with pytest.raises(CheckpointException) as info, pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": dest}, storage_reader=reader, planner=planner, no_dist=True)
    assert len(gets) == WIDE.shape[0], gets  # the rows' batch of GETs was sent, each failed
    (failure,) = [exc for exc, _ in info.value.failures.values()]
    assert isinstance(failure, CheckpointCorrupt) and "data file is missing" in str(failure), repr(failure)
    assert any(p.rsplit("/", 1)[1] in str(failure) for p in doomed), (failure, doomed)
