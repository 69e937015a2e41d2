"""Shared by the readers and writers of this format: the byte accounting a read reports, byte-range
planning (pure: what each item needs, widened to checksum blocks, coalesced; property-tested against a
brute-force oracle), a CPU tensor's bytes without a copy, and boxes of row-major tensors with the byte
runs they occupy (pure). A *box* is ``(offsets, sizes)`` inside a tensor of shape ``view``:
``prod(sizes[:k])`` runs of equal length, ``k`` the innermost dimension it does not span fully, in the
box's row-major order (back to back they fill a buffer of shape ``sizes``).

Each torch call drops and retakes the GIL, a queue per call with a thread per file, so
:func:`cpu_bytes` turns a tensor of a numpy dtype into bytes with one torch call (``numpy()``); other
dtypes (bfloat16, float8) take ``view(torch.uint8)``.

Local reads that know the page cache (``RWF_NOWAIT``, tmpfs detection, ``posix_fadvise``), at the end: a
verifying reader hashes each check unit while it is still in the CPU cache, which wants unit-sized requests
when bytes are cached and a few large ones from a cold disk; ``RWF_NOWAIT`` tells them apart per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch

__all__ = ["ReadStats", "Need", "Fetch", "c_strides", "slice_byte_range", "coalesce", "cpu_bytes"]
__all__ += ["Box", "box_runs", "intersect", "split_box", "range_boxes"]
__all__ += ["pread_cached", "NOT_SUPPORTED", "in_memory", "advise_random", "device_read_bytes"]


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


#: :func:`pread_cached`'s answer where the filesystem cannot tell (tmpfs, NFS, FUSE, non-Linux)
NOT_SUPPORTED = -1

_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: filesystems whose files are memory: reading them never waits for a device
_MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


def pread_cached(fd: int, views: Sequence[memoryview], offset: int, dev: int) -> int:
    """Read file bytes at ``offset`` into ``views`` (filled in order) as far as they are in the page
    cache, without waiting for the device: the bytes read (0 when the first page is not cached; fewer
    than asked when a later one is not, or the file ends), or :data:`NOT_SUPPORTED` where the
    filesystem (``dev``: the file's ``st_dev``) cannot read so; a caller asks once per file."""
    if _RWF_NOWAIT is None:
        return NOT_SUPPORTED
    try:
        got = os.preadv(fd, views, offset, _RWF_NOWAIT)
    except BlockingIOError:
        got = 0  # EAGAIN: the first page is not in the page cache
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        return NOT_SUPPORTED
    return got


def in_memory(dev: int) -> bool:
    """Whether files on the filesystem of ``st_dev`` ``dev`` live in memory (tmpfs, ramfs), by
    ``/proc/self/mountinfo`` (about 45 us: ask once per request); ``False`` where that cannot be told."""
    return _fstype(dev) in _MEMORY_FS


def _fstype(dev: int) -> str:
    want = f"{os.major(dev)}:{os.minor(dev)}"
    with contextlib.suppress(OSError):
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw": field 3 is the device,
                # the first field after " - " the filesystem type
                fields = line.split()
                if len(fields) > 2 and fields[2] == want and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    return ""


def advise_random(fd: int, random: bool = True) -> None:
    """Read-ahead advice for this descriptor (it applies to this open file only). ``random``: none
    (``POSIX_FADV_RANDOM``), for strided and scattered reads whose gaps read-ahead would fetch for
    nothing; else a larger window (``POSIX_FADV_SEQUENTIAL``)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):  # advice only: a filesystem that refuses it reads as before
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if random else os.POSIX_FADV_SEQUENTIAL)


def device_read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage devices so far (``read_bytes`` of
    ``/proc/self/io``: every thread of the process; page-cache hits are not counted, read-ahead is), or
    ``None`` where the OS does not report it."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    return None
