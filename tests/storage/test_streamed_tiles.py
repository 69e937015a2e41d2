"""A verified warm read of a long tiled row group (its tiles' rows run to the group's end, so a fused
chunk holds the whole group: 1-8 MiB) goes in requests of ``STREAM_BYTES``, each tile's digest fed the
rows of each request as it arrives (``_fetch._read_streamed``), so the hash finds them in the CPU's cache;
the digests are those of the whole tiles, a damaged byte anywhere is refused naming its tile and key, and a
part not in memory sends the rest to one blocking request, verified after."""

from __future__ import annotations

import os
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
from smpckpt.storage.format._checksum import hash_rows, streaming_hash
from smpckpt.storage.read import _fetch
from smpckpt.storage.tools import read_manifest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KiB, MiB = 1 << 10, 1 << 20


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    st.integers(0, 50),
    st.integers(1, 12),
    st.sampled_from([1, 7, 512, 4096, 70000]),
    st.sampled_from([0, 3, 4096]),
    st.lists(st.integers(1, 90000), min_size=0, max_size=6),
    st.lists(st.integers(1, 200000), min_size=0, max_size=2),
)
def test_a_unit_fed_request_by_request_has_the_digest_of_the_whole(
    first: int, rows: int, run: int, gap: int, requests: list[int], splits: list[int]
) -> None:
    """``_feed`` over consecutive requests ``[p, q)`` (any cuts, through a run or between runs) gives the
    unit's ``hash_rows`` digest, whether the bytes lie in one buffer or across several (a destination and
    a widened head's scratch buffer)."""
    stride = run + gap
    end = first + (rows - 1) * stride + run
    data = memoryview(bytes((i * 131 + 7) % 251 for i in range(end + 5)))
    want = hash_rows(data, first, rows, run, stride)
    cuts = sorted({c for c in splits if 0 < c < len(data)})
    bounds = [0, *cuts, len(data)]
    land = _fetch.Landing([(a, data[a:b]) for a, b in zip(bounds, bounds[1:])])
    h = streaming_hash()
    p = 0
    for n in [*requests, len(data)]:
        q = min(len(data), p + n)
        _fetch._feed(h, land, first, rows, run, stride, p, q)
        p = q
        if p == len(data):
            break
    assert h.intdigest() == want


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "narrow": torch.randn(1024, 4096, generator=g),  # rows of 16 KiB: 4 tiles of 4 KiB, groups of 1 MiB
        "wide": torch.randn(64, 65536, generator=g),  # rows of 256 KiB: 8 tiles of 32 KiB, groups of 2 MiB
        "long": torch.randn(16, 1 << 18, generator=g),  # rows of 1 MiB: 8 tiles of 128 KiB, groups of 2 MiB
        "blocks": torch.randn(4 * MiB // 4, generator=g),  # 1-D: blocks, chunks of FUSE_BYTES
    }


def _saved(tmp_path: Any) -> tuple[str, dict[str, torch.Tensor], str]:
    sd = _state()
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=FsspecStorageWriter(path, thread_count=1))
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    assert sum(t.group_bytes > _fetch.STREAM_ABOVE for t in rec.tilings) == 3, rec.tilings
    return path, sd, os.path.join(path, rec.name)


def _load(path: str, sd: dict[str, torch.Tensor], **kw: Any) -> dict[str, torch.Tensor]:
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(dest, storage_reader=FsspecStorageReader(path, **kw))
    return dest


