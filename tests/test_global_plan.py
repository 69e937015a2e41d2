"""The coordinator's global plan (``planners/save``): differential tests against DCP's own
``create_default_global_save_plan`` and ``_validate_global_plan``, which ours replace for speed, and the
save report's bytes per rank (a shard's own bytes, not its whole tensor's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import MemoryStore, MemoryWriter, reset_dcp_caches, sim_save
from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import TensorProperties as Props
from torch.distributed.checkpoint.planner import SavePlan

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.planners import ParallelSavePlanner
from smpckpt.planners.save import _grid_tiled, dedup_plans, global_save_plan, tiling_errors


def _local_plans(layout: ParallelLayout, sd: Any, specs: Any) -> list[SavePlan]:
    reset_dcp_caches()
    plans = []
    for rank in range(layout.world_size):
        planner = ParallelSavePlanner(layout, specs, rank=rank)
        planner.set_up_planner(sd(rank), None, rank == 0)
        plans.append(planner.create_local_plan())
    return dedup_plans(plans, None)


def _zero_tp_pp(rank: int) -> dict[str, Any]:
    """TP=2 x DP=2 x PP=2: TP row and column shards, ZeRO-split optimizer state (uneven: an empty piece
    on DP rank 0 of one key), replicas, objects."""
    layout = ParallelLayout(tp=2, dp=2, pp=2)
    c = layout.coords(rank)
    stage = f"layers.{c.pp}"
    return {
        "model": {
            f"{stage}.qkv": torch.full((4, 8), float(rank // 2)),
            f"{stage}.proj": torch.full((8, 4), float(c.pp)),
            f"{stage}.norm": torch.ones(8),
        },
        "optim": {
            f"state.{stage}.qkv.exp_avg": torch.zeros(2, 8),
            f"state.{stage}.uneven": torch.zeros(0 if c.dp == 0 else 6, 3),
            "step": 7,
        },
        "extra": {"epoch": 3},
    }


LAYOUTS = {
    "tp_dp_pp_zero": (
        ParallelLayout(tp=2, dp=2, pp=2),
        _zero_tp_pp,
        {
            "model.layers.*.qkv": ShardSpec(0),
            "model.layers.*.proj": ShardSpec(1),
            "optim.state.layers.*.qkv.exp_avg": (ShardSpec(0), ShardSpec(0, axis="dp")),
            "optim.state.layers.*.uneven": ShardSpec(0, axis="dp", sizes=(0, 6)),
        },
    ),
    "replicas": (ParallelLayout(dp=3), lambda r: {f"t{i}": torch.full((5 + i,), float(i)) for i in range(7)}, None),
    "one_rank": (ParallelLayout(), lambda r: {"w": torch.ones(3, 2), "o": {"a": 1}}, None),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_global_plan_is_dcps_item_for_item(case: str) -> None:
    layout, sd, specs = LAYOUTS[case]
    plans = _local_plans(layout, sd, specs)
    ours, md, per_rank = global_save_plan(plans)
    theirs, dcp_md = create_default_global_save_plan(plans)
    assert md == dcp_md
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a.storage_data, a.planner_data, a.usable) == (b.storage_data, b.planner_data, b.usable)
        assert a.items == b.items
        # MetadataIndex compares without its hint: the hints are what the rewrite is for
        assert [i.index.index for i in a.items] == [i.index.index for i in b.items]
        assert [type(i.index.offset) for i in a.items] == [type(i.index.offset) for i in b.items]
    # a shard's own bytes (DCP's tensor_storage_size would count its whole global tensor)
    own = tuple(
        sum(
            i.tensor_data.chunk.sizes.numel() * i.tensor_data.properties.dtype.itemsize
            for i in p.items
            if i.tensor_data is not None
        )
        for p in ours
    )
    assert per_rank == own
    assert tiling_errors(ours, md) == _validate_global_plan(ours, md) == []


def test_the_save_report_counts_each_ranks_own_bytes() -> None:
    """A TP=2 split of a 6x4 fp32 tensor writes 48 bytes per rank; the report said 96 (each shard
    counted as the whole tensor), so its balance was wrong wherever shards and replicas mix."""
    reset_dcp_caches()
    layout = ParallelLayout(tp=2)
    planners = [ParallelSavePlanner(layout, {"w": ShardSpec(0)}, rank=r) for r in range(2)]
    sds = [{"w": torch.full((3, 4), float(r)), "b": torch.ones(12)} for r in range(2)]
    sim_save(sds, planners, [MemoryWriter(MemoryStore()) for _ in range(2)])
    report = planners[0].report
    assert report is not None
    assert sorted(report.bytes_per_rank) == [48, 48 + 48]  # one rank also writes the replicated 'b'


# -- the tiling check: a fast proof for grids, DCP's sweep for the rest -----------------------------------
def _grid(size: tuple[int, ...], cuts: list[list[int]]) -> list[ChunkStorageMetadata]:
    chunks = [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]
    for d, line in enumerate(cuts):
        bounds = [0, *line, size[d]]
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size([*c.offsets, lo]), sizes=torch.Size([*c.sizes, hi - lo]))
            for c in chunks
            for lo, hi in zip(bounds, bounds[1:])
        ]
    return chunks


@st.composite
def chunkings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[ChunkStorageMetadata], bool]:
    """A tensor size and its chunks: a grid (some cells merged along one dim, sometimes), then perhaps
    damaged: a chunk dropped, repeated, moved, grown past the end, or emptied."""
    size = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else [] for n in size]
    chunks = _grid(size, cuts)
    damage = draw(st.sampled_from(["none", "drop", "repeat", "move", "grow", "empty", "shuffle"]))
    i = draw(st.integers(0, len(chunks) - 1))
    c = chunks[i]
    d = draw(st.integers(0, len(size) - 1))
    intact = damage in ("none", "shuffle") or (damage == "drop" and len(chunks) == 1)
    if damage == "drop" and len(chunks) > 1:
        del chunks[i]
    elif damage == "repeat":
        chunks.append(c)
    elif damage == "move":
        off = list(c.offsets)
        off[d] += draw(st.integers(1, 3))
        chunks[i] = dataclasses.replace(c, offsets=torch.Size(off))
    elif damage == "grow":
        sz = list(c.sizes)
        sz[d] += draw(st.integers(1, 3))
        chunks[i] = dataclasses.replace(c, sizes=torch.Size(sz))
    elif damage == "empty":
        sz = list(c.sizes)
        sz[d] = 0
        chunks.append(dataclasses.replace(c, sizes=torch.Size(sz)))
    elif damage == "shuffle":
        chunks = draw(st.permutations(chunks))
    return size, chunks, intact


@settings(max_examples=300, deadline=None)
@given(chunkings(), st.integers(1, 3))
def test_tiling_errors_are_dcps(case: tuple[tuple[int, ...], list[ChunkStorageMetadata], bool], ranks: int) -> None:
    size, chunks, _ = case
    props = Props(dtype=torch.float32)
    md = Metadata(
        {
            "t": TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks),
            "whole": TensorStorageMetadata(
                properties=props, size=torch.Size([2]), chunks=[ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))]
            ),
        }
    )
    plans = [SavePlan([]) for _ in range(ranks)]  # DCP checks the volume only with more than one plan
    assert tiling_errors(plans, md) == _validate_global_plan(plans, md)


@settings(max_examples=100, deadline=None)
@given(chunkings())
def test_grids_are_proven_without_the_sweep(case: tuple[tuple[int, ...], list[ChunkStorageMetadata], bool]) -> None:
    """Exact grid tilings (in any order) take the one-pass proof; everything the proof accepts is a
    tiling DCP's check finds nothing wrong with."""
    size, chunks, intact = case
    proven = _grid_tiled(torch.Size(size), chunks)
    if intact:
        assert proven
    if proven:
        md = Metadata({"t": TensorStorageMetadata(Props(dtype=torch.float32), torch.Size(size), chunks)})
        assert _validate_global_plan([SavePlan([]), SavePlan([])], md) == []
