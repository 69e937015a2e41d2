"""The save planner's plan caches across saves: what they reuse, and that no failed or partial save can
make a later save write metadata for a structure some rank no longer has (simulated world, real DCP calls
in DCP's order, values checked bit-exactly)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from sim import MemoryReader, MemoryStore, MemoryWriter, reset_dcp_caches, sim_load, sim_save
from torch.distributed.checkpoint.planner import SavePlan

from smpckpt import CheckpointError, ParallelLayout, ShardSpec, SpecError
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter, FullOptions

DP2 = ParallelLayout(dp=2)


def setup_function():
    reset_dcp_caches()


def state(dtype: torch.dtype = torch.bfloat16, step: int = 0) -> list[dict]:
    """Two DP replicas; ``b`` holds values that read differently as bfloat16 and float16."""
    return [
        {
            "w": torch.arange(4, dtype=torch.float32) + step,
            "b": torch.tensor([1.5, -2.25, 3.0], dtype=dtype),
            "step": step,
        }
        for _ in range(2)
    ]


def load_back(store: MemoryStore, like: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    sim_load([out], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [MemoryReader(store)])
    return out


def assert_round_trip(store: MemoryStore, saved: dict) -> None:
    back = load_back(store, saved)
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        else:
            assert back[k] == v, k


class RefusingWriter(MemoryWriter):
    """Fails the save after the planner's global plan and before any rank's finish_plan (as a writer
    refusing to replace a committed checkpoint does)."""

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        raise FileExistsError("target holds a committed checkpoint")


@pytest.mark.parametrize("scope", ["global", "local"])
def test_a_save_failed_after_planning_leaves_no_stale_global_plan(scope):
    """Structure changes, that save fails after global planning, the structure changes back: the next
    save must describe what is written (it used to reuse the failed save's metadata: float16 for
    bfloat16 bytes, silently wrong values)."""
    planners = [ParallelSavePlanner(DP2, rank=r, cache_scope=scope) for r in range(2)]
    sim_save(state(torch.bfloat16), planners, [MemoryWriter(MemoryStore()) for _ in range(2)])
    with pytest.raises(FileExistsError):
        sim_save(state(torch.float16), planners, [RefusingWriter(MemoryStore()), MemoryWriter(MemoryStore())])
    store = MemoryStore()
    saved = state(torch.bfloat16, step=3)
    sim_save(saved, planners, [MemoryWriter(store) for _ in range(2)])
    assert store.metadata.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    assert_round_trip(store, saved[0])


def test_a_global_plan_delivered_to_some_ranks_only_fails_one_save_cleanly_then_plans_afresh():
    """The coordinator's finish_plan never ran (its scatter half-failed) while rank 1's did: rank 1 holds
    a cache the coordinator dropped. The next save fails with a clear error and writes nothing; the one
    after it plans afresh and is exact."""
    planners = [ParallelSavePlanner(DP2, rank=r) for r in range(2)]
    sim_save(state(), planners, [MemoryWriter(MemoryStore()) for _ in range(2)])
    # a second round by hand: rank 1 finishes planning, the coordinator does not
    sds = state(step=1)
    plans = []
    for r in range(2):
        planners[r].set_up_planner(sds[r], None, r == 0)
        plans.append(planners[r].create_local_plan())
    global_plans, _ = planners[0].create_global_plan(plans)
    planners[1].finish_plan(global_plans[1])
    store = MemoryStore()
    with pytest.raises(SpecError, match="does not hold"):
        sim_save(state(step=1), planners, [MemoryWriter(store) for _ in range(2)])  # unchanged: rank 1 reuses
    assert store.metadata is None
    store = MemoryStore()
    saved = state(step=3)
    sim_save(saved, planners, [MemoryWriter(store) for _ in range(2)])
    assert planners[0].report.cached is False
    assert_round_trip(store, saved[0])


def test_global_scope_reuses_while_unchanged_and_notices_every_field():
    planners = [ParallelSavePlanner(DP2, rank=r) for r in range(2)]
    for step, expect in ((0, False), (0, True)):
        sim_save(state(step=step), planners, [MemoryWriter(MemoryStore()) for _ in range(2)])
        assert planners[0].report.cached is expect
    # requires_grad is recorded in the metadata: a change must re-plan
    sds = state()
    for sd in sds:
        sd["w"].requires_grad_(True)
    store = MemoryStore()
    sim_save(sds, planners, [MemoryWriter(store) for _ in range(2)])
    assert planners[0].report.cached is False
    assert store.metadata.state_dict_metadata["w"].properties.requires_grad is True


def test_local_scope_reuses_the_local_plan_with_fresh_object_values_and_mixes_with_fresh_planners():
    reused = [ParallelSavePlanner(DP2, rank=r, cache_scope="local") for r in range(2)]
    for step in range(3):
        # rank 1 reuses; rank 0 gets a fresh planner at every other save: any mix is correct
        planners = [reused[0] if step % 2 else ParallelSavePlanner(DP2, rank=0, cache_scope="local"), reused[1]]
        before = reused[1]._cache.local
        store = MemoryStore()
        saved = state(step=step)
        sim_save(saved, planners, [MemoryWriter(store) for _ in range(2)])
        if step:
            # the same items (not re-planned), though the object "step" changed value
            assert reused[1]._cache.local is not None and reused[1]._cache.local.items is before.items
        assert_round_trip(store, saved[0])


def test_local_scope_replans_when_the_structure_changes():
    planners = [
        ParallelSavePlanner(ParallelLayout(tp=2), {"w": ShardSpec(0)}, rank=r, cache_scope="local") for r in range(2)
    ]
    for rows in (2, 2, 3):
        store = MemoryStore()
        sds = [{"w": torch.full((rows, 2), float(r + 1))} for r in range(2)]
        sim_save(sds, planners, [MemoryWriter(store) for _ in range(2)])
        back = load_back(store, {"w": torch.zeros(2 * rows, 2)})
        assert torch.equal(back["w"], torch.cat([sds[0]["w"], sds[1]["w"]]))


def test_release_state_drops_the_saved_tensors_and_keeps_the_cache():
    planner = ParallelSavePlanner(ParallelLayout(), rank=0, cache_scope="local")
    sd = {"w": torch.ones(1024)}
    ref = weakref.ref(sd["w"])
    sim_save([sd], [planner], [MemoryWriter(MemoryStore())])
    del sd
    gc.collect()
    assert ref() is not None  # the planner still holds it
    planner.release_state()
    gc.collect()
    assert ref() is None
    assert planner._cache.local is not None


def test_cache_scope_is_checked():
    with pytest.raises(SpecError, match="cache_scope"):
        ParallelSavePlanner(DP2, rank=0, cache_scope="everywhere")  # type: ignore[arg-type]


def test_a_planner_that_coordinated_before_does_not_reuse_that_plan_after_another_coordinator():
    """Two groups over the same planners with different coordinators (rank order reversed): the planner
    that coordinated the first save must not pass off that global plan under the generation of the
    second coordinator's plan (it did: float16 recorded for bfloat16 bytes)."""
    planners = [ParallelSavePlanner(DP2, rank=r) for r in range(2)]
    sim_save(state(torch.float16), planners, [MemoryWriter(MemoryStore()) for _ in range(2)])
    sds = state(torch.bfloat16)
    sim_save([sds[1], sds[0]], [planners[1], planners[0]], [MemoryWriter(MemoryStore()) for _ in range(2)])
    store = MemoryStore()
    saved = state(torch.bfloat16)  # unchanged since the second save (objects too): the ranks reuse
    try:
        sim_save(saved, planners, [MemoryWriter(store) for _ in range(2)])
    except SpecError as exc:  # refusing is correct too; then the next save plans afresh
        assert "does not hold" in str(exc) and store.metadata is None
        sim_save(saved, planners, [MemoryWriter(store) for _ in range(2)])
    assert store.metadata.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    assert_round_trip(store, saved[0])


