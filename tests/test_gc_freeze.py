"""Synchronous saves and loads of the API keep the process's existing objects out of cyclic collections
(``gc.freeze``), and leave the collector as they found it: unfrozen at return (also on failure), never
touching a freeze the process made itself; async saves never freeze."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import smpckpt.api._resume
import smpckpt.api._save
from smpckpt import CheckpointExists, resume_from_checkpoint, save_checkpoint
from smpckpt._gc import gc_frozen


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    if gc.get_freeze_count():
        pytest.skip("the test process froze objects itself")
    yield
    if gc.get_freeze_count():  # leave nothing frozen for the other tests, then fail this one
        gc.unfreeze()
        pytest.fail("objects were left frozen")


def test_frozen_inside_only_and_what_existed_before() -> None:
    before = [object() for _ in range(3)]
    assert gc.get_freeze_count() == 0
    with gc_frozen():
        inside = gc.get_freeze_count()
        assert inside >= len(before)
        made = [[] for _ in range(100)]  # made inside: not frozen, collected as usual
        # "<=": a frozen object of an earlier test may die meanwhile (on another thread, too)
        assert gc.get_freeze_count() <= inside
        del made
    assert gc.get_freeze_count() == 0


def test_nested_callers_share_one_freeze_lifted_by_the_last() -> None:
    with gc_frozen():
        with gc_frozen():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the inner exit left the outer's freeze
    assert gc.get_freeze_count() == 0


def test_overlapping_threads_the_freeze_is_lifted_by_the_caller_that_made_it() -> None:
    """Another thread inside at once neither freezes again nor lifts the freeze at its exit: the caller
    that froze does, when it leaves (the package keeps no count of callers)."""
    entered, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def other() -> None:
        with gc_frozen():
            entered.set()
            release.wait(10)
        seen.append(gc.get_freeze_count())

    t = threading.Thread(target=other)
    with gc_frozen():
        t.start()
        assert entered.wait(10)
        release.set()
        t.join(10)
        assert not t.is_alive()
        assert seen[0] > 0  # the other thread's exit left this caller's freeze
    assert gc.get_freeze_count() == 0


def test_a_freeze_the_process_made_is_left_alone() -> None:
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        young = [[] for _ in range(100)]  # a second freeze would add these
        # "<=": a frozen object of an earlier test may die meanwhile (on another thread, too)
        with gc_frozen():
            assert 0 < gc.get_freeze_count() <= mine
        assert 0 < gc.get_freeze_count() <= mine  # not lifted by our exit
        del young
    finally:
        gc.unfreeze()


def test_no_freeze_while_the_collector_is_off() -> None:
    gc.disable()
    try:
        with gc_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_unfrozen_after_a_failure_inside() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with gc_frozen():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


@pytest.fixture()
def frozen_during_dcp(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(call, freeze count) at every real ``dcp.save``/``dcp.load`` the API makes (each then runs)."""
    seen: list[tuple[str, int]] = []
    # every dcp.save/dcp.load of the API (partial and full) is made by these two modules
    modules = {id(m.dcp): m.dcp for m in (smpckpt.api._save, smpckpt.api._resume)}  # one, as imported
    for dcp in modules.values():
        for name in ("save", "load"):
            real = getattr(dcp, name)

            def observed(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
                seen.append((_name, gc.get_freeze_count()))
                return _real(*a, **k)

            monkeypatch.setattr(dcp, name, observed)
    return seen


@pytest.mark.parametrize("partial", [True, False])
def test_sync_save_and_load_run_frozen_and_return_unfrozen(
    tmp_path: Any, frozen_during_dcp: list, partial: bool
) -> None:
    m = _model()
    save_checkpoint(str(tmp_path), "a", partial=partial, model=m)
    assert gc.get_freeze_count() == 0
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    resume_from_checkpoint(str(tmp_path), "a", partial=partial, model=fresh)
    assert gc.get_freeze_count() == 0
    assert [name for name, _ in frozen_during_dcp] == ["save", "load"]
    assert all(count > 0 for _, count in frozen_during_dcp), frozen_during_dcp
    for k, v in m.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_freeze_gc_false_leaves_the_collector_alone(tmp_path: Any, frozen_during_dcp: list) -> None:
    save_checkpoint(str(tmp_path), "a", model=_model(), freeze_gc=False)
    resume_from_checkpoint(str(tmp_path), "a", model=_model(), freeze_gc=False)
    assert frozen_during_dcp == [("save", 0), ("load", 0)]


def test_a_failed_save_returns_unfrozen(tmp_path: Any) -> None:
    save_checkpoint(str(tmp_path), "a", model=_model())
    with pytest.raises(CheckpointExists):
        save_checkpoint(str(tmp_path), "a", model=_model())
    assert gc.get_freeze_count() == 0


def test_an_async_save_writes_unfrozen(tmp_path: Any, frozen_during_dcp: list) -> None:
    """The background write runs beside training: garbage among training's objects must not wait."""
    fut = save_checkpoint(str(tmp_path), "a", model=_model(), async_save=True)
    assert fut is not None
    fut.result(timeout=120)
    assert frozen_during_dcp == [("save", 0)]
    assert gc.get_freeze_count() == 0


def _full_collections() -> int:
    return int(gc.get_stats()[-1]["collections"])


def test_a_full_collection_run_frozen_is_settled_once_at_exit() -> None:
    """CPython counts only the objects a frozen full collection saw, so the next whole-process one
    would fall in the caller's code soon after: the exit runs it instead, once."""
    gc.collect()  # none due on its own between here and the freeze
    start = _full_collections()
    with gc_frozen():
        gc.collect()  # stands for one the save's own objects set off
        assert _full_collections() == start + 1
    assert _full_collections() == start + 2


def test_no_collection_at_exit_when_none_ran_frozen() -> None:
    gc.collect()
    start = _full_collections()
    with gc_frozen():
        assert gc.get_freeze_count() > 0
        gc.collect(0)
    assert _full_collections() == start


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_young_garbage_is_not_frozen() -> None:
    """A cycle that is already garbage on entry is collected then, not frozen and promoted on exit to
    the oldest generation (where it would wait for a full collection)."""
    gc.collect()
    dead = weakref.ref(_Cycle())  # garbage at once: only a collection can free it
    assert dead() is not None
    with gc_frozen():
        pass
    assert dead() is None
