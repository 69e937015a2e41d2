"""Shared by the readers and writers of this format: the byte accounting a read reports, byte-range
planning (pure: what each item needs, widened to checksum blocks, coalesced; property-tested against a
brute-force oracle) and a CPU tensor's bytes without a copy.

Each torch call drops and retakes the GIL, a queue per call with a thread per file, so
:func:`cpu_bytes` turns a tensor of a numpy dtype into bytes with one torch call (``numpy()``); other
dtypes (bfloat16, float8) take ``view(torch.uint8)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch

__all__ = ["ReadStats", "Need", "Fetch", "c_strides", "slice_byte_range", "coalesce", "cpu_bytes"]


def cpu_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of ``t`` (row-major) as a flat ``"B"`` memoryview over its own memory, for a contiguous
    CPU tensor that needs no grad (not a conjugate or negative view); ``None`` otherwise."""
    try:
        arr = t.numpy()
    except (TypeError, RuntimeError):  # no numpy dtype, or a tensor numpy cannot share
        if t.device.type != "cpu" or t.requires_grad or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        try:
            return memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))
        except (RuntimeError, TypeError, ValueError):
            return None
    if not arr.flags.c_contiguous:
        return None
    return memoryview(cast(Any, arr.reshape(-1).view(np.uint8)))


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
    """Smallest contiguous byte range of a C-contiguous array of shape ``sizes`` holding the slice
    ``offsets : offsets + lengths``: exactly its bytes when contiguous, else the enclosing span."""
    if len(sizes) != len(offsets) or len(sizes) != len(lengths):
        raise ValueError("sizes, offsets and lengths differ in rank")
    if any(n == 0 for n in lengths):
        return (0, 0)
    strides = c_strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    return (first * itemsize, (last + 1) * itemsize)


def coalesce(needs: Sequence[Need[T]], *, gap: int = 0, max_bytes: int = 64 << 20) -> list[Fetch[T]]:
    """Merge needs (sorted) that overlap or lie within ``gap`` bytes while within ``max_bytes`` (never split)."""
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


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """Byte accounting of the last ``read_data`` on this rank (``reader.last_read_stats``).

    * ``bytes_needed``: bytes the destinations receive (a column slice counts its elements, not its rows);
      an object its record.
    * ``bytes_requested``: the lengths of this reader's read requests (``preadv`` calls, ranged GETs):
      beyond ``bytes_needed``, bytes read only to verify a check unit and the gaps a merged request reads.
      A page-cache hit counts, read-ahead does not.
    * ``requests``: read requests as planned (a coalesced range, a batch of direct pieces, a row or merged
      run of rows of a column slice, an object GET); a streamed column slice counts each large request.
    * ``items``: the plan's read items.
    * ``per_file``: file name -> (bytes needed, bytes requested), for every file the load touched.
    * ``device_bytes``: bytes the kernel read from block devices during the call (``/proc/self/io``,
      the whole process; read-ahead in, page-cache hits out); ``None`` where not reported or not local."""

    bytes_needed: int
    bytes_requested: int
    requests: int
    items: int
    per_file: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    device_bytes: int | None = None

    @property
    def bytes_read(self) -> int:
        """``bytes_requested`` (its earlier name)."""
        return self.bytes_requested

    @property
    def amplification(self) -> float:
        """``bytes_requested / bytes_needed`` (1.0 when nothing was needed)."""
        return self.bytes_requested / self.bytes_needed if self.bytes_needed else 1.0

    @property
    def device_amplification(self) -> float | None:
        """``device_bytes / bytes_needed``, where ``device_bytes`` is known."""
        if self.device_bytes is None:
            return None
        return self.device_bytes / self.bytes_needed if self.bytes_needed else 1.0
