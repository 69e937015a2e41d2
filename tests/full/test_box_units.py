"""Check units of full artifacts: as a rank reports them, and as a reader indexes them (tier 1).

A rank's write results cross the process group to the coordinator, which turns them into the
artifact's description. They are packed per box (:class:`BoxUnits`) so that thousands of units are a
handful of objects to unpickle. These tests hold the packed form to an independent reference: every
unit's box and digest as computed here from the tensor with torch slicing and xxhash. A reader keeps
a tensor's units as arrays (:class:`UnitIndex`), checked against a scan of every unit.
"""

from __future__ import annotations

import itertools
import math
import pickle
import random

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex

from smpckpt.storage.format._check_units import item_checks
from smpckpt.storage.format._reading import intersect
from smpckpt.storage.full._exchange import paste
from smpckpt.storage.full._source import FullWrite
from smpckpt.storage.full._units import BoxUnits, Unit, UnitIndex, rows_of
from smpckpt.storage.full._write import box_buffer, unit_digests


def _write(view: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> FullWrite:
    """A box of a float32 tensor of shape ``view``, laid out as stored (no permutation, no cast)."""
    return FullWrite(
        item=MetadataIndex("w"),
        file="model.safetensors",
        key="w",
        start=0,
        view=view,
        offsets=offsets,
        sizes=sizes,
        dtype=torch.float32,
        perm=tuple(range(len(view))),
        dest_offsets=(0,) * len(view),
    )


def _reference_units(box: torch.Tensor, w: FullWrite) -> list[list[object]]:
    """Each unit as ``[view, offsets, sizes, digest hex]``, found by cutting the box as documented
    (tiles of column groups x row groups for wide rows, else slices along its first dim of extent > 1)
    and hashing each piece's own bytes (row segments in row order for tiles)."""
    checks = item_checks(w.sizes, 4, 1 << 20)
    rows: list[list[object]] = []
    if checks.groups > 1:
        width = w.sizes[1] // checks.groups
        for r0 in range(0, w.sizes[0], checks.rows_per_group):
            n = min(checks.rows_per_group, w.sizes[0] - r0)
            for g in range(checks.groups):
                tile = box[r0 : r0 + n, g * width : (g + 1) * width]
                h = xxhash.xxh3_64()
                for row in tile:
                    h.update(row.contiguous().numpy().tobytes())
                offs = [w.offsets[0] + r0, w.offsets[1] + g * width, *w.offsets[2:]]
                rows.append([list(w.view), offs, [n, width, *w.sizes[2:]], f"{h.intdigest():016x}"])
        return rows
    k = next(d for d, n in enumerate(w.sizes) if n > 1)
    step = max(1, checks.unit // (math.prod(w.sizes[k + 1 :]) * 4))
    for a in range(0, w.sizes[k], step):
        part = box.narrow(k, a, min(step, w.sizes[k] - a))
        digest = xxhash.xxh3_64_intdigest(part.contiguous().numpy().tobytes())
        offs = [*w.offsets[:k], w.offsets[k] + a, *w.offsets[k + 1 :]]
        rows.append([list(w.view), offs, list(part.shape), f"{digest:016x}"])
    return rows


@pytest.mark.parametrize(
    ("view", "offsets", "sizes"),
    [
        ((64, 4096), (0, 1024), (64, 2048)),  # column shard with 8 KiB rows: tiles of column groups
        ((300, 256), (0, 64), (300, 64)),  # narrow column shard: 256 B rows, cut along dim 0
        ((5000, 16), (0, 0), (5000, 16)),  # whole tensor, many short rows: several blocks
        ((100_000,), (1000,), (50_000,)),  # 1-D: slices of itself
        ((16, 8, 512), (4, 0, 0), (8, 8, 512)),  # 3-D, 16 KiB rows: tiles over dim 1
        ((1, 45, 500), (0, 0, 0), (1, 45, 500)),  # one row, 45 columns (no even column groups): cut on dim 1
    ],
)
def test_unit_digests_match_an_independent_hash_of_each_unit(
    view: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> None:
    full = torch.arange(math.prod(view), dtype=torch.float32).reshape(view) * 0.75 - 3.0
    box = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].contiguous()
    w = _write(view, offsets, sizes)
    got = unit_digests(w, box_buffer(box, w), 1 << 20)
    assert isinstance(got, BoxUnits)
    assert got.key == "w" and got.view == view
    want = _reference_units(box, w)
    assert len(want) > 1  # each case is cut into several units
    assert rows_of([got]) == want


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 4),
    n=st.integers(0, 40),
    data=st.data(),
)
def test_box_units_survive_pickling_and_unpack_to_what_was_packed(d: int, n: int, data: st.DataObject) -> None:
    coord = st.integers(0, 2**40)
    view = tuple(data.draw(st.lists(st.integers(1, 2**31), min_size=d, max_size=d)))
    offsets = data.draw(st.lists(st.lists(coord, min_size=d, max_size=d), min_size=n, max_size=n))
    sizes = data.draw(st.lists(st.lists(coord, min_size=d, max_size=d), min_size=n, max_size=n))
    digests = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
    packed = pickle.loads(pickle.dumps(BoxUnits.pack("k", view, offsets, sizes, digests)))
    assert len(packed) == n
    assert rows_of([packed]) == [[list(view), o, s, f"{h:016x}"] for o, s, h in zip(offsets, sizes, digests)]


