"""Pure pieces: range planning (property-tested against an oracle), block hashing, manifest I/O."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage.format._check_units import Tiling
from smpckpt.storage.format._checksum import BlockHasher
from smpckpt.storage.format._reading import Need, coalesce, cpu_bytes, slice_byte_range
from smpckpt.storage.format._staging import MIN_STAGING_BYTES, Stages
from smpckpt.storage.format.manifest import FileRecord, Manifest, MetadataRecord
from smpckpt.storage.read._plan import raw_item, writable_bytes
from smpckpt.storage.read._run import _decode_raw
from smpckpt.storage.write.writer import write_file


@st.composite
def slices(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    sizes = draw(st.lists(st.integers(1, 6), min_size=0, max_size=4))
    offsets = [draw(st.integers(0, s - 1)) for s in sizes]
    lengths = [draw(st.integers(1, s - o)) for s, o in zip(sizes, offsets)]
    return sizes, offsets, lengths


@settings(max_examples=200, derandomize=True, deadline=None)
@given(slices(), st.sampled_from([1, 2, 4]))
def test_slice_byte_range_matches_oracle(s: tuple[list[int], list[int], list[int]], itemsize: int) -> None:
    sizes, offsets, lengths = s
    idx = np.arange(int(np.prod(sizes)) if sizes else 1).reshape(sizes)
    sub = idx[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    lo, hi = slice_byte_range(sizes, offsets, lengths, itemsize)
    assert lo == int(sub.min()) * itemsize and hi == (int(sub.max()) + 1) * itemsize
    if sub.size * itemsize == hi - lo:  # contiguous slices read exactly their bytes
        assert np.array_equal(sub.reshape(-1), np.arange(lo // itemsize, hi // itemsize))


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=30), st.integers(0, 10), st.integers(1, 120)
)
def test_coalesce_covers_every_need_once(ranges: list[tuple[int, int]], gap: int, max_bytes: int) -> None:
    needs = [Need(s, s + n, i) for i, (s, n) in enumerate(ranges)]
    fetches = coalesce(needs, gap=gap, max_bytes=max_bytes)
    seen = sorted(n.item for f in fetches for n in f.needs)
    assert seen == list(range(len(needs)))
    for f in fetches:
        assert all(f.start <= n.start and n.end <= f.end for n in f.needs)
        assert f.start == min(n.start for n in f.needs) and f.end == max(n.end for n in f.needs)
    for f in fetches:
        # inside a request, every need (in offset order) overlaps what came before it, or lies within
        # ``gap`` bytes of it and keeps the request within max_bytes (only overlaps may exceed it)
        ordered = sorted(f.needs, key=lambda n: (n.start, n.end))
        assert list(f.needs) == ordered
        end = ordered[0].end
        for n in ordered[1:]:
            assert n.start < end or (n.start <= end + gap and max(end, n.end) - f.start <= max_bytes), (f, n)
            end = max(end, n.end)
    for a, b in zip(fetches, fetches[1:]):
        assert a.start <= b.start
        assert b.start >= a.end  # no two requests overlap
        # maximal: b's first need could not have joined a (too far away, or a would grow past max_bytes)
        first = b.needs[0]
        assert first.start > a.end + gap or max(a.end, first.end) - a.start > max_bytes, (a, b)


@pytest.mark.parametrize(
    ("needs", "gap", "max_bytes", "expected"),
    [
        ([(0, 10), (10, 20)], 0, 100, [(0, 20, [0, 1])]),  # adjacent and fitting: merged
        ([(10, 20), (0, 10)], 0, 100, [(0, 20, [1, 0])]),  # given out of order: sorted by offset
        ([(0, 10), (15, 20)], 4, 100, [(0, 10, [0]), (15, 20, [1])]),  # 5 bytes apart > gap 4
        ([(0, 10), (15, 20)], 5, 100, [(0, 20, [0, 1])]),  # within the gap
        ([(0, 10), (10, 20)], 0, 15, [(0, 10, [0]), (10, 20, [1])]),  # merging would exceed max_bytes
        ([(0, 10), (5, 30)], 0, 15, [(0, 30, [0, 1])]),  # overlapping needs always share a request
        ([(0, 100)], 0, 10, [(0, 100, [0])]),  # a need larger than max_bytes is never split
        ([], 0, 10, []),
    ],
)
def test_coalesce_examples(
    needs: list[tuple[int, int]], gap: int, max_bytes: int, expected: list[tuple[int, int, list[int]]]
) -> None:
    got = coalesce([Need(a, b, i) for i, (a, b) in enumerate(needs)], gap=gap, max_bytes=max_bytes)
    assert [(f.start, f.end, [n.item for n in f.needs]) for f in got] == expected


def _oracle_block_ends(item_sizes: list[int], block: int) -> list[int]:
    """Block end offsets from the documented rule alone, by a walk over the file's byte positions: a block
    ends after ``block`` bytes, just before the first byte of any item of at least ``block`` bytes (unless
    that byte already starts a block), and at the end of the file."""
    total = sum(item_sizes)
    large_starts: set[int] = set()
    pos = 0
    for n in item_sizes:
        if n >= block:
            large_starts.add(pos)
        pos += n
    ends: list[int] = []
    block_start = 0
    for p in range(1, total + 1):  # p: the offset just after a byte
        if p - block_start == block or p == total or (p in large_starts and p > block_start):
            ends.append(p)
            block_start = p
    return ends


@st.composite
def hasher_feeds(draw: st.DrawFn) -> tuple[int, list[bytes], list[list[int]]]:
    block = draw(st.integers(1, 16))
    items = draw(st.lists(st.binary(min_size=0, max_size=50), max_size=8))
    # each item is fed in pieces cut at drawn offsets (sorted, duplicates give empty updates)
    cuts = [sorted(draw(st.lists(st.integers(0, len(b)), max_size=4))) for b in items]
    return block, items, cuts


@settings(max_examples=300, derandomize=True, deadline=None)
@given(hasher_feeds())
def test_block_hasher_matches_oracle(feed: tuple[int, list[bytes], list[list[int]]]) -> None:
    block, items, cuts = feed
    h = BlockHasher(block)
    for data, item_cuts in zip(items, cuts, strict=True):
        h.start_item(len(data))
        bounds = [0, *item_cuts, len(data)]
        for a, b in zip(bounds, bounds[1:]):
            h.update(memoryview(data[a:b]))
    stream = b"".join(items)
    ends, digests = h.finish()
    expected_ends = _oracle_block_ends([len(b) for b in items], block)
    assert ends == expected_ends
    assert len(digests) == len(expected_ends)
    starts = [0, *expected_ends[:-1]] if expected_ends else []
    assert digests == [xxhash.xxh3_64_intdigest(stream[a:b]) for a, b in zip(starts, expected_ends, strict=True)]


def test_block_hasher_example() -> None:
    """Block 4, items of 3, 4, 2, 1 and 9 bytes: cuts before the 4- and 9-byte items, else every 4 bytes."""
    items = [b"abc", b"defg", b"hi", b"j", b"klmnopqrs"]
    h = BlockHasher(4)
    for data in items:
        h.start_item(len(data))
        h.update(memoryview(data))
    ends, digests = h.finish()
    assert ends == [3, 7, 10, 14, 18, 19]
    blocks = [b"abc", b"defg", b"hij", b"klmn", b"opqr", b"s"]
    assert digests == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    assert _oracle_block_ends([3, 4, 2, 1, 9], 4) == ends  # the oracle agrees on the worked example
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        BlockHasher(0)


def test_manifest_roundtrip_and_validation() -> None:
    rec = FileRecord("f", 10, 0, (4, 10), (1, 2**64 - 1))
    m = Manifest(
        "abcdef0123", "partial", "raw", MetadataRecord(".metadata.abcdef0123", 5, 7), (rec,), 1, "now", {"k": [1]}
    )
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m
    assert list(rec.blocks_covering(3, 5)) == [0, 1] and list(rec.blocks_covering(4, 10)) == [1]
    assert list(rec.blocks_covering(0, 4)) == [0]
    with pytest.raises(CheckpointCorrupt, match="^manifest is malformed: Expecting property name"):
        Manifest.from_bytes(b"{not json")
    with pytest.raises(CheckpointCorrupt, match="newer"):
        Manifest.from_bytes(m.to_bytes().replace(b'"format_version": 1', b'"format_version": 99'))
    with pytest.raises(CheckpointCorrupt, match="^manifest entry f: blocks do not cover the file size 11$"):
        FileRecord("f", 11, 0, (4, 10), (1, 2))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12))
def test_block_ends_must_rise_strictly_from_zero(steps: list[int]) -> None:
    ends = tuple(int(x) for x in np.cumsum(steps))
    if all(s > 0 for s in steps):
        assert FileRecord("f", ends[-1], 0, ends, (7,) * len(ends)).block_ends == ends
    else:  # an empty block (a step of 0), the first one included
        with pytest.raises(CheckpointCorrupt, match="manifest entry f: block ends are not increasing"):
            FileRecord("f", ends[-1], 0, ends, (7,) * len(ends))


@settings(max_examples=100, deadline=None)
@given(
    start=st.integers(0, 1000),
    groups=st.sampled_from([2, 4, 8]),
    segment=st.integers(1, 64),
    rows=st.integers(1, 40),
    rows_per_group=st.integers(1, 16),
)
def test_tile_ends_are_each_row_groups_column_groups_in_order(
    start: int, groups: int, segment: int, rows: int, rows_per_group: int
) -> None:
    row_bytes = groups * segment
    t = Tiling(start, start + rows * row_bytes, row_bytes, groups, rows_per_group)
    want = []
    for r0 in range(0, rows, rows_per_group):
        n = min(rows_per_group, rows - r0)
        first = start + r0 * row_bytes
        want += [first + (g + 1) * n * segment for g in range(groups)]
    assert t.tile_ends() == want
    assert len(want) == t.tiles and want[-1] == t.end


def _reference_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5,
        lambda: (torch.arange(12, dtype=torch.float32) - 3).to(torch.bfloat16),  # no numpy dtype
        lambda: torch.arange(6, dtype=torch.float16).reshape(2, 3),
        lambda: torch.tensor([True, False, True]),
        lambda: torch.arange(5, dtype=torch.int64) - 2,
        lambda: torch.ones(2, 3, requires_grad=True) * 1.5,  # needs detach
        lambda: torch.arange(20, dtype=torch.float32).reshape(4, 5)[:, 1:3],  # not contiguous
        lambda: torch.arange(20, dtype=torch.int32).reshape(4, 5).t(),  # transposed
        lambda: torch.tensor(2.5),  # 0-dim
        lambda: torch.empty(0, 4),
        lambda: torch.empty(0, dtype=torch.bfloat16),
    ],
)
@pytest.mark.parametrize("stand_in", [False, True])
def test_a_raw_record_is_the_tensors_own_bytes_in_row_major_order(
    make: Any, stand_in: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written in place or staged (strided views; every tensor under the CPU stand-in of the device
    stage), a raw record holds the tensor's values, row-major, and nothing else."""
    if stand_in:
        monkeypatch.setenv("SMPCKPT_TEST_DEVICE", "cpu")
    t = make()

    class _Sink:
        path, borrows = "mem", False

        def __init__(self) -> None:
            self.data = bytearray()

        def write(self, data: memoryview) -> None:
            self.data += data

        def commit(self) -> None: ...

        def abort(self) -> None: ...

    class _Planner:
        def resolve_data(self, item: WriteItem) -> torch.Tensor:
            return t

    sink, stages = _Sink(), Stages(MIN_STAGING_BYTES)
    try:
        item = WriteItem(index=MetadataIndex("t"), type=WriteItemType.TENSOR)
        results = write_file(sink, "f", [item], _Planner(), 0, raw=True, block_size=1 << 20, stages=stages)  # type: ignore[arg-type]
    finally:
        stages.close()
    info = results[0].storage_data
    assert (info.offset, info.length) == (0, len(sink.data))
    assert bytes(sink.data) == _reference_bytes(t)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]))
