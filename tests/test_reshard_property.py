"""Property tests: any saved layout reloads into any other layout, bit-exact (simulated world)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim import MemoryReader, MemoryStore, MemoryWriter, reset_dcp_caches, sim_load, sim_save
from world_gen import draw_partition, flat_tensors, global_values, layouts, models, rank_state, specs_for

from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner

CI = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
MORE = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def save_world(model, values, layout, parts, store, *, rank_local=False, **kw):
    specs = specs_for(model, parts)
    world = layout.world_size
    sds = [rank_state(model, values, layout, r, parts, rank_local=rank_local) for r in range(world)]
    planners = [
        ParallelSavePlanner(layout, specs, rank=r, rank_local=("rng.*",) if rank_local else (), **kw)
        for r in range(world)
    ]
    return sim_save(sds, planners, [MemoryWriter(store) for _ in range(world)]), planners


def load_world(model, values, layout, parts, store, *, rank_local=False):
    specs = specs_for(model, parts)
    world = layout.world_size
    blanks = [rank_state(model, values, layout, r, parts, blank=True, rank_local=rank_local) for r in range(world)]
    planners = [
        ParallelLoadPlanner(layout, specs, rank=r, rank_local=("rng.*",) if rank_local else ()) for r in range(world)
    ]
    readers = [MemoryReader(store) for _ in range(world)]
    sim_load(blanks, planners, readers)
    return blanks, planners, readers


def assert_world_equal(model, values, layout, parts, loaded, *, rank_local=False):
    for rank, sd in enumerate(loaded):
        expected = flat_tensors(rank_state(model, values, layout, rank, parts, rank_local=rank_local))
        got = flat_tensors(sd)
        assert expected.keys() == got.keys()
        for key, want in expected.items():
            have = got[key]
            if isinstance(want, torch.Tensor):
                assert have.dtype == want.dtype, (rank, key)
                assert torch.equal(have, want), f"rank {rank} {key}: {have} != {want}"
            else:
                assert have == want, (rank, key)


def roundtrip(data, max_world):
    reset_dcp_caches()
    model = data.draw(models())
    values = global_values(model)
    save_layout = data.draw(layouts(model.layers, max_world), label="save")
    load_layout = data.draw(layouts(model.layers, max_world), label="load")
    save_parts = draw_partition(model, save_layout, data.draw)
    load_parts = draw_partition(model, load_layout, data.draw)
    store = MemoryStore()
    metadata, _ = save_world(model, values, save_layout, save_parts, store)
    loaded, planners, _ = load_world(model, values, load_layout, load_parts, store)
    assert_world_equal(model, values, load_layout, load_parts, loaded)
    # Every global element was written exactly once: chunk bytes add up to the global tensors' bytes.
    written = sum(t.numel() * t.element_size() for t in store.chunks.values())
    need = sum(v.numel() * v.element_size() for v in values.values())
    assert written == need


@CI
@given(st.data())
def test_reshard_roundtrip_any_layout(data):
    roundtrip(data, max_world=32)


@pytest.mark.slow
@MORE
@given(st.data())
def test_reshard_roundtrip_any_layout_more(data):
    roundtrip(data, max_world=128)


@CI
@given(st.data())
def test_same_layout_takes_fast_path_and_keeps_rank_local(data):
    reset_dcp_caches()
    model = data.draw(models())
    values = global_values(model)
    layout = data.draw(layouts(model.layers, 16))
    parts = draw_partition(model, layout, data.draw)
    store = MemoryStore()
    save_world(model, values, layout, parts, store, rank_local=True)
    loaded, planners, _ = load_world(model, values, layout, parts, store, rank_local=True)
    assert_world_equal(model, values, layout, parts, loaded, rank_local=True)
    for p in planners:
        assert p.report.resharded == ()
        assert p.report.fast_path > 0
        assert p.report.saved_layout == layout
