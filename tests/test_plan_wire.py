"""Save and load plans across ranks as flat columns (planners/_cache.py), tier 1.

A compact plan must unpickle as exactly the plan a plain pickle gives -- every field, the index hints
(which ``WriteItem`` equality ignores) and the sharing of ``torch.Size``/``TensorProperties`` objects
-- while making fewer tracked objects (each one walked by the next full collection).
"""

from __future__ import annotations

import dataclasses
import pickle
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import sim_save, tracked_objects_made
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.planners import _cache as _plan_wire  # the wire format lives with the plan cache
from smpckpt.planners._cache import FIELDS_PER_ITEM, FIELDS_PER_READ, CompactLoadPlan, CompactSavePlan, compact
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter


def _types(it: WriteItem) -> tuple[type, ...]:
    td = it.tensor_data
    parts = (it.index.offset,) if td is None else (it.index.offset, td.chunk.offsets, td.chunk.sizes, td.size)
    return tuple(type(p) for p in parts)


#: Python 3.11+ keeps an instance's attributes inline until its ``__dict__`` is asked for; 3.10 makes a
#: dict per instance whatever builds it, so there the object counts below do not drop (bytes still do).
INLINE_VALUES = sys.version_info >= (3, 11)


def _fields(plan: SavePlan) -> list[Any]:
    """Every field of every item, the index hint included (WriteItem equality leaves it out), and the
    type of every offset and shape (a tuple equals a torch.Size)."""
    return [(it, it.index.index, _types(it)) for it in plan.items] + [
        plan.storage_data,
        plan.planner_data,
        plan.usable,
    ]


def _read_fields(plan: LoadPlan) -> list[Any]:
    """Every field of every read item, both index hints and the type of every offset and length
    included."""
    parts = ("dest_offsets", "storage_offsets", "lengths")
    return [
        (
            it,
            it.dest_index.index,
            it.storage_index.index,
            type(it.dest_index.offset),
            type(it.storage_index.offset),
            *(type(getattr(it, p)) for p in parts),
        )
        for it in plan.items
    ] + [
        plan.storage_data,
        plan.planner_data,
    ]


def _real_local_plan() -> SavePlan:
    """Rank 1's local plan at TP=2 DP=2: TP shards, whole replicated tensors, an object."""
    layout = ParallelLayout(tp=2, dp=2)
    state = {f"layers.{i}.w": torch.ones(4, 8) * i for i in range(300)}
    state.update({f"layers.{i}.norm": torch.ones(8) for i in range(300)})
    planner = ParallelSavePlanner(layout, {"*.w": ShardSpec(0)}, rank=1)
    planner.set_up_planner({"model": state, "step": 7}, is_coordinator=False)
    return planner.create_local_plan()


def test_a_real_local_plan_crosses_as_the_same_plan_with_fewer_objects() -> None:
    plan = _real_local_plan()
    assert isinstance(plan, CompactSavePlan)  # what the planner hands DCP's gather
    kinds = {it.type for it in plan.items}
    assert kinds == {WriteItemType.SHARD, WriteItemType.TENSOR, WriteItemType.BYTE_IO}
    plain = SavePlan(plan.items, plan.storage_data, plan.planner_data, plan.usable)

    compact_objects, received = tracked_objects_made(lambda: pickle.loads(pickle.dumps(plan)))
    plain_objects, expected = tracked_objects_made(lambda: pickle.loads(pickle.dumps(plain)))
    assert type(received) is SavePlan  # receivers get DCP's own class
    assert _fields(received) == _fields(expected) == _fields(plain)
    # shared objects stay shared, and an item's equal index and chunk offsets become one
    for received_or_sent in (received, plan):
        assert len({id(it.tensor_data.properties) for it in received_or_sent.items if it.tensor_data}) == 1
    tensors = [it for it in received.items if it.tensor_data]
    assert all(it.index.offset is it.tensor_data.chunk.offsets for it in tensors)
    assert len({id(it.tensor_data.chunk.offsets) for it in tensors}) <= len(
        {id(it.tensor_data.chunk.offsets) for it in plan.items if it.tensor_data}
    )
    n = len(plan.items)
    assert plain_objects > 9 * n  # a __dict__ per dataclass per item ...
    assert compact_objects < 6 * n or not INLINE_VALUES  # ... none here
    assert len(pickle.dumps(plan)) < 0.8 * len(pickle.dumps(plain))


def test_replace_keeps_the_plan_compact_and_plans_compare_by_fields() -> None:
    plan = _real_local_plan()
    replaced = dataclasses.replace(plan, storage_data="prefix", usable=False)
    assert isinstance(replaced, CompactSavePlan)
    received = pickle.loads(pickle.dumps(replaced))
    assert received.storage_data == "prefix" and received.usable is False
    plain = SavePlan(plan.items, plan.storage_data, plan.planner_data, plan.usable)
    assert plan == plain and plain == plan and replaced != plain
    assert compact(plan) is plan


