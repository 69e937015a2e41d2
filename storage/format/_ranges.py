"""Byte-range planning for reads: what each item needs, widened to checksum blocks, coalesced.

Pure functions (no I/O), property-tested against a brute-force oracle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["Need", "Fetch", "c_strides", "slice_byte_range", "coalesce"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Need(Generic[T]):
    """Bytes ``[start, end)`` of one file that ``item`` needs."""

    start: int
    end: int
    item: T


@dataclasses.dataclass(frozen=True)
class Fetch(Generic[T]):
    """One read request ``[start, end)`` serving ``needs`` (all inside it)."""

    start: int
    end: int
    needs: tuple[Need[T], ...]


def c_strides(sizes: Sequence[int]) -> list[int]:
    """Element strides of a C-contiguous (row-major) array of shape ``sizes``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides


def slice_byte_range(
    sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """Smallest contiguous byte range of a C-contiguous array of shape ``sizes`` that holds the slice
    ``offsets : offsets + lengths``. For a dim-0 slice (or any slice that is contiguous in memory)
    this is exactly the slice's bytes; for a strided slice it is the enclosing span."""
    if len(sizes) != len(offsets) or len(sizes) != len(lengths):
        raise ValueError("sizes, offsets and lengths differ in rank")
    if any(n == 0 for n in lengths):
        return (0, 0)
    strides = c_strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return (first * itemsize, (last + 1) * itemsize)


def coalesce(needs: Sequence[Need[T]], *, gap: int = 0, max_bytes: int = 64 << 20) -> list[Fetch[T]]:
    """Merge needs (sorted by offset) whose ranges overlap or lie within ``gap`` bytes, while the merged
    request stays within ``max_bytes`` (a single larger need is never split)."""
    out: list[Fetch[T]] = []
    cur: list[Need[T]] = []
    start = end = 0
    for need in sorted(needs, key=lambda n: (n.start, n.end)):
        if cur and need.start <= end + gap and (max(end, need.end) - start <= max_bytes or need.start < end):
            cur.append(need)
            end = max(end, need.end)
            continue
        if cur:
            out.append(Fetch(start, end, tuple(cur)))
        cur, start, end = [need], need.start, need.end
    if cur:
        out.append(Fetch(start, end, tuple(cur)))
    return out
