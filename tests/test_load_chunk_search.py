"""The load planner's fast path finds each rank's saved chunk without scanning every chunk of every key.

A ZeRO-sharded tensor has tp * dp saved chunks; each rank looked for its piece among all of them for
each of its keys, so a rank's load planning grew with the world (the last rank's piece is the last
chunk). Pinned by counting the chunks the planner visits, not by a clock: one more layer must cost one
chunk lookup per key it adds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sim import MemoryReader, MemoryStore, MemoryWriter, reset_dcp_caches, sim_load, sim_save
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

TP, DP = 2, 8
HIDDEN = 16
# column-parallel (TP dim 0, ZeRO dim 1), row-parallel (TP dim 1, ZeRO dim 0), a norm (ZeRO dim 0)
PARAMS = (("qkv", (3 * HIDDEN, HIDDEN), 0, 1), ("proj", (HIDDEN, HIDDEN), 1, 0), ("ln", (HIDDEN,), None, 0))


def _specs() -> dict[str, Any]:
    specs: dict[str, Any] = {}
    for name, _, tp_dim, dp_dim in PARAMS:
        zero = ShardSpec(dp_dim, "dp")
        specs[f"optim.state.layers.*.{name}.exp_avg"] = zero if tp_dim is None else (ShardSpec(tp_dim, "tp"), zero)
        if tp_dim is not None:
            specs[f"model.layers.*.{name}"] = ShardSpec(tp_dim, "tp")
    return specs


def _piece(t: torch.Tensor, dim: int | None, parts: int, index: int) -> torch.Tensor:
    if dim is None:
        return t
    step = t.shape[dim] // parts
    return t.narrow(dim, index * step, step)


def _world(layers: int, layout: ParallelLayout) -> list[dict[str, Any]]:
    """Every rank's state dict: params TP-split (replicated over DP), their exp_avg ZeRO-split too."""
    gen = torch.Generator().manual_seed(5)
    full = {
        (i, name, kind): torch.randn(shape, generator=gen)
        for i in range(layers)
        for name, shape, _, _ in PARAMS
        for kind in ("param", "exp_avg")
    }
    states = []
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        model, optim = {}, {}
        for i in range(layers):
            for name, _, tp_dim, dp_dim in PARAMS:
                model[f"layers.{i}.{name}"] = _piece(full[(i, name, "param")], tp_dim, layout.tp, c.tp).clone()
                state = _piece(_piece(full[(i, name, "exp_avg")], tp_dim, layout.tp, c.tp), dp_dim, layout.dp, c.dp)
                optim[f"state.layers.{i}.{name}.exp_avg"] = state.clone()
        states.append({"model": model, "optim": optim})
    return states


class _CountingChunks(list):  # type: ignore[type-arg]
    """A saved tensor's chunk list that counts the chunks handed out."""

    visited = 0

    def __iter__(self) -> Iterator[Any]:
        for chunk in super().__iter__():
            _CountingChunks.visited += 1
            yield chunk

    def __getitem__(self, index: Any) -> Any:
        _CountingChunks.visited += 1
        return super().__getitem__(index)


def _saved(layers: int) -> tuple[ParallelLayout, list[dict[str, Any]], MemoryStore]:
    reset_dcp_caches()
    layout = ParallelLayout(tp=TP, dp=DP)
    states = _world(layers, layout)
    store = MemoryStore()
    planners = [ParallelSavePlanner(layout, _specs(), rank=r) for r in range(layout.world_size)]
    sim_save(states, planners, [MemoryWriter(store) for _ in states])
    return layout, states, store


def _chunks_visited_by_last_rank(layers: int) -> tuple[int, int]:
    """(chunks the last rank's load planning visits, its tensor keys), loading its own layout."""
    layout, states, store = _saved(layers)
    counted = _counted(MemoryReader(store).read_metadata())
    rank = layout.world_size - 1
    planner = ParallelLoadPlanner(layout, _specs(), rank=rank)
    planner.set_up_planner(states[rank], counted, False)
    _CountingChunks.visited = 0
    planner.create_local_plan()
    assert planner.report is not None and planner.report.resharded == ()
    return _CountingChunks.visited, planner.report.fast_path


def test_fast_path_chunk_lookups_do_not_grow_with_the_chunk_count() -> None:
    few, few_keys = _chunks_visited_by_last_rank(2)
    more, more_keys = _chunks_visited_by_last_rank(6)
    # the first layer's keys find the positions (a scan each); every later key is one lookup. Before,
    # each key scanned its TP * DP = 16 chunks up to the last rank's (the last)
    assert more_keys - few_keys == 4 * len(PARAMS) * 2
    assert more - few == more_keys - few_keys


@pytest.mark.parametrize("to", [ParallelLayout(tp=TP, dp=DP), ParallelLayout(tp=1, dp=1), ParallelLayout(tp=4, dp=2)])
def test_zero_world_loads_bit_exact(to: ParallelLayout) -> None:
    """The world loads back bit-exact, in its own layout (every rank on the fast path) and resharded."""
    _, _, store = _saved(3)
    want = _world(3, to)
    dests = [{part: {k: torch.full_like(v, -1.0) for k, v in sd[part].items()} for part in sd} for sd in want]
    planners = [ParallelLoadPlanner(to, _specs(), rank=r) for r in range(to.world_size)]
    sim_load(dests, planners, [MemoryReader(store) for _ in dests])
    for rank, (got, sd) in enumerate(zip(dests, want)):
        for part in sd:
            for key, value in sd[part].items():
                assert torch.equal(got[part][key], value), (rank, part, key)


def _counted(md: Metadata) -> Metadata:
    return Metadata(
        {
            k: dataclasses.replace(v, chunks=_CountingChunks(v.chunks)) if isinstance(v, TensorStorageMetadata) else v
            for k, v in md.state_dict_metadata.items()
        },
        planner_data=md.planner_data,
        storage_data=md.storage_data,
        storage_meta=md.storage_meta,
    )


def test_reader_set_up_indexes_no_chunk_and_reads_bit_exact(tmp_path: Any) -> None:
    """FsspecStorageReader's set-up visits no chunk (it indexed every chunk of the checkpoint on every
    rank); a rank's reads look up their own chunks only (the position each read item carries)."""
    reset_dcp_caches()
    layout = ParallelLayout(tp=TP, dp=DP)
    states = _world(2, layout)
    folder = str(tmp_path / "ckpt")
    sim_save(
        states,
        [ParallelSavePlanner(layout, _specs(), rank=r) for r in range(layout.world_size)],
        [FsspecStorageWriter(folder) for _ in states],
    )
    rank = layout.world_size - 1
    reader = FsspecStorageReader(folder)
    md = _counted(reader.read_metadata())
    planner = ParallelLoadPlanner(layout, _specs(), rank=rank)
    dest = {part: {k: torch.full_like(v, -1.0) for k, v in states[rank][part].items()} for part in states[rank]}
    planner.set_up_planner(dest, md, False)
    _CountingChunks.visited = 0
    reader.set_up_storage_reader(md, False, rank=rank)
    assert _CountingChunks.visited == 0
    plan = planner.finish_plan(planner.create_global_plan([reader.prepare_local_plan(planner.create_local_plan())])[0])
    _CountingChunks.visited = 0
    reader.read_data(plan, planner).wait()
    assert 0 < _CountingChunks.visited <= 2 * len(plan.items)  # the offsets check and the sizes: one chunk each
    for part in dest:
        for key, value in states[rank][part].items():
            assert torch.equal(dest[part][key], value), (part, key)
