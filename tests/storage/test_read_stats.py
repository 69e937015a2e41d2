"""``reader.last_read_stats`` tells the truth: ``bytes_needed`` is what the destinations receive (a
column slice counts its elements, not the rows that enclose it), ``bytes_read`` what came from storage,
and ``per_file`` splits both by file and adds up to the totals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SPECS = {"m.col": ShardSpec(1), "m.row*": ShardSpec(0)}


@pytest.mark.parametrize("verify", [True, False])
def test_column_and_small_row_slices_are_counted_exactly(tmp_path: Any, verify: bool) -> None:
    g = {"col": torch.randn(512, 1024), **{f"row{i}": torch.randn(256, 1024) for i in range(4)}}
    path = str(tmp_path / "ck")
    dcp.save({"m": g}, storage_writer=FsspecStorageWriter(path), planner=ParallelSavePlanner(ParallelLayout(), SPECS))
    rank, tp = 1, 4
    dest = {"col": torch.empty(512, 256), **{f"row{i}": torch.empty(64, 1024) for i in range(4)}}
    reader = FsspecStorageReader(path, verify_checksums=verify)
    dcp.load({"m": dest}, storage_reader=reader, planner=ParallelLoadPlanner(ParallelLayout(tp=tp), SPECS, rank=rank))
    assert torch.equal(dest["col"], g["col"][:, 256:512])
    for i in range(4):
        assert torch.equal(dest[f"row{i}"], g[f"row{i}"][64:128])

    stats = reader.last_read_stats
    assert stats is not None
    exact = sum(t.numel() * t.element_size() for t in dest.values())
    assert stats.bytes_needed == exact
    # the column slice's rows are interleaved with other ranks' columns: more is read than needed
    assert stats.bytes_read > stats.bytes_needed
    assert stats.amplification == stats.bytes_read / stats.bytes_needed > 1.0
    assert stats.per_file and sum(n for n, _ in stats.per_file.values()) == stats.bytes_needed
    assert sum(r for _, r in stats.per_file.values()) == stats.bytes_read
