"""Pure pieces: range planning (property-tested against an oracle), block hashing, manifest I/O."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage._checksum import BlockHasher
from smpckpt.storage._ranges import Need, coalesce, slice_byte_range
from smpckpt.storage.manifest import FileRecord, Manifest, MetadataRecord


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
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=30), st.integers(0, 10), st.integers(1, 120))
def test_coalesce_covers_every_need_once(ranges: list[tuple[int, int]], gap: int, max_bytes: int) -> None:
    needs = [Need(s, s + n, i) for i, (s, n) in enumerate(ranges)]
    fetches = coalesce(needs, gap=gap, max_bytes=max_bytes)
    seen = sorted(n.item for f in fetches for n in f.needs)
    assert seen == list(range(len(needs)))
    for f in fetches:
        assert all(f.start <= n.start and n.end <= f.end for n in f.needs)
        assert f.start == min(n.start for n in f.needs) and f.end == max(n.end for n in f.needs)
    for a, b in zip(fetches, fetches[1:]):
        assert a.start <= b.start
        assert b.start >= a.end  # no two requests overlap
    # adjacent needs that fit are merged
    if fetches:
        assert len(coalesce([Need(0, 10, 0), Need(10, 20, 1)], max_bytes=100)) == 1


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=8), st.integers(1, 16))
def test_block_hasher_matches_oracle(items: list[int], block: int) -> None:
    data = bytes(range(256)) * 2
    h = BlockHasher(block)
    stream = b""
    expected_ends = []
    fill = 0
    for n in items:
        chunk = (data * 1)[: n]
        if n >= block and fill:
            expected_ends.append(len(stream))
            fill = 0
        h.start_item(n)
        # feed in uneven pieces
        h.update(memoryview(chunk[: n // 3]))
        h.update(memoryview(chunk[n // 3 :]))
        for _ in range(n):
            fill += 1
            if fill == block:
                expected_ends.append(len(stream) + 1)
                fill = 0
            stream += b"\0"
        stream = stream[: len(stream) - n] + chunk
    if fill:
        expected_ends.append(len(stream))
    ends, digests = h.finish()
    assert ends == expected_ends
    starts = [0] + ends[:-1]
    assert digests == [xxhash.xxh3_64_intdigest(stream[a:b]) for a, b in zip(starts, ends)]


def test_manifest_roundtrip_and_validation() -> None:
    rec = FileRecord("f", 10, 0, (4, 10), (1, 2**64 - 1))
    m = Manifest("abcdef0123", "partial", "raw", MetadataRecord(".metadata.abcdef0123", 5, 7), (rec,), 1, "now", {"k": [1]})
    back = Manifest.from_bytes(m.to_bytes())
    assert back == m
    assert list(rec.blocks_covering(3, 5)) == [0, 1] and list(rec.blocks_covering(4, 10)) == [1]
    assert list(rec.blocks_covering(0, 4)) == [0]
    with pytest.raises(CheckpointCorrupt):
        Manifest.from_bytes(b"{not json")
    with pytest.raises(CheckpointCorrupt, match="newer"):
        Manifest.from_bytes(m.to_bytes().replace(b'"format_version": 1', b'"format_version": 99'))
    with pytest.raises(CheckpointCorrupt):
        FileRecord("f", 11, 0, (4, 10), (1, 2))