def test_packing_refuses_unequal_lengths_and_reading_refuses_damaged_packs() -> None:
    with pytest.raises(ValueError, match="'k': 1 offsets and 2 sizes for 2 digests"):
        BoxUnits.pack("k", (4, 4), [[0, 0]], [[1, 4], [1, 4]], [1, 2])
    good = BoxUnits.pack("k", (4, 4), [[0, 0], [1, 0]], [[1, 4], [1, 4]], [1, 2])
    with pytest.raises(ValueError, match="'k': packed units do not match their 2 digests"):
        rows_of([BoxUnits(good.key, good.view, good.offsets[:-8], good.sizes, good.digests)])


def _units_of(view: tuple[int, int], row_step: int, col_step: int) -> list[Unit]:
    """A grid of units tiling a 2-D tensor of shape ``view`` (the last ones may be shorter)."""
    return [
        Unit(view, (r, c), (min(row_step, view[0] - r), min(col_step, view[1] - c)), (r * 31 + c) % 2**64)
        for r in range(0, view[0], row_step)
        for c in range(0, view[1], col_step)
    ]


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    row_step=st.integers(1, 12),
    col_step=st.integers(1, 12),
    data=st.data(),
)
def test_an_index_parsed_from_description_rows_finds_what_a_scan_of_every_unit_finds(
    rows: int, cols: int, row_step: int, col_step: int, data: st.DataObject
) -> None:
    view = (rows, cols)
    units = _units_of(view, row_step, col_step)
    r0, c0 = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
    box = ((r0, c0), (data.draw(st.integers(1, rows - r0)), data.draw(st.integers(1, cols - c0))))
    index = UnitIndex.from_rows([[list(u.view), list(u.offsets), list(u.sizes), f"{u.digest:016x}"] for u in units])
    want = [
        (u, hit)
        for u in units
        if (hit := intersect((u.offsets, u.sizes), box)) is not None and all(n > 0 for n in hit[1])
    ]
    assert index.touched(*box) == want
    assert index.units == units and len(index) == len(units) and index.view == view


def test_description_rows_of_the_wrong_rank_are_refused_and_mixed_views_are_kept_apart() -> None:
    with pytest.raises(ValueError, match=r"check units of 2-dim view \[4, 4\] have other offsets or sizes"):
        UnitIndex.from_rows([[[4, 4], [0, 0], [2, 4], "00000000000000ff"], [[4, 4], [2], [2, 4], "0000000000000001"]])
    mixed = UnitIndex.from_rows([[[4, 4], [0, 0], [4, 4], "ff"], [[16], [0], [16], "01"]])
    assert mixed.view is None and mixed.views == {(4, 4), (16,)}
    # a reader refuses a box of a tensor checked in more than one view before it asks for overlaps
    assert mixed.units == [Unit((4, 4), (0, 0), (4, 4), 255), Unit((16,), (0,), (16,), 1)]


def _cuts(size: int, lo: int, hi: int, inner: list[int]) -> list[tuple[int, int]]:
    """Intervals cutting ``[0, size)`` at ``lo``, ``hi`` and the ``inner`` points."""
    points = sorted({0, size, lo, hi, *(p for p in inner if 0 < p < size)})
    return list(zip(points[:-1], points[1:]))