def test_a_destination_takes_stored_bytes_as_they_are_exactly_when_the_general_decode_agrees(
    data: st.DataObject, dtype: torch.dtype
) -> None:
    """Where the reader copies stored bytes straight into a destination's memory, they are what the
    general decode gives, bit for bit; a slice that is not one run in the file is never taken so."""
    sizes = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in sizes)
    lengths = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(sizes, offsets))
    chunk = (torch.arange(math.prod(sizes), dtype=torch.int64).reshape(sizes) * 37 % 11).to(dtype)
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("t"),
        dest_offsets=torch.Size([0] * len(sizes)),
        storage_index=MetadataIndex("t"),
        storage_offsets=torch.Size(offsets),
        lengths=torch.Size(lengths),
    )
    it = raw_item(req, "f", 0, chunk.numel() * chunk.element_size(), dtype, sizes)
    stored = chunk.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()[it.start :]
    want = chunk[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    assert torch.equal(_decode_raw(it, memoryview(stored)), want)
    target = torch.full(lengths, 3).to(dtype)
    dst = writable_bytes(it, target)
    one_run = want.numel() * want.element_size() == it.end - it.start
    assert (dst is not None) == one_run
    if dst is not None:
        dst[:] = memoryview(stored)[: dst.nbytes]
        assert torch.equal(target, want)


def test_cpu_bytes_views_contiguous_cpu_tensors_and_declines_the_rest() -> None:
    for t in (torch.arange(6, dtype=torch.float32), torch.ones(2, 3, dtype=torch.bfloat16), torch.empty(0)):
        mv = cpu_bytes(t)
        assert mv is not None and not mv.readonly and bytes(mv) == _reference_bytes(t)
        mv[:] = bytes(mv.nbytes)  # a view over the tensor's own memory, not a copy
        assert not t.any()
    for t in (torch.ones(4, 4)[:, :2], torch.ones(3, requires_grad=True), torch.ones(2, dtype=torch.cfloat).conj()):
        assert cpu_bytes(t) is None
