"""A full artifact saved without a view spec, loaded into a layout that views a tensor (tier 1).

A fused QKV saved as plain ``[3h, d]`` (a TP=1 run, or any save without ``ShardSpec(view=...)``) is
checked in units of that shape. A TP layout declaring ``ShardSpec(1, view=(3, -1, d))`` reads the same
row-major bytes as ``[3, h/tp, d]`` boxes: the reader matches units to the requested bytes byte by
byte (:func:`~smpckpt.storage.full._units.cross_view`). These tests hold that matching to a reference
built from the tensor's own bytes, and the whole load to the expected shards bit-exactly, with a
damaged byte found by the rank that reads it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import reset_dcp_caches, sim_save
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt import CheckpointCorrupt, LayoutMismatch, ParallelLayout, ShardSpec
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter, FullArtifactWriter
from smpckpt.storage.format._reading import box_runs
from smpckpt.storage.full._units import Unit, UnitIndex, cross_view

TP = 2


def _qkv(h: int, d: int) -> torch.Tensor:
    return torch.arange(3 * h * d, dtype=torch.float32).reshape(3 * h, d) * 0.5 - 11.0


def _shard(qkv: torch.Tensor, h: int, rank: int) -> torch.Tensor:
    d = qkv.shape[1]
    return qkv.view(3, h, d)[:, rank * h // TP : (rank + 1) * h // TP, :].reshape(-1, d).contiguous()


def _save_plain(folder: Path, qkv: torch.Tensor) -> None:
    reset_dcp_caches()
    sim_save(
        [{"model": {"qkv": qkv.clone()}}],
        [ParallelSavePlanner(ParallelLayout(tp=1), {}, rank=0)],
        [FullArtifactWriter(str(folder), sync_files=False)],
    )


def _load(folder: Path, h: int, d: int, rank: int) -> tuple[torch.Tensor, Any]:
    dest = {"qkv": torch.full((3 * h // TP, d), float("nan"))}
    reader = FsspecStorageReader(str(folder))
    planner = ParallelLoadPlanner(ParallelLayout(tp=TP), {"model.qkv": ShardSpec(1, view=(3, -1, d))}, rank=rank)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": dest}, storage_reader=reader, planner=planner, no_dist=True)
    return dest["qkv"], reader.last_read_stats


@pytest.mark.parametrize(
    ("h", "d", "exact"),
    [
        (256, 256, True),  # units of whole rows that meet the shard boundaries: only the shard is read
        (48, 48, False),  # units straddling the shard boundaries: read whole, shared bytes copied
        (16, 2048, True),  # 8 KiB rows: tiles of column groups
    ],
)
def test_a_plain_full_artifact_loads_into_a_viewed_tp_layout_bit_exact(
    tmp_path: Path, h: int, d: int, exact: bool
) -> None:
    qkv = _qkv(h, d)
    _save_plain(tmp_path, qkv)
    for rank in range(TP):
        got, stats = _load(tmp_path, h, d, rank)
        assert torch.equal(got, _shard(qkv, h, rank))
        needed = qkv.numel() * 4 // TP
        assert stats.bytes_needed == needed
        # a unit the shard cuts is read whole (its bytes outside the shard reported, not hidden); no
        # byte is read twice, so at most the shard and the cut units
        assert stats.bytes_read == needed if exact else needed < stats.bytes_read <= needed + 3 * (16 << 10)


@pytest.mark.parametrize("mode", ["full", "partial"])
def test_a_save_under_a_view_loads_into_a_plain_model_and_a_transpose_is_refused(tmp_path: Path, mode: str) -> None:
    """The reverse: saved by a TP layout viewing the QKV (stored and checked as ``[3, h, d]``; a full
    artifact's file holds ``[3h, d]``), loaded into a model without specs (inference, or resuming at
    TP=1), whose ``[3h, d]`` is the shape the save recorded from before the view: a full artifact is
    read in that shape, a partial checkpoint's chunks into the destination viewed as saved. A
    same-size shape the save never had stays a mismatch."""
    h, d = 256, 256
    qkv = _qkv(h, d)
    reset_dcp_caches()
    spec = {"model.qkv": ShardSpec(1, view=(3, -1, d))}
    sim_save(
        [{"model": {"qkv": _shard(qkv, h, r)}} for r in range(TP)],
        [ParallelSavePlanner(ParallelLayout(tp=TP), spec, rank=r) for r in range(TP)],
        [
            (FullArtifactWriter if mode == "full" else FsspecStorageWriter)(str(tmp_path), sync_files=False)
            for _ in range(TP)
        ],
    )
    for shape, fits in (((3 * h, d), True), ((d, 3 * h), False)):
        dest = {"qkv": torch.full(shape, float("nan"))}
        reader = FsspecStorageReader(str(tmp_path))
        planner = ParallelLoadPlanner(ParallelLayout(tp=1), {}, rank=0)
        with pytest.warns(UserWarning, match="single process"):
            if fits:
                dcp.load({"model": dest}, storage_reader=reader, planner=planner, no_dist=True)
            else:
                with pytest.raises(CheckpointException) as info:
                    dcp.load({"model": dest}, storage_reader=reader, planner=planner, no_dist=True)
        if fits:
            assert torch.equal(dest["qkv"], qkv)
            stats = reader.last_read_stats
            assert stats is not None and stats.bytes_read == stats.bytes_needed == qkv.numel() * 4
        else:
            (failure,) = [exc for exc, _ in info.value.failures.values()]
            assert isinstance(failure, LayoutMismatch)
            assert "holds global shape (3, 256, 256)" in str(failure) and "(256, 768)" in str(failure)


@pytest.mark.parametrize("stored", ["transposed", "other split"])
def test_a_whole_tensor_of_another_same_size_shape_is_refused_under_a_view(tmp_path: Path, stored: str) -> None:
    """A full artifact whose tensor has the model's element count but not its shape before the view (a
    transposed ``[d, 3h]``, GPT-2's Conv1D layout, or any other split of the same size) is a mismatch
    for a layout viewing it as ``[3, h/tp, d]``: only ``[3h, d]`` is the same row-major bytes. (It was
    read reshaped, silently scrambled: hunt54's whole_reshape_transposed.py.)"""
    h, d = 4, 6
    qkv = _qkv(h, d)
    _save_plain(tmp_path, qkv.t().contiguous() if stored == "transposed" else qkv.reshape(-1, 2).contiguous())
    for rank in range(TP):
        with pytest.raises(CheckpointException) as info:
            _load(tmp_path, h, d, rank)
        (failure,) = [exc for exc, _ in info.value.failures.values()]
        assert isinstance(failure, LayoutMismatch) and "model.qkv" in str(failure)
        shape = (d, 3 * h) if stored == "transposed" else (3 * h * d // 2, 2)
        assert f"holds global shape {shape}" in str(failure)


@pytest.mark.parametrize("stored", ["plain", "transposed"])
def test_a_partial_tp1_save_without_the_view_resumes_under_it_at_tp1_only(tmp_path: Path, stored: str) -> None:
    """A partial checkpoint saved at TP=1 by specs without a view for a tensor (a Llama ``mlp_bias`` model's
    ``gate_up_proj.bias`` saved ``[2I]`` before its rule ``ShardSpec(1, view=(2, -1))`` existed; a fused QKV
    ``[3h, d]``) resumes at TP=1 under the view: one whole saved chunk in the model's own shape is the same
    row-major bytes as the rank's whole piece. At TP=2 the pieces are no box of the saved shape: refused,
    naming the way out; a same-size shape the model never had (a transpose) is refused at TP=1 too."""
    h, d = 4, 6
    qkv, bias = _qkv(h, d), torch.arange(2 * 8, dtype=torch.float32) * 0.25 - 1.0
    saved = {"qkv": qkv.t().contiguous() if stored == "transposed" else qkv.clone(), "bias": bias.clone()}
    reset_dcp_caches()
    sim_save(
        [{"model": saved}],
        [ParallelSavePlanner(ParallelLayout(tp=1), {}, rank=0)],
        [FsspecStorageWriter(str(tmp_path), sync_files=False)],
    )
    specs = {"model.qkv": ShardSpec(1, view=(3, -1, d)), "model.bias": ShardSpec(1, view=(2, -1))}
    for tp, rank in ((1, 0), (2, 1)):
        dest = {"qkv": torch.full((3 * h // tp, d), float("nan")), "bias": torch.full((16 // tp,), float("nan"))}
        planner = ParallelLoadPlanner(ParallelLayout(tp=tp), specs, rank=rank)
        with pytest.warns(UserWarning, match="single process"):
            if tp == 1 and stored == "plain":
                dcp.load(
                    {"model": dest}, storage_reader=FsspecStorageReader(str(tmp_path)), planner=planner, no_dist=True
                )
                assert torch.equal(dest["qkv"], qkv) and torch.equal(dest["bias"], bias)
                continue
            with pytest.raises(CheckpointException) as info:
                dcp.load(
                    {"model": dest}, storage_reader=FsspecStorageReader(str(tmp_path)), planner=planner, no_dist=True
                )
        (failure,) = [exc for exc, _ in info.value.failures.values()]
        assert isinstance(failure, LayoutMismatch), failure
        if tp == 1:
            assert f"model.qkv: the checkpoint holds global shape {(d, 3 * h)}" in str(failure)
        else:  # the first key planned, with the way out
            assert "the checkpoint holds global shape" in str(failure) and "consolidate it first" in str(failure)
            assert "an unsharded (TP=1) resume reads into it (then save again)" in str(failure)  # rev69h L2


def _element_offset(folder: Path, row: int, col: int) -> tuple[Path, int]:
    path = folder / "model.safetensors"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    entry = header["model.qkv"]
    return path, 8 + n + entry["data_offsets"][0] + (row * entry["shape"][1] + col) * 4


def test_a_damaged_byte_is_found_by_the_rank_that_reads_it(tmp_path: Path) -> None:
    h, d = 256, 256
    qkv = _qkv(h, d)
    _save_plain(tmp_path, qkv)
    # the middle of rank 1's rows of k (view [3, h, d]: k is [h, 2h) of the plain rows)
    path, offset = _element_offset(tmp_path, row=h + 3 * h // 4, col=5)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))
    with pytest.raises(CheckpointException) as info:
        _load(tmp_path, h, d, 1)
    (failure,) = [exc for exc, _ in info.value.failures.values()]
    assert isinstance(failure, CheckpointCorrupt)
    assert "checksum mismatch in tensor 'model.qkv'" in str(failure)
    got, _ = _load(tmp_path, h, d, 0)  # rank 0 never reads those rows
    assert torch.equal(got, _shard(qkv, h, 0))


@settings(max_examples=150, deadline=None)
@given(
    a=st.integers(1, 4),
    b=st.integers(1, 9),
    c=st.integers(1, 6),
    itemsize=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
def test_cross_view_matches_every_requested_byte_to_the_unit_that_checks_it(
    a: int, b: int, c: int, itemsize: int, data: st.DataObject
) -> None:
    """Units tile a tensor checked as ``[a*b, c]``; a box of its view ``[a, b, c]`` is requested. The
    matching must cover each requested byte exactly once, hash each inside unit over exactly its own
    bytes, and copy a partial unit's shared bytes to where they belong."""
    checked, asked = (a * b, c), (a, b, c)
    rows = sorted({0, a * b, *data.draw(st.lists(st.integers(1, max(1, a * b - 1)), max_size=4))})
    cols = sorted({0, c, *data.draw(st.lists(st.integers(1, max(1, c - 1)), max_size=2))})
    raw = np.random.default_rng(a * 100 + b * 10 + c).integers(0, 256, a * b * c * itemsize, dtype=np.uint8)
    grid = raw.reshape(a * b, c * itemsize)
    units = []
    for r0, r1 in zip(rows[:-1], rows[1:]):
        for c0, c1 in zip(cols[:-1], cols[1:]):
            digest = xxhash.xxh3_64_intdigest(grid[r0:r1, c0 * itemsize : c1 * itemsize].tobytes())
            units.append(Unit(checked, (r0, c0), (r1 - r0, c1 - c0), digest))
    lo = [data.draw(st.integers(0, n - 1)) for n in asked]
    sizes = tuple(data.draw(st.integers(1, n - o)) for o, n in zip(lo, asked))
    starts, run = box_runs(asked, lo, sizes, itemsize)
    want = b"".join(raw[s : s + run].tobytes() for s in starts.tolist())  # the box's bytes, back to back
    plan = cross_view(UnitIndex(units), starts, run, itemsize)
    assert plan.covered == len(want)
    hits = np.zeros(len(want), dtype=np.int64)
    for u, parts in plan.inside:
        assert xxhash.xxh3_64_intdigest(b"".join(want[p : p + n] for p, n in parts)) == u.digest
        for p, n in parts:
            hits[p : p + n] += 1
    out = bytearray(len(want))
    for u, ustarts, urun, copies in plan.partial:
        ubytes = b"".join(raw[s : s + urun].tobytes() for s in ustarts.tolist())
        assert xxhash.xxh3_64_intdigest(ubytes) == u.digest  # the unit's runs are its own bytes
        for src, dst, n in copies:
            out[dst : dst + n] = ubytes[src : src + n]
            assert bytes(out[dst : dst + n]) == want[dst : dst + n]
            hits[dst : dst + n] += 1
    assert (hits == 1).all()
    # read once: the direct segments and the partial units' shared bytes split the request between them
    once = np.zeros(len(want), dtype=np.int64)
    for at, p, n in plan.direct:
        assert raw[at : at + n].tobytes() == want[p : p + n]
        once[p : p + n] += 1
    for *_, copies in plan.partial:
        for _, dst, n in copies:
            once[dst : dst + n] += 1
    assert (once == 1).all()


@pytest.mark.s3
@pytest.mark.parametrize("span_limit", [None, 4096], ids=["one-span", "over-the-span-limit"])
def test_from_s3_the_bytes_read_are_the_bytes_the_gets_fetched(
    tmp_path: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, span_limit: int | None
) -> None:
    """On an object store the box and the units it cuts are fetched as one span when it fits, else
    run by run; either way the values are exact and ``bytes_read`` is what the GETs fetched."""
    from s3_env import serve_full_artifact

    h, d = 48, 48
    qkv = _qkv(h, d)
    _save_plain(tmp_path, qkv)
    bucket = "smpckpt-full-views"
    opts, gets = serve_full_artifact(monkeypatch, tmp_path, moto_endpoint, bucket, span_limit)
    for rank in range(TP):
        gets.clear()
        dest = {"qkv": torch.full((3 * h // TP, d), float("nan"))}
        reader = FsspecStorageReader(f"s3://{bucket}/ck", storage_options=opts)
        planner = ParallelLoadPlanner(ParallelLayout(tp=TP), {"model.qkv": ShardSpec(1, view=(3, -1, d))}, rank=rank)
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"model": dest}, storage_reader=reader, planner=planner, no_dist=True)
        assert torch.equal(dest["qkv"], _shard(qkv, h, rank))
        stats = reader.last_read_stats
        assert stats is not None and gets
        assert stats.bytes_read == sum(end - start for _, start, end in gets), (rank, stats, gets)
        assert stats.bytes_read >= stats.bytes_needed == qkv.numel() * 4 // TP
