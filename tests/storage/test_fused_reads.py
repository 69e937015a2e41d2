"""Verified local reads hash each check unit right after it is read (bytes in memory come a chunk of
whole units at a time, so the hash finds them in the CPU's cache), a cold remainder is read in one large
request and verified after, and every unit a load reads is verified exactly once whichever way its bytes
came. Tiles are hashed by gathering their row segments (``hash_rows``), equal to hashing the segments one
by one."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from damage import flip_byte
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_helpers import unwrap
from torch.distributed.checkpoint.api import CheckpointException

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter
from smpckpt.storage.format import _reading as _page_cache  # the page-cache probe lives in _reading
from smpckpt.storage.format._checksum import hash_parts, hash_rows
from smpckpt.storage.read import _fetch
from smpckpt.storage.tools import read_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20


@settings(max_examples=80, derandomize=True, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(0, 40),
    st.sampled_from([0, 1, 7, 4096, 5504, 65536, 70000]),
    st.sampled_from([0, 1, 4096]),
)
def test_hash_rows_is_the_hash_of_the_rows_one_after_another(first: int, rows: int, run: int, gap: int) -> None:
    stride = run + gap
    data = memoryview(bytes(range(256)) * (1 + (first + rows * stride + run) // 256))
    want = hash_parts(data[first + r * stride : first + r * stride + run] for r in range(rows))
    assert hash_rows(data, first, rows, run, stride) == want
    if rows:
        with pytest.raises(ValueError, match="do not fit"):
            hash_rows(data[: first + (rows - 1) * stride + run - 1], first, rows, run, stride)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "blocks": torch.randn(2048, 1024, generator=g),  # 8 MiB, rows of 4 KiB: blocks of 128 KiB
        "tiled": torch.randn(512, 4096, generator=g),  # 8 MiB, rows of 16 KiB: tiles of 4 x 4 KiB
        "small": torch.randn(300, generator=g),
    }


def _saved(tmp_path: Any) -> tuple[str, dict[str, torch.Tensor], str]:
    sd = _state()
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=FsspecStorageWriter(path, thread_count=1))
    (data,) = [os.path.join(path, f) for f in os.listdir(path) if os.path.getsize(os.path.join(path, f)) > 8 * MiB]
    return path, sd, data


def _load(path: str, sd: dict[str, torch.Tensor], **kw: Any) -> dict[str, torch.Tensor]:
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(dest, storage_reader=FsspecStorageReader(path, **kw))
    return dest


class _Spy:
    """Records every ``preadv`` (offset, bytes asked, flags) and every unit digest (first byte, rows)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[int, int, int]] = []
        self.units: Counter[int] = Counter()
        preadv, digest = os.preadv, _fetch.Landing.digest

        def spy_preadv(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            self.reads.append((offset, sum(len(b) for b in buffers), flags[0] if flags else 0))
            return preadv(fd, buffers, offset, *flags)

        def spy_digest(land: Any, first: int, rows: int, run: int, stride: int) -> int:
            self.units[first] += 1
            return digest(land, first, rows, run, stride)

        monkeypatch.setattr(os, "preadv", spy_preadv)
        monkeypatch.setattr(_fetch.Landing, "digest", spy_digest)


def _chunk_bound(path: str) -> int:
    """The largest read of a fused chunk: :data:`_fetch.FUSE_BYTES`, or a whole tiled row group."""
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    return max([_fetch.FUSE_BYTES, *(t.group_bytes for t in rec.tilings)])


def _unit_firsts(path: str) -> Counter[int]:
    """Every unit of the big data file, by its first byte, once."""
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    return Counter(_fetch.unit_rows(rec, i)[0] for i in range(len(rec.block_ends)))


def test_a_load_from_memory_reads_unit_chunks_and_verifies_every_unit_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sd, _ = _saved(tmp_path)
    spy = _Spy(monkeypatch)
    dest = _load(path, sd)
    monkeypatch.undo()
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    big = [n for _, n, _ in spy.reads if n > 64 << 10]
    # no read larger than a chunk of whole units (a tiled row group, 32 rows of 16 KiB here, is one)
    assert big and max(big) <= _chunk_bound(path), spy.reads
    # every unit of the big file checked, each exactly once
    units = _unit_firsts(path)
    assert {k: spy.units[k] for k in units} == dict(units)


@pytest.mark.parametrize("cached_chunks", [0, 1, 3])
def test_a_cold_remainder_is_one_request_and_is_verified(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, cached_chunks: int
) -> None:
    path, sd, data = _saved(tmp_path)
    real = _fetch.pread_cached
    seen = [0]

    def cold_after(fd: int, views: Any, offset: int, dev: int) -> int:
        """The first ``cached_chunks`` chunks of each request are in memory, then half a chunk, then none."""
        seen[0] += 1
        if seen[0] <= cached_chunks:
            return real(fd, views, offset, dev)
        if seen[0] == cached_chunks + 1:
            half = sum(len(v) for v in views) // 2
            return real(fd, _fetch.Landing([(0, v) for v in views]).views(0, half), offset, dev)
        return 0

    monkeypatch.setattr(_fetch, "pread_cached", cold_after)
    spy = _Spy(monkeypatch)
    dest = _load(path, sd, thread_count=1)
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    units = _unit_firsts(path)
    assert {k: spy.units[k] for k in units} == dict(units)
    # after the first chunk not (wholly) in memory, the rest of that request is one blocking read
    blocking = [n for _, n, flags in spy.reads if not flags]
    assert blocking and max(blocking) >= 8 * MiB - _fetch.FUSE_BYTES, spy.reads

    # a damaged byte near the end of the file (inside the remainder read at once) is still caught
    flip_byte(data, os.path.getsize(data) - 5000)
    seen[0] = 0
    with pytest.raises(CheckpointException) as info:
        _load(path, sd, thread_count=1)
    assert isinstance(unwrap(info.value), CheckpointCorrupt) and "checksum mismatch" in str(unwrap(info.value))


@pytest.mark.parametrize("memory", [True, False])
def test_where_the_page_cache_cannot_be_asked(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, memory: bool) -> None:
    """tmpfs (memory) reads in unit chunks; other filesystems that cannot tell (NFS, FUSE) in one request."""
    path, sd, data = _saved(tmp_path)
    monkeypatch.setattr(_fetch, "pread_cached", lambda *a: _page_cache.NOT_SUPPORTED)
    monkeypatch.setattr(_fetch, "in_memory", lambda dev: memory)
    spy = _Spy(monkeypatch)
    dest = _load(path, sd)
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    sizes = [n for _, n, _ in spy.reads]
    assert (max(sizes) <= _chunk_bound(path)) == memory, sizes
    units = _unit_firsts(path)
    assert {k: spy.units[k] for k in units} == dict(units)
    flip_byte(data, 3 * MiB + 17)
    with pytest.raises(CheckpointException) as info:
        _load(path, sd)
    assert isinstance(unwrap(info.value), CheckpointCorrupt)


def test_page_cache_probe_on_a_real_file(tmp_path: Any) -> None:
    f = tmp_path / "f"
    f.write_bytes(os.urandom(256 << 10))
    fd = os.open(str(f), os.O_RDONLY)
    try:
        dev = os.fstat(fd).st_dev
        buf = bytearray(64 << 10)
        got = _page_cache.pread_cached(fd, [memoryview(buf)], 0, dev)
        if got == _page_cache.NOT_SUPPORTED:
            pytest.skip("this filesystem cannot read without waiting (RWF_NOWAIT)")
        assert got == len(buf) and bytes(buf) == f.read_bytes()[: len(buf)]  # just written: in memory
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cold = _page_cache.pread_cached(fd, [memoryview(buf)], 128 << 10, dev)
        assert 0 <= cold <= len(buf)  # 0 where the drop worked; never an error, never a wait
    finally:
        os.close(fd)
    if os.path.isdir("/dev/shm"):
        assert _page_cache.in_memory(os.stat("/dev/shm").st_dev)


def test_chunks_carry_each_units_geometry_in_file_order(tmp_path: Any) -> None:
    """The fused read's chunks walk the tilings alongside the block list: every unit of a widened range
    comes once, in order, with the geometry ``unit_rows`` gives it, and each chunk holds all its units'
    bytes."""
    path, _, _ = _saved(tmp_path)
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    assert rec.tilings, "the state must save a tiled tensor"
    t = rec.tilings[0]
    ranges = [
        (0, rec.size),
        (t.start, t.end),
        rec.widen(t.start + 5000, t.end - 70000),
        rec.widen(3 * MiB + 1, rec.size),
    ]
    for lo, hi in ranges:
        chunks = list(_fetch._chunks(rec, lo, hi))
        assert chunks[0][0] == lo and chunks[-1][1] == hi
        assert all(chunks[k][1] == chunks[k + 1][0] for k in range(len(chunks) - 1))
        n = _fetch.UNIT_FIELDS
        got = [tuple(units[k : k + n]) for _, _, units in chunks for k in range(0, len(units), n)]
        assert got == [(i, *_fetch.unit_rows(rec, i)) for i in rec.blocks_covering(lo, hi)], (lo, hi)
        for a, b, units in chunks:
            for _, first, rows, run, stride in (units[k : k + n] for k in range(0, len(units), n)):
                assert a <= first and first + (rows - 1) * stride + run <= b


@pytest.mark.parametrize("key", ["blocks", "tiled"])
def test_a_flipped_byte_in_memory_is_refused_naming_its_unit_and_key(tmp_path: Any, key: str) -> None:
    """A warm (fused) load refuses a damaged block or tile, naming the unit's kind and the key."""
    path, sd, data = _saved(tmp_path)
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    t = rec.tilings[0]
    # a byte in the tiled tensor's third row group, second column group; or in the middle of the blocks
    where = t.start + 2 * t.group_bytes + 5 * t.row_bytes + t.segment + 3 if key == "tiled" else None
    if where is None:
        where = next(
            rec.block_start(i) + 100
            for i in range(len(rec.block_ends))
            if rec.tiling_at(rec.block_start(i)) is None and rec.block_ends[i] - rec.block_start(i) >= 64 << 10
        )
    _load(path, sd)  # the file is in the page cache: every chunk is read and verified fused
    flip_byte(data, where)
    with pytest.raises(CheckpointException) as info:
        _load(path, sd, thread_count=1)
    err = unwrap(info.value)
    assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err), err
    assert f"'{key}'" in str(err) and (("a tile," in str(err)) == (key == "tiled")), err