def test_the_cached_metadata_is_not_the_object_the_storage_writer_rewrites(tmp_path):
    """A full-mode writer rewrites the metadata it is handed (whole chunks, export dtype); the next
    unchanged save with the same planner to a partial writer must not inherit that (it recorded
    bfloat16 for float16 bytes: silently wrong values)."""
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    sd = {"model": {"w": torch.arange(6, dtype=torch.float16) / 3}}
    full = FullOptions(dtype=torch.bfloat16)
    sim_save([sd], [planner], [FullArtifactWriter(tmp_path / "full", full=full, sync_files=False)])
    sim_save([sd], [planner], [FsspecStorageWriter(tmp_path / "partial", sync_files=False)])
    assert planner.report.cached is True
    md = FsspecStorageReader(tmp_path / "partial").read_metadata()
    assert md.state_dict_metadata["model.w"].properties.dtype == torch.float16
    out = {"model": {"w": torch.zeros(6, dtype=torch.float16)}}
    sim_load([out], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(tmp_path / "partial")])
    assert torch.equal(out["model"]["w"], sd["model"]["w"])


def test_a_full_mode_writer_refuses_cached_plans_with_the_fix_and_the_next_save_works(tmp_path):
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    sd = {"w": torch.arange(6, dtype=torch.float32)}
    sim_save([sd], [planner], [FsspecStorageWriter(tmp_path / "a", sync_files=False)])
    with pytest.raises(CheckpointError, match="cache_scope='local'"):
        sim_save([sd], [planner], [FullArtifactWriter(tmp_path / "b", sync_files=False)])
    sim_save([sd], [planner], [FullArtifactWriter(tmp_path / "c", sync_files=False)])
    out = {"w": torch.zeros(6)}
    sim_load([out], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(tmp_path / "c")])
    assert torch.equal(out["w"], sd["w"])