def test_unknown_plan_fields_fall_back_to_plain_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, load_plan = SavePlan([], planner_data={"rank": 0}), LoadPlan([])
    monkeypatch.setattr(_plan_wire, "_SUPPORTED", False)
    assert compact(plan) is plan and compact(load_plan) is load_plan


def test_a_damaged_flat_list_is_refused() -> None:
    with pytest.raises(ValueError, match=f"holds 10 fields, not a multiple of {FIELDS_PER_ITEM}"):
        _plan_wire._open([None] * 10, None, None, True)


_PROPS = [
    TensorProperties(dtype=torch.float32),
    TensorProperties(dtype=torch.bfloat16, requires_grad=True),
    TensorProperties(dtype=torch.int64, pin_memory=True),
]


@st.composite
def write_items(draw: st.DrawFn) -> WriteItem:
    fqn = draw(st.text(min_size=1, max_size=12))
    hint = draw(st.none() | st.integers(0, 1000))
    if draw(st.booleans()):
        bio = draw(st.none() | st.builds(BytesIOWriteData, st.integers(0, 1 << 40)))
        return WriteItem(MetadataIndex(fqn, None, hint), WriteItemType.BYTE_IO, bio)
    shape = draw(st.lists(st.integers(0, 64), min_size=0, max_size=4))
    # DCP's planners build torch.Size; a custom planner may leave plain tuples, which must stay tuples
    as_size = draw(st.sampled_from([torch.Size, tuple]))
    offsets = as_size(draw(st.integers(0, 1 << 20)) for _ in shape)
    size = as_size(o + s for o, s in zip(offsets, shape))
    chunk = ChunkStorageMetadata(offsets, as_size(shape))
    kind = draw(st.sampled_from([WriteItemType.TENSOR, WriteItemType.SHARD]))
    td = TensorWriteData(chunk, draw(st.sampled_from(_PROPS)), size)
    index = draw(
        st.sampled_from(["chunk's", "none", "other"]).map(
            lambda which: (
                MetadataIndex(fqn, offsets, hint)
                if which == "chunk's"
                else MetadataIndex(fqn, None, hint)
                if which == "none"
                else MetadataIndex(fqn, torch.Size([o + 1 for o in offsets]), hint)
            )
        )
    )
    bio = draw(st.none() | st.builds(BytesIOWriteData, st.integers(0, 99)))  # allowed, if odd, on tensors
    return WriteItem(index, kind, bio, td)


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(write_items(), max_size=30),
    storage_data=st.none() | st.text(max_size=5),
    planner_data=st.none() | st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    usable=st.booleans(),
)
def test_any_plan_crosses_unchanged(items: list[WriteItem], storage_data: Any, planner_data: Any, usable: bool) -> None:
    plain = SavePlan(items, storage_data, planner_data, usable)
    received = pickle.loads(pickle.dumps(compact(plain)))
    assert type(received) is SavePlan
    assert _fields(received) == _fields(pickle.loads(pickle.dumps(plain)))


def _real_load_plan(folder: str) -> LoadPlan:
    """Rank 0's local load plan at TP=2 of a TP=4 checkpoint (resharded reads) with an object."""
    state = {f"layers.{i}.w": torch.arange(32.0).reshape(8, 4) * i for i in range(200)}
    planners = [ParallelSavePlanner(ParallelLayout(tp=4), {"*.w": ShardSpec(0)}, rank=r) for r in range(4)]

    sim_save(
        [{"model": {k: v.chunk(4)[r].clone() for k, v in state.items()}, "step": 3} for r in range(4)],
        planners,
        [FsspecStorageWriter(folder, sync_files=False) for _ in range(4)],
    )
    metadata = FsspecStorageReader(folder).read_metadata()
    planner = ParallelLoadPlanner(ParallelLayout(tp=2), {"*.w": ShardSpec(0)}, rank=0)
    dest = {"model": {k: torch.empty(4, 4) for k in state}, "step": 0}
    planner.set_up_planner(dest, metadata, is_coordinator=False)
    return planner.create_local_plan()


def test_a_real_load_plan_crosses_as_the_same_plan_with_fewer_objects(tmp_path: Any) -> None:
    plan = _real_load_plan(str(tmp_path / "ck"))
    assert isinstance(plan, CompactLoadPlan)
    assert {it.type for it in plan.items} == {LoadItemType.TENSOR, LoadItemType.BYTE_IO}
    plain = LoadPlan(plan.items, plan.storage_data, plan.planner_data)
    compact_objects, received = tracked_objects_made(lambda: pickle.loads(pickle.dumps(plan)))
    plain_objects, expected = tracked_objects_made(lambda: pickle.loads(pickle.dumps(plain)))
    assert type(received) is LoadPlan
    assert _read_fields(received) == _read_fields(expected) == _read_fields(plain)
    n = len(plan.items)
    assert n >= 400 and plain_objects > 10 * n  # a __dict__ per dataclass per item ...
    assert compact_objects < 4 * n or not INLINE_VALUES  # ... none here, and equal sizes and offsets shared
    plan.items = plan.items[::-1]  # the reader sorts a plan's items in place: it stays compact
    assert isinstance(pickle.loads(pickle.dumps(plan)), LoadPlan) and plan == LoadPlan(
        plain.items[::-1], None, plain.planner_data
    )