def _spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every ``preadv``: (offset, bytes asked, flags)."""
    reads: list[tuple[int, int, int]] = []
    preadv = os.preadv

    def spy(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        reads.append((offset, sum(len(b) for b in buffers), flags[0] if flags else 0))
        return preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", spy)
    return reads


def _tile_byte(path: str, key_index: int, group: int, row: int, col_group: int, at: int) -> int:
    """A byte of the ``key_index``-th tiling of the big file: row group ``group``, row ``row`` in it,
    column group ``col_group``, ``at`` bytes into its segment."""
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    t = rec.tilings[key_index]
    return t.start + group * t.group_bytes + row * t.row_bytes + col_group * t.segment + at


def test_a_warm_load_streams_long_row_groups_and_refuses_a_damaged_tile(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sd, data = _saved(tmp_path)
    fd = os.open(data, os.O_RDONLY)
    try:
        if _fetch.pread_cached(fd, [memoryview(bytearray(1))], 0, os.fstat(fd).st_dev) == _fetch.NOT_SUPPORTED:
            pytest.skip("this filesystem cannot read without waiting (RWF_NOWAIT)")
    finally:
        os.close(fd)
    _load(path, sd)  # in the page cache now
    reads = _spy_reads(monkeypatch)
    dest = _load(path, sd, thread_count=2)
    monkeypatch.undo()
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    asked = [n for _, n, flags in reads if flags]
    assert asked and max(asked) <= _fetch.STREAM_BYTES, sorted(set(asked))
    # damaged bytes: in a tile's first request, in its second (a row past the first STREAM_BYTES of
    # the group), and in the last tile of a group whose rows are longer than a request
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    order = {t.row_bytes: k for k, t in enumerate(rec.tilings)}
    cases = [
        (order[16 * KiB], 0, 3, 1, 100),
        (order[16 * KiB], 1, 40, 2, 4095),
        (order[256 * KiB], 1, 5, 3, 7),
        (order[1 * MiB], 0, 1, 7, 128 * KiB - 1),
    ]
    for k, group, row, col, at in cases:
        where = _tile_byte(path, k, group, row, col, at)
        flip_byte(data, where)
        with pytest.raises(CheckpointException) as info:
            _load(path, sd, thread_count=1)
        err = unwrap(info.value)
        assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err) and "tile of" in str(err), err
        flip_byte(data, where)  # repaired
    dest = _load(path, sd)
    assert all(torch.equal(dest[k], v) for k, v in sd.items())


@pytest.mark.parametrize("cached", [0, 1, 3])
def test_a_cold_part_of_a_streamed_group_sends_the_rest_to_one_request(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, cached: int
) -> None:
    """The first ``cached`` requests of each read find their bytes in memory, the next half of its
    bytes, then none: the rest of that read is one blocking request, every byte loads bit-exactly, and a
    damaged byte in the part read blocking is still refused."""
    path, sd, data = _saved(tmp_path)
    real = _fetch.pread_cached
    seen = [0]

    def cold_after(fd: int, views: Any, offset: int, dev: int) -> int:
        seen[0] += 1
        if seen[0] <= cached:
            return real(fd, views, offset, dev)
        if seen[0] == cached + 1:
            half = sum(len(v) for v in views) // 2
            return real(fd, _fetch.Landing([(0, v) for v in views]).views(0, half), offset, dev)
        return 0

    monkeypatch.setattr(_fetch, "pread_cached", cold_after)
    reads = _spy_reads(monkeypatch)
    dest = _load(path, sd, thread_count=1)
    for k, v in sd.items():
        assert torch.equal(dest[k], v), k
    assert [n for _, n, flags in reads if not flags], reads  # the rest, blocking
    assert max(n for _, n, flags in reads if flags) <= _fetch.STREAM_BYTES, reads  # streamed while in memory
    rec = max(read_manifest(path).files, key=lambda f: f.size)
    long = [k for k, t in enumerate(rec.tilings) if t.row_bytes == MiB][0]
    where = _tile_byte(path, long, 1, 1, 6, 5)
    flip_byte(data, where)
    seen[0] = 0
    with pytest.raises(CheckpointException) as info:
        _load(path, sd, thread_count=1)
    err = unwrap(info.value)
    assert isinstance(err, CheckpointCorrupt) and "checksum mismatch" in str(err), err