def test_rescope_keeps_the_local_memo_only_where_it_is_exact():
    planner = ParallelSavePlanner(ParallelLayout(tp=2), {"w": ShardSpec(0)}, rank=0, cache_scope="local")
    other = ParallelSavePlanner(ParallelLayout(tp=2), {"w": ShardSpec(0)}, rank=1, cache_scope="local")
    sds = [{"w": torch.full((2, 2), float(r + 1))} for r in range(2)]
    sim_save(sds, [planner, other], [MemoryWriter(MemoryStore()) for _ in range(2)])
    first = planner._cache.local
    planner.release_state(scope=True)
    planner.rescope(ParallelLayout(tp=2), {"w": ShardSpec(0)}, rank=0)
    sim_save(sds, [planner, other], [MemoryWriter(MemoryStore()) for _ in range(2)])
    assert first is not None and planner._cache.local is not None and planner._cache.local.items is first.items
    # now the same tensors as DP replicas: a new layout and no spec, so a new plan -- and exact
    planner.rescope(DP2, None, rank=0)
    other.rescope(DP2, None, rank=1)
    store = MemoryStore()
    same = [{"w": torch.full((2, 2), 5.0)} for _ in range(2)]
    sim_save(same, [planner, other], [MemoryWriter(store) for _ in range(2)])
    assert planner._cache.local.items is not first.items
    assert store.metadata.state_dict_metadata["w"].size == torch.Size([2, 2])
    assert torch.equal(load_back(store, {"w": torch.zeros(2, 2)})["w"], same[0]["w"])


def test_tensor_properties_ask_is_pinned_only_where_pinning_is_possible() -> None:
    """Without an accelerator torch answers ``is_pinned()`` False without asking, so the planner's
    signature and write items take False for it then (``_cache.pinning_possible``); the plan's
    properties are what ``TensorProperties.create_from_tensor`` gives for every tensor either way."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    from smpckpt.planners import _cache

    assert _cache.pinning_possible() == (torch._C._accelerator_getAccelerator() is not None)
    sd = {"a": torch.zeros(3), "b": torch.ones(2, 2, dtype=torch.bfloat16).requires_grad_(), "c": torch.arange(4)}
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    planner.set_up_planner(sd)
    plan = planner.create_local_plan()
    for item in plan.items:
        assert item.tensor_data is not None
        assert item.tensor_data.properties == TensorProperties.create_from_tensor(sd[item.index.fqn])
