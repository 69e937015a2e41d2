"""Boxes of row-major tensors and the byte runs they occupy in a file (pure functions, no I/O). A *box*
is ``(offsets, sizes)`` inside a tensor of shape ``view``: ``prod(sizes[:k])`` runs of equal length,
``k`` the innermost dimension it does not span fully, in the box's row-major order (back to back they
fill a buffer of shape ``sizes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from smpckpt.storage.format._reading import c_strides

__all__ = ["Box", "box_runs", "intersect", "split_box", "range_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_runs(
    view: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], itemsize: int
) -> tuple[np.ndarray, int]:
    """Start offsets (bytes from the tensor's first, ascending) and common length of the box's runs."""
    nd = len(view)
    if len(offsets) != nd or len(sizes) != nd:
        raise ValueError(f"box {list(offsets)}+{list(sizes)} does not match the rank of shape {list(view)}")
    for o, s, v in zip(offsets, sizes, view):
        if o < 0 or s < 0 or o + s > v:
            raise ValueError(f"box {list(offsets)}+{list(sizes)} lies outside shape {list(view)}")
    if nd == 0:
        return np.zeros(1, dtype=np.int64), itemsize
    strides = c_strides(view)
    k = nd - 1
    while k > 0 and sizes[k] == view[k]:
        k -= 1
    run = sizes[k] * strides[k] * itemsize
    base = sum(o * st for o, st in zip(offsets, strides)) * itemsize
    starts = np.full(1, base, dtype=np.int64)
    for d in range(k):
        steps = np.arange(sizes[d], dtype=np.int64) * (strides[d] * itemsize)
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    if math.prod(sizes) == 0:
        return np.zeros(0, dtype=np.int64), 0
    return starts, run


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of one shape, or ``None``."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)) and len(lo) > 0:
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def split_box(offsets: Sequence[int], sizes: Sequence[int], itemsize: int, target: int) -> list[Box]:
    """Cut a box along its outermost dimension of extent > 1 into boxes of about ``target`` bytes
    (at least one slice each). Each part's bytes are a contiguous slice of the box's row-major buffer."""
    offsets, sizes = tuple(offsets), tuple(sizes)
    k = next((d for d, s in enumerate(sizes) if s > 1), None)
    if k is None:
        return [(offsets, sizes)]
    per = math.prod(sizes[k + 1 :]) * itemsize
    step = max(1, target // per) if per else sizes[k]
    out = []
    for r in range(0, sizes[k], step):
        n = min(step, sizes[k] - r)
        out.append((offsets[:k] + (offsets[k] + r,) + offsets[k + 1 :], sizes[:k] + (n,) + sizes[k + 1 :]))
    return out


def range_boxes(sizes: Sequence[int], start: int, end: int) -> list[Box]:
    """The elements ``[start, end)`` (flat, row-major) of an array of shape ``sizes`` as boxes, in order (a
    partial row, whole rows, a partial row, each partial row cut the same way one dimension in): their
    bytes back to back are the range's, so a staged chunk of a tensor copies these boxes."""
    total = math.prod(sizes)
    if not 0 <= start <= end <= total:
        raise ValueError(f"elements {start}..{end} outside shape {list(sizes)}")
    out: list[Box] = []
    _range_boxes(tuple(sizes), (), start, end, out)
    return out


def _range_boxes(sizes: tuple[int, ...], prefix: tuple[int, ...], a: int, b: int, out: list[Box]) -> None:
    if a >= b:
        return
    rest = sizes[len(prefix) :]
    ones = (1,) * len(prefix)
    if len(rest) <= 1:
        out.append((prefix + (a,) * len(rest), ones + ((b - a,) if rest else ())))
        return
    inner = math.prod(rest[1:])
    r0, o0 = divmod(a, inner)
    r1, o1 = divmod(b, inner)
    if r0 == r1:
        _range_boxes(sizes, prefix + (r0,), o0, o1, out)
        return
    if o0:
        _range_boxes(sizes, prefix + (r0,), o0, inner, out)
        r0 += 1
    if r1 > r0:
        out.append((prefix + (r0,) + (0,) * (len(rest) - 1), ones + (r1 - r0,) + rest[1:]))
    if o1:
        _range_boxes(sizes, prefix + (r1,), 0, o1, out)
