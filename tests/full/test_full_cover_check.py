"""The full export's coverage check (storage/full/_plan.py ``_collect``): every tensor's chunks must cover it
exactly once, at any chunk count. It used to test overlaps pairwise only up to 64 chunks; above that (TP8 x
ZeRO DP16 = 128) only the element count was compared, so an overlap plus an equal-sized hole passed silently
(the hole would be zeros in the artifact)."""

from __future__ import annotations

import time

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from smpckpt.errors import SpecError
from smpckpt.storage.full._plan import _collect

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _plans(shape: tuple[int, ...], boxes: list[Box], ranks: int = 4) -> list[SavePlan]:
    """One tensor ``w`` of ``shape`` whose chunks are ``boxes``, dealt round-robin to ``ranks`` plans."""
    items: list[list[WriteItem]] = [[] for _ in range(ranks)]
    for i, (off, size) in enumerate(boxes):
        td = TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(shape),
        )
        items[i % ranks].append(
            WriteItem(index=MetadataIndex("w", torch.Size(off)), type=WriteItemType.SHARD, tensor_data=td)
        )
    return [SavePlan(it) for it in items]


def _grid(rows: int, cols: int, rh: int, cw: int) -> list[Box]:
    return [((r * rh, c * cw), (rh, cw)) for r in range(rows) for c in range(cols)]


def test_128_chunks_one_overlap_one_equal_hole_is_refused() -> None:
    # TP8 x DP16 = 128 row ranges of 4 rows; chunk 5 starts one row early (overlapping chunk 4 by 4x8
    # elements) and chunk 100 loses its last row: the element count still matches.
    boxes: list[Box] = [((4 * i, 0), (4, 8)) for i in range(128)]
    boxes[5] = ((19, 0), (4, 8))  # rows 19..22: overlaps chunk 4 (rows 16..19) on row 19, leaves row 23 a hole
    assert sum(s[0] * s[1] for _, s in boxes) == 512 * 8
    with pytest.raises(SpecError, match=r"'w': shards at offsets .* overlap"):
        _collect(_plans((512, 8), boxes))


def test_overlap_in_the_inner_dimension_among_many_chunks_is_refused() -> None:
    boxes = _grid(16, 8, 2, 4)  # 128 chunks of 2x4 over 32x32
    (r, c), (h, w) = boxes[77]
    boxes[77] = ((r, c - 1), (h, w))  # one column left: overlaps its neighbour, leaves a 2x1 hole
    with pytest.raises(SpecError, match="overlap"):
        _collect(_plans((32, 32), boxes))


def test_a_chunk_outside_the_shape_is_refused() -> None:
    boxes = _grid(16, 8, 2, 4)
    boxes[127] = ((30, 29), (2, 4))  # shifted past the last column: in count, out of bounds, leaves a hole
    with pytest.raises(SpecError, match="outside"):
        _collect(_plans((32, 32), boxes))


def test_exact_covers_pass_and_stay_cheap_at_1024_chunks() -> None:
    covers: list[tuple[tuple[int, ...], list[Box]]] = [
        ((4096,), [((4 * i,), (4,)) for i in range(1024)]),  # ZeRO flat ranges
        ((256, 256), _grid(128, 8, 2, 32)),  # TP8 columns x DP128 row ranges
        ((256, 256), _grid(8, 128, 32, 2)),
        ((2, 64, 64), [((k, r * 4, c * 8), (1, 4, 8)) for k in range(2) for r in range(16) for c in range(8)]),
    ]
    # TP8 column blocks, each cut into 128 row ranges at its own (ragged) boundaries
    ragged: list[Box] = []
    for c in range(8):
        cuts = sorted({0, 1024} | {(i * 7 + c * 13) % 1024 for i in range(1, 400)})[:128] + [1024]
        cuts = sorted(set(cuts))
        ragged += [((a, c * 16), (b - a, 16)) for a, b in zip(cuts, cuts[1:])]
    covers.append(((1024, 128), ragged))
    t = time.perf_counter()
    for shape, boxes in covers:
        shapes, _, _ = _collect(_plans(shape, boxes))
        assert shapes == {"w": shape}
    # 1024-chunk covers: a pairwise check would be ~2.6M box intersections; the sweep is a few ms each
    assert time.perf_counter() - t < 5.0


def test_the_sweep_agrees_with_pairwise_intersection_on_random_boxes() -> None:
    # random small 1-3-D boxes (many overlapping, some empty): the sweep must name an overlap exactly when
    # some pair intersects (the pairwise check it replaces, kept as the oracle)
    import random

    from smpckpt.storage.format._reading import intersect
    from smpckpt.storage.full._plan import _first_overlap

    rng = random.Random(73)
    seen = {True: 0, False: 0}
    for _ in range(600):
        nd = rng.randint(1, 3)
        shape = [rng.randint(1, 6) for _ in range(nd)]
        boxes: list[Box] = []
        for _ in range(rng.randint(1, 6)):
            off = tuple(rng.randint(0, d - 1) for d in shape)
            boxes.append((off, tuple(rng.randint(0, d - o) for o, d in zip(off, shape))))
        want = any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1 :])
        pair = _first_overlap(boxes, 0)
        assert (pair is not None) == want, boxes
        if pair is not None:
            assert intersect(pair[0], pair[1]) is not None
        seen[want] += 1
    assert min(seen.values()) > 100