def test_a_damaged_flat_read_list_is_refused() -> None:
    with pytest.raises(ValueError, match=f"holds 11 fields, not a multiple of {FIELDS_PER_READ}"):
        _plan_wire._open_load([None] * 11, None, None)


@st.composite
def read_items(draw: st.DrawFn) -> ReadItem:
    def index() -> MetadataIndex:
        offset = draw(st.none() | st.lists(st.integers(0, 9), max_size=2).map(torch.Size))
        made = MetadataIndex(draw(st.sampled_from(["a", "b.c"])), offset, draw(st.none() | st.integers(0, 2)))
        if offset is not None and draw(st.booleans()):
            # a custom planner's plain tuple (MetadataIndex would make it a torch.Size): it must stay one
            object.__setattr__(made, "offset", tuple(offset))
        return made

    def size() -> torch.Size:
        return torch.Size(draw(st.lists(st.integers(0, 99), max_size=3)))

    dest = index()
    src = dest if draw(st.booleans()) else index()
    kind = draw(st.sampled_from([LoadItemType.TENSOR, LoadItemType.BYTE_IO]))
    return ReadItem(kind, dest, size(), src, size(), size())


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(read_items(), max_size=30),
    planner_data=st.none() | st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
def test_any_load_plan_crosses_unchanged(items: list[ReadItem], planner_data: Any) -> None:
    plain = LoadPlan(items, None, planner_data)
    received = pickle.loads(pickle.dumps(compact(plain)))
    assert type(received) is LoadPlan
    assert _read_fields(received) == _read_fields(pickle.loads(pickle.dumps(plain)))


def test_the_coordinator_scatters_compact_plans(tmp_path: Any) -> None:
    """Both halves: the gathered local plans and the scattered global ones (the first one included,
    which the save planner replaces once more to carry the layout record)."""
    layout = ParallelLayout(tp=2)
    state = {f"layers.{i}.w": torch.ones(4, 8) * i for i in range(20)}
    planners = [ParallelSavePlanner(layout, {"*.w": ShardSpec(0)}, rank=r) for r in range(2)]
    local = []
    for r, planner in enumerate(planners):
        planner.set_up_planner({"model": {k: v.chunk(2)[r] for k, v in state.items()}}, is_coordinator=r == 0)
        local.append(planner.create_local_plan())
    global_plans, _ = planners[0].create_global_plan([pickle.loads(pickle.dumps(p)) for p in local])
    assert all(isinstance(p, CompactSavePlan) for p in local + global_plans)

    folder = str(tmp_path / "ck")
    sim_save(
        [{"model": {k: v.chunk(2)[r].clone() for k, v in state.items()}} for r in range(2)],
        [ParallelSavePlanner(layout, {"*.w": ShardSpec(0)}, rank=r) for r in range(2)],
        [FsspecStorageWriter(folder, sync_files=False) for _ in range(2)],
    )
    metadata = FsspecStorageReader(folder).read_metadata()
    loaders = [ParallelLoadPlanner(layout, {"*.w": ShardSpec(0)}, rank=r) for r in range(2)]
    load_local = []
    for r, planner in enumerate(loaders):
        planner.set_up_planner({"model": {k: torch.empty(2, 8) for k in state}}, metadata, is_coordinator=r == 0)
        load_local.append(planner.create_local_plan())
    load_global = loaders[0].create_global_plan([pickle.loads(pickle.dumps(p)) for p in load_local])
    assert all(isinstance(p, CompactLoadPlan) for p in load_local + load_global)


@pytest.mark.parametrize("offsets", [torch.Size([2, 0]), (2, 0), [2, 0]])
def test_a_tensor_write_item_is_the_one_the_constructors_build(offsets: Any) -> None:
    """The save planner builds its write items by position, with the chunk's own offsets in the
    index: equal to the constructors' item field for field (its offset a ``torch.Size`` whatever the
    chunk holds, no index hint), and pickled alike."""
    chunk = ChunkStorageMetadata(offsets, torch.Size([2, 3]))
    props = TensorProperties.create_from_tensor(torch.zeros(1, dtype=torch.bfloat16))
    size = torch.Size([4, 3])
    built = _plan_wire.tensor_write_item("a.b", chunk, props, size, WriteItemType.SHARD)
    want = WriteItem(
        index=MetadataIndex("a.b", offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size),
    )
    assert built == want
    assert type(built.index.offset) is torch.Size and built.index.index is None
    assert built.tensor_data is not None and built.tensor_data.chunk is chunk and built.bytes_io_data is None
    assert pickle.loads(pickle.dumps(built)) == want
