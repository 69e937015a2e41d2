"""What crosses ranks after the write (storage/write/_base.py), tier 1: a simulated world.

DCP unpickles every rank's write results on the coordinator and the Metadata on every rank, in its own
code, with the cyclic collector running. Each object those unpickles make is one the next full
collection walks, so we count them (``gc.get_objects()``: the objects the collector tracks), and check
that packing changes nothing a save writes or a load reads.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import sim
import torch
from sim import load_shards_and_check, reset_dcp_caches, sim_save, tracked_objects_made
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt import ParallelLayout, ShardSpec
from smpckpt.errors import CheckpointError, UnsafeCheckpoint
from smpckpt.planners import ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.storage.format._safe_pickle import load_metadata
from smpckpt.storage.write import _base
from smpckpt.storage.write._base import CommittedMetadata, CommittedView, PackedResults, open_results, pack_results

TP = 2
TENSORS = 400
SPECS = {"model.*": ShardSpec(0)}
_REAL_WIRE = sim._wire  # the simulated world's transport (a pickle round trip), before any wrapping


def _globals() -> dict[str, torch.Tensor]:
    return {f"layer{i}.w": torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) * (i + 1) for i in range(TENSORS)}


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(TP, dim=0)[rank].clone()


def _save(folder: Path, monkeypatch: pytest.MonkeyPatch, *, crossing: bool) -> tuple[Metadata, list[Any]]:
    """A TP=2 save in the simulated world, as if results and Metadata crossed ranks (``crossing``);
    returns what ``dcp.save`` would return and every rank's write results as the gather sends them."""
    monkeypatch.setattr(_base, "crosses_ranks", lambda group: crossing)
    sent: list[Any] = []

    def recording_wire(obj: Any) -> Any:
        if isinstance(obj, list) and obj and isinstance(obj[0], WriteResult):
            sent.append(obj)
        return _REAL_WIRE(obj)

    monkeypatch.setattr(sim, "_wire", recording_wire)
    reset_dcp_caches()
    g = _globals()
    md = sim_save(
        [{"model": {k: _shard(v, r) for k, v in g.items()}} for r in range(TP)],
        [ParallelSavePlanner(ParallelLayout(tp=TP), SPECS, rank=r) for r in range(TP)],
        [FsspecStorageWriter(str(folder), sync_files=False) for _ in range(TP)],
    )
    return md, sent


def _load(folder: Path) -> None:
    g = _globals()
    load_shards_and_check(str(folder), [{k: _shard(v, r) for k, v in g.items()} for r in range(TP)], SPECS)


def test_packed_results_and_lean_metadata_cross_ranks_as_a_few_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    md, sent = _save(tmp_path / "packed", monkeypatch, crossing=True)
    _load(tmp_path / "packed")
    plain_md, plain_sent = _save(tmp_path / "plain", monkeypatch, crossing=False)
    _load(tmp_path / "plain")

    # the coordinator's gather: one result per rank, one pickle inside it
    assert len(sent) == TP and all(len(r) == 1 and isinstance(r[0].storage_data, PackedResults) for r in sent)
    packed_objects, _ = tracked_objects_made(lambda: pickle.loads(pickle.dumps(sent)))
    plain_objects, _ = tracked_objects_made(lambda: pickle.loads(pickle.dumps(plain_sent)))
    assert plain_objects > TENSORS * TP  # an object (or several) per item ...
    assert packed_objects < 10 * TP  # ... against a few per rank

    # the returned (and broadcast) Metadata: its mappings cross as the committed bytes, once, and still
    # map what was committed; the same in one process
    fields = ("state_dict_metadata", "storage_data", "planner_data")
    assert all(isinstance(getattr(m, f), CommittedView) for m in (md, plain_md) for f in fields)
    stored = FsspecStorageReader(str(tmp_path / "packed")).read_metadata()
    assert isinstance(stored.storage_data, dict)  # the file holds the plain dicts stock readers expect
    assert isinstance(stored.state_dict_metadata, dict) and isinstance(stored.planner_data, dict)
    lean_objects, received = tracked_objects_made(lambda: pickle.loads(pickle.dumps(md)))
    full_objects, _ = tracked_objects_made(lambda: pickle.loads(pickle.dumps(stored)))
    assert lean_objects < 20  # a few objects, not one per item or per tensor ...
    assert full_objects > 2 * TENSORS  # ... as the plain Metadata makes
    assert len(pickle.dumps(md)) < 1.2 * len(pickle.dumps(stored))  # the bytes travel once, not per view
    assert all(isinstance(getattr(received, f), CommittedView) for f in fields)
    assert dict(received.storage_data) == dict(stored.storage_data)
    assert dict(received.state_dict_metadata) == stored.state_dict_metadata
    assert dict(received.planner_data) == stored.planner_data
    assert len(stored.storage_data) >= TENSORS * TP

    # a Metadata a previous save left lean, handed to finish again (DCP's planner with plan caching
    # reuses the object), is written as the plain dicts the file must hold
    again, _ = FsspecStorageWriter(str(tmp_path / "again"))._metadata_bytes("s2", md)
    rewritten = load_metadata(again, where="rewritten metadata")
    assert all(isinstance(getattr(rewritten, f), dict) for f in fields)
    assert rewritten.storage_data == stored.storage_data and rewritten.planner_data == stored.planner_data


def _results(n: int, name: str) -> list[WriteResult]:
    return [
        WriteResult(MetadataIndex(f"t{i}", torch.Size([i, 0])), 16, _StorageInfo(name, 16 * i, 16, ["smpckpt.raw/1"]))
        for i in range(n)
    ]


def test_open_results_returns_every_ranks_results_packed_or_not() -> None:
    a, b = _results(5, "a"), _results(3, "b")
    opened = open_results(pickle.loads(pickle.dumps([pack_results(a), b, pack_results([])])))
    assert opened == [a, b, []]
    assert pack_results(a)[0].size_in_bytes == 5 * 16


def test_packed_results_that_do_not_hold_what_they_announce_name_the_rank() -> None:
    bad = pack_results(_results(4, "a"))
    bad = [WriteResult(bad[0].index, 64, PackedResults(bad[0].storage_data.payload, 5))]
    with pytest.raises(CheckpointError, match=r"rank 1's packed write results hold list .*expected a list of 5"):
        open_results([pack_results([]), bad])


class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo should-never-run",))


def test_committed_views_are_decoded_once_on_first_use_with_the_allow_list() -> None:
    md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("x"): _Boom()})
    # pickling and unpickling (DCP's broadcast) do not decode: a bad payload only fails when used
    lazy = pickle.loads(pickle.dumps(CommittedView(CommittedMetadata(pickle.dumps(md), "save s1"), "storage_data")))
    with pytest.raises(UnsafeCheckpoint, match="save s1.*refused"):
        len(lazy)
    good = Metadata(
        state_dict_metadata={"x": BytesStorageMetadata()},
        storage_data={MetadataIndex("x"): _StorageInfo("f", 0, 4)},
        planner_data=None,
    )
    source = CommittedMetadata(pickle.dumps(good), "save s2")
    index, chunks, planner = (CommittedView(source, f) for f in ("storage_data", "state_dict_metadata", "planner_data"))
    assert "not decoded yet" in repr(index)
    assert dict(index) == {MetadataIndex("x"): _StorageInfo("f", 0, 4)} and "1 entries" in repr(index)
    assert source.metadata() is source.metadata()  # decoded once for every view
    assert dict(chunks) == {"x": BytesStorageMetadata()} and dict(planner) == {}
    with pytest.raises(ValueError, match="no committed view of Metadata.version"):
        CommittedView(source, "version")
