"""A simulated world: N ranks in one process, driven through the phases dcp.save / dcp.load run.

Mirrors ``torch.distributed.checkpoint.state_dict_saver._save_state_dict`` and ``..._loader`` (torch
2.13): the same calls in the same order, with keyword arguments as DCP passes them, and plans pickled
on their way to and from the coordinator (as ``gather_object``/``scatter_object_list`` do), so a plan
that only works because ranks share objects in memory fails here too. Fast enough for hypothesis to
try many layouts a minute.
"""

from __future__ import annotations

import gc
import inspect
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

__all__ = [
    "sim_save",
    "sim_load",
    "load_shards_and_check",
    "MemoryStore",
    "MemoryWriter",
    "MemoryReader",
    "reset_dcp_caches",
]


def reset_dcp_caches() -> None:
    """DCP keeps class-level plan caches; clear them so one example cannot leak into the next."""
    for name in (
        "_cached_save_plan",
        "_cached_final_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
    ):
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.clear()


def _wire(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


def _accepts_kwargs(fn: Callable[..., Any]) -> bool:
    return "kwargs" in inspect.signature(fn).parameters


def sim_save(
    state_dicts: Sequence[dict[str, Any]],
    planners: Sequence[SavePlanner],
    writers: Sequence[StorageWriter],
) -> Metadata:
    world = len(state_dicts)
    plans: list[SavePlan] = []
    for rank in range(world):
        writer, planner = writers[rank], planners[rank]
        storage_meta = writer.storage_meta()
        planner.set_up_planner(state_dict=state_dicts[rank], storage_meta=storage_meta, is_coordinator=rank == 0)
        if _accepts_kwargs(writer.set_up_storage_writer):
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        else:
            writer.set_up_storage_writer(rank == 0)
        plan = planner.create_local_plan()
        plans.append(_wire(writer.prepare_local_plan(plan)))
    global_plans, metadata = planners[0].create_global_plan(plans)
    global_plans = _wire(writers[0].prepare_global_plan(global_plans))
    results = []
    for rank in range(world):
        final = planners[rank].finish_plan(global_plans[rank])
        results.append(_wire(writers[rank].write_data(final, planners[rank]).wait()))
    writers[0].finish(metadata=metadata, results=results)
    return metadata


def sim_load(
    state_dicts: Sequence[dict[str, Any]],
    planners: Sequence[LoadPlanner],
    readers: Sequence[StorageReader],
) -> None:
    world = len(state_dicts)
    plans: list[LoadPlan] = []
    for rank in range(world):
        reader, planner = readers[rank], planners[rank]
        metadata = reader.read_metadata()
        planner.set_up_planner(state_dicts[rank], metadata, rank == 0)
        if _accepts_kwargs(reader.set_up_storage_reader):
            reader.set_up_storage_reader(metadata, rank == 0, rank=rank, use_collectives=True)
        else:
            reader.set_up_storage_reader(metadata, rank == 0)
        plan = planner.create_local_plan()
        plans.append(_wire(reader.prepare_local_plan(plan)))
    global_plans = planners[0].create_global_plan(plans)
    global_plans = _wire(readers[0].prepare_global_plan(global_plans))
    for rank in range(world):
        final = planners[rank].finish_plan(global_plans[rank])
        readers[rank].read_data(final, planners[rank]).wait()


def load_shards_and_check(
    folder: str, shards: Sequence[dict[str, torch.Tensor]], specs: Any, optional: Sequence[str] = ()
) -> None:
    """Load a checkpoint folder saved at TP ``len(shards)`` under ``"model"`` into zeroed tensors shaped
    like each rank's ``shards``, through our planner and reader, and check every tensor bit-exact
    (``optional``: the planner's globs of keys that may be left out, e.g. ``user_content``)."""
    from smpckpt import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner
    from smpckpt.storage import FsspecStorageReader

    tp = len(shards)
    dests = [{"model": {k: torch.zeros_like(v) for k, v in mine.items()}} for mine in shards]
    sim_load(
        dests,
        [ParallelLoadPlanner(ParallelLayout(tp=tp), specs, rank=r, optional=optional) for r in range(tp)],
        [FsspecStorageReader(folder) for _ in range(tp)],
    )
    for r, mine in enumerate(shards):
        for k, v in mine.items():
            if not torch.equal(dests[r]["model"][k], v):
                raise AssertionError(f"rank {r}: {k} differs after the load")


class MemoryStore:
    """What a simulated checkpoint holds: chunk copies by index, object bytes, metadata."""

    def __init__(self) -> None:
        self.chunks: dict[MetadataIndex, torch.Tensor] = {}
        self.objects: dict[str, bytes] = {}
        self.metadata: Metadata | None = None
        self.bytes_written: dict[int, int] = {}


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class MemoryWriter(StorageWriter):
    """Minimal in-memory StorageWriter: one per rank, all sharing a MemoryStore."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.rank = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue()
                self.store.objects[item.index.fqn] = raw
                size = len(raw)
            else:
                tensor = data.detach().clone()
                if tuple(tensor.shape) != tuple(item.tensor_data.chunk.sizes):
                    raise AssertionError(
                        f"{item.index}: resolved {tuple(tensor.shape)}, chunk {item.tensor_data.chunk}"
                    )
                if item.index in self.store.chunks:
                    raise AssertionError(f"{item.index} written twice")
                self.store.chunks[item.index] = tensor
                size = tensor.numel() * tensor.element_size()
            self.store.bytes_written[self.rank] = self.store.bytes_written.get(self.rank, 0) + size
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.store.metadata = _wire(metadata)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class MemoryReader(StorageReader):
    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.bytes_read = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.store.metadata is None:
            raise FileNotFoundError("no checkpoint in this MemoryStore")
        return _wire(self.store.metadata)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self.store.objects[item.storage_index.fqn]))
                continue
            saved = self.store.chunks[item.storage_index]
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                saved = saved.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != saved.size():
                raise AssertionError(f"{item.storage_index}: target {target.size()} vs stored {saved.size()}")
            target.copy_(saved)
            self.bytes_read += saved.numel() * saved.element_size()
            planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def tracked_objects_made(fn: Callable[[], Any]) -> tuple[int, Any]:
    """How many objects the cyclic collector tracks after ``fn()`` that it did not before (each one the
    next full collection walks), and ``fn``'s value; the collector is off meanwhile."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        value = fn()
        return len(gc.get_objects()) - before, value
    finally:
        gc.enable()