@settings(max_examples=120, deadline=None)
@given(d=st.integers(0, 4), itemsize=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_the_digests_of_units_inside_a_box_match_a_hash_of_each_units_own_bytes(
    d: int, itemsize: int, data: st.DataObject
) -> None:
    """A box read at the layout it was saved in holds its units whole; their digests are computed with
    arrays for all units at once (one slice, a slice per row, or general runs). Reference: each unit's
    bytes cut out of the tensor with torch slicing and hashed whole."""
    view = tuple(data.draw(st.lists(st.integers(1, 9), min_size=d, max_size=d)))
    lo = [data.draw(st.integers(0, v - 1)) for v in view]
    hi = [data.draw(st.integers(a + 1, v)) for a, v in zip(lo, view)]
    grids = [_cuts(v, a, b, data.draw(st.lists(st.integers(1, 8), max_size=3))) for v, a, b in zip(view, lo, hi)]
    tensor = torch.randint(0, 256, (*view, itemsize), dtype=torch.uint8, generator=torch.Generator().manual_seed(d))
    units = []
    for cell in itertools.product(*grids):
        part = tensor[tuple(slice(a, b) for a, b in cell)]
        digest = xxhash.xxh3_64_intdigest(part.contiguous().numpy().tobytes())
        units.append(Unit(view, tuple(a for a, _ in cell), tuple(b - a for a, b in cell), digest))
    index = UnitIndex(units)
    sizes = tuple(b - a for a, b in zip(lo, hi))
    whole = index.whole_inside(lo, sizes)
    assert whole is not None
    want = [
        i for i, u in enumerate(units) if all(a <= o and o + n <= b for a, b, o, n in zip(lo, hi, u.offsets, u.sizes))
    ]
    assert whole.idx.tolist() == want
    assert whole.volume() == math.prod(sizes)
    box = tensor[tuple(slice(a, b) for a, b in zip(lo, hi))].contiguous()
    got = whole.digests(memoryview(box.numpy()).cast("B"), sizes, itemsize)
    assert got == [units[i].digest for i in want]
    assert whole.first_mismatch(got) is None
    j = data.draw(st.integers(0, len(got) - 1))
    damaged = list(got)
    damaged[j] ^= 1
    assert whole.first_mismatch(damaged) == units[want[j]]


def test_a_box_cutting_a_unit_has_no_whole_units() -> None:
    index = UnitIndex([Unit((4, 4), (0, 0), (2, 4), 1), Unit((4, 4), (2, 0), (2, 4), 2)])
    assert index.whole_inside((0, 0), (2, 4)) is not None
    assert index.whole_inside((0, 0), (3, 4)) is None  # the second unit is cut
    assert index.whole_inside((0, 0), (2, 2)) is None  # a column box cuts the first
    mixed = UnitIndex([Unit((4, 4), (0, 0), (4, 4), 1), Unit((16,), (0,), (16,), 2)])
    assert mixed.whole_inside((0, 0), (4, 4)) is None  # units in several views: matched one at a time


def test_rows_of_many_boxes_equal_their_rows_one_after_another() -> None:
    """The commit converts a tensor's boxes together: same rows, same order, as box by box; boxes of
    other dimensionalities (and of none: scalars) in between; damage still named by key."""
    rng = random.Random(7)
    boxes = []
    for i in range(60):
        view = tuple(rng.randint(1, 9) for _ in range(rng.choice([0, 1, 2, 2, 3])))
        n = rng.randint(0, 4)
        offsets = [[rng.randint(0, 8) for _ in view] for _ in range(n)]
        sizes = [[rng.randint(1, 8) for _ in view] for _ in range(n)]
        boxes.append(BoxUnits.pack(f"k{i}", view, offsets, sizes, [rng.getrandbits(64) for _ in range(n)]))
    assert rows_of(boxes) == [r for b in boxes for r in rows_of([b])]
    assert rows_of([]) == []
    bad = BoxUnits(boxes[3].key, boxes[3].view, boxes[3].offsets + b"\0" * 8, boxes[3].sizes, boxes[3].digests)
    with pytest.raises(ValueError, match="'k3': packed units do not match"):
        rows_of(boxes[:3] + [bad])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), ndim=st.integers(0, 3))
def test_paste_puts_a_box_where_it_belongs_in_a_box_holding_it(data: st.DataObject, ndim: int) -> None:
    """``_exchange.paste`` (a swap's row block, an owner's assembled tensor): the sub-box's bytes land at
    their place in the holding box, every other byte untouched; against torch slicing."""
    view = tuple(data.draw(st.integers(1, 5)) for _ in range(ndim))
    hold_lo = tuple(data.draw(st.integers(0, n - 1)) for n in view)
    hold_sz = tuple(data.draw(st.integers(1, n - lo)) for n, lo in zip(view, hold_lo))
    sub_lo = tuple(lo + data.draw(st.integers(0, s - 1)) for lo, s in zip(hold_lo, hold_sz))
    sub_sz = tuple(data.draw(st.integers(1, lo + s - so)) for lo, s, so in zip(hold_lo, hold_sz, sub_lo))
    t = torch.randn(view)
    w = _write(view, sub_lo, sub_sz)
    src = t[tuple(slice(o, o + s) for o, s in zip(sub_lo, sub_sz))].contiguous().reshape(-1).view(torch.uint8).numpy()
    dst = torch.full(hold_sz, -1.0)
    expect = dst.clone()
    expect[tuple(slice(o - h, o - h + s) for o, h, s in zip(sub_lo, hold_lo, sub_sz))] = t[
        tuple(slice(o, o + s) for o, s in zip(sub_lo, sub_sz))
    ]
    raw = dst.reshape(-1).view(torch.uint8).numpy()  # dst's own memory
    paste(raw, hold_lo, hold_sz, src, w)
    assert torch.equal(dst, expect)


def test_ranks_disagreeing_on_a_tensors_dtype_alone_are_named_with_both_dtypes() -> None:
    # rev67c L2: the message printed the two equal shapes only ("(2,) vs (2,)")
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from smpckpt.errors import SpecError
    from smpckpt.storage.full._plan import _collect

    def item(offset: int, dtype: torch.dtype) -> WriteItem:
        chunk = ChunkStorageMetadata(torch.Size([offset]), torch.Size([1]))
        data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype), size=torch.Size([2]))
        return WriteItem(index=MetadataIndex("z", torch.Size([offset])), type=WriteItemType.SHARD, tensor_data=data)

    with pytest.raises(SpecError, match=r"'z'.*torch\.float32\).*torch\.bfloat16\), rank 1\)"):
        _collect([SavePlan([item(0, torch.float32)]), SavePlan([item(1, torch.bfloat16)])])
