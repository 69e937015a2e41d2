"""Our hooks pause the cyclic garbage collector for their bulk work (tier 1, simulated world).

A save or load of thousands of tensors makes objects by the ten thousand in these hooks, and every
collection that sets off walks every object of the process: at 2,700 tensors per rank and 4 ranks,
four full collections took 0.75 of a 2 s save. Inside the hooks no collection starts before their
end (the allocations count once, when the collector resumes: one young collection at most per call);
afterwards the collector is as the caller left it, also when a hook fails.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sim import load_shards_and_check, reset_dcp_caches, sim_save

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.errors import CheckpointExists
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

TP = 2
TENSORS = 1500
#: the hooks that do bulk work (unpaused, each set off 4-68 collections per call in this test;
#: read_data pauses for its planning only, its I/O runs with the collector on)
HOOKS = [
    (ParallelSavePlanner, "create_local_plan"),
    (ParallelSavePlanner, "create_global_plan"),
    (FsspecStorageWriter, "finish"),
    (FsspecStorageReader, "read_metadata"),
    (FsspecStorageReader, "set_up_storage_reader"),
    (FsspecStorageReader, "read_data"),
    (ParallelLoadPlanner, "set_up_planner"),
    (ParallelLoadPlanner, "create_local_plan"),
]


def _globals() -> dict[str, torch.Tensor]:
    return {f"layer{i}.w": torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + i for i in range(TENSORS)}


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(TP, dim=0)[rank].clone()


SPECS = {"model.*": ShardSpec(0)}


@pytest.fixture()
def collections_per_call(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """(hook, collections started during the call) for every call of the hooks, wrapped from outside
    so that a pause inside them shows."""
    calls: list[tuple[str, int]] = []
    started = [0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] += 1

    for cls, name in HOOKS:
        real = getattr(cls, name)

        def wrapped(*args: Any, __real: Any = real, __name: str = f"{cls.__name__}.{name}", **kw: Any) -> Any:
            before = started[0]
            try:
                return __real(*args, **kw)
            finally:
                calls.append((__name, started[0] - before))

        monkeypatch.setattr(cls, name, functools.wraps(real)(wrapped))
    gc.callbacks.append(on_gc)
    try:
        yield calls
    finally:
        gc.callbacks.remove(on_gc)


def _save(folder: Path) -> None:
    layout = ParallelLayout(tp=TP)
    g = _globals()
    sim_save(
        [{"model": {k: _shard(v, r) for k, v in g.items()}} for r in range(TP)],
        [ParallelSavePlanner(layout, SPECS, rank=r) for r in range(TP)],
        [FsspecStorageWriter(str(folder), sync_files=False) for _ in range(TP)],
    )


def test_at_most_one_collection_per_hook_call_in_a_large_save_and_load(
    tmp_path: Path, collections_per_call: list[tuple[str, int]]
) -> None:
    reset_dcp_caches()
    gc.collect()
    _save(tmp_path)
    g = _globals()
    load_shards_and_check(str(tmp_path), [{k: _shard(v, r) for k, v in g.items()} for r in range(TP)], SPECS)
    # paused, the hook's allocations are counted once, when the collector resumes at its end: one
    # young collection at most (unpaused, a hook of this save set off several per call)
    assert {name for name, _ in collections_per_call} == {f"{c.__name__}.{n}" for c, n in HOOKS}
    assert [(name, n) for name, n in collections_per_call if n > 1] == []
    assert gc.isenabled()


def test_the_collector_is_left_as_the_caller_had_it_also_when_a_hook_fails(tmp_path: Path) -> None:
    reset_dcp_caches()
    _save(tmp_path)
    with pytest.raises(CheckpointExists):  # a second save to a committed folder, without overwrite
        _save(tmp_path)
    assert gc.isenabled()
    gc.disable()
    try:
        reader = FsspecStorageReader(str(tmp_path))
        reader.read_metadata()
        assert not gc.isenabled()  # a caller's own pause is not ended by ours
    finally:
        gc.enable()
