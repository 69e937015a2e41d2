"""Check units of full artifacts (boxes of a tensor in some view, each with an xxh3 digest over its
row-major bytes) and the bytes a read of a box touches: its runs and the units it overlaps, read whole
(pure functions, no I/O).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from smpckpt.storage.format._checksum import hash_bytes, hash_parts, hash_rows
from smpckpt.storage.format._reading import Box, box_runs, c_strides, cpu_bytes, intersect

__all__ = ["Unit", "BoxUnits", "UnitIndex", "rows_of", "cross_view", "intervals", "unit_extent", "read_intervals"]
__all__ += ["run_intervals", "bytes_of"]


@dataclasses.dataclass(frozen=True)
class Unit:
    """A check unit of an artifact tensor: a box of it seen as ``view``, and the digest of its bytes."""

    view: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    digest: int


@dataclasses.dataclass(frozen=True)
class BoxUnits:
    """The check units a rank wrote for one box, packed for the coordinator: a handful of objects per box
    whatever its unit count (a tuple per unit set off full collections when unpickled)."""

    key: str  # the artifact key
    view: tuple[int, ...]  # the shape the units' boxes are in
    offsets: bytes  # int64, (units, len(view)), row-major
    sizes: bytes  # int64, (units, len(view))
    digests: bytes  # uint64, one per unit

    @classmethod
    def pack(
        cls,
        key: str,
        view: Sequence[int],
        offsets: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        digests: Sequence[int],
    ) -> BoxUnits:
        n, d = len(digests), len(view)
        if len(offsets) != n or len(sizes) != n:
            raise ValueError(f"{key!r}: {len(offsets)} offsets and {len(sizes)} sizes for {n} digests")
        lo = np.asarray(offsets, dtype=np.int64).reshape(n, d)
        return cls(
            key,
            tuple(view),
            lo.tobytes(),
            np.asarray(sizes, dtype=np.int64).reshape(n, d).tobytes(),
            np.asarray(digests, dtype=np.uint64).tobytes(),
        )

    def __len__(self) -> int:
        return len(self.digests) // 8

    def check(self) -> None:
        n, d = len(self), len(self.view)
        if len(self.offsets) != n * d * 8 or len(self.sizes) != n * d * 8:
            raise ValueError(f"{self.key!r}: packed units do not match their {n} digests")


def rows_of(boxes: Sequence[BoxUnits]) -> list[list[Any]]:
    """Each unit of ``boxes`` in order as ``[view, offsets, sizes, digest hex]`` lists (the description's
    form), with one array conversion per run of boxes of one dimensionality instead of three per box."""
    out: list[list[Any]] = []
    i = 0
    while i < len(boxes):
        d = len(boxes[i].view)
        j = i
        while j < len(boxes) and len(boxes[j].view) == d:
            boxes[j].check()
            j += 1
        run = boxes[i:j]
        n = sum(len(b) for b in run)
        lo = np.frombuffer(b"".join(b.offsets for b in run), dtype=np.int64).reshape(n, d).tolist()
        sz = np.frombuffer(b"".join(b.sizes for b in run), dtype=np.int64).reshape(n, d).tolist()
        digests = np.frombuffer(b"".join(b.digests for b in run), dtype=np.uint64).tolist()
        views: list[list[int]] = []
        for b in run:
            views.extend([list(b.view)] * len(b))  # one list per box, shared by its rows
        out.extend([v, o, s, f"{h:016x}"] for v, o, s, h in zip(views, lo, sz, digests))
        i = j
    return out


class UnitIndex:
    """One tensor's check units, and which of them a box touches, found with arrays: a box can meet a
    thousand units, and units as long-lived objects set off full collections. A :class:`Unit` is made
    only for a unit a read touches."""

    def __init__(self, units: Sequence[Unit]) -> None:
        units = list(units)
        views = {u.view for u in units}
        digests = [u.digest for u in units]
        if len(views) == 1:
            self._uniform(views.pop(), [u.offsets for u in units], [u.sizes for u in units], digests)
            return
        #: the views the units are checked in (one, unless the description is odd)
        self.views = frozenset(views)
        #: the view every unit is checked in, or ``None`` when they differ (then boxes are matched
        #: one unit at a time, and a read in either view reports the mismatch)
        self.view: tuple[int, ...] | None = None
        self._mixed: list[Unit] = units
        self._digests = digests

    def _uniform(self, view: tuple[int, ...], offsets: Sequence[Any], sizes: Sequence[Any], digests: list[int]) -> None:
        """Units all checked in ``view``, kept as arrays; offsets or sizes of another length raise ``ValueError``."""
        self.views, self.view, self._mixed, self._digests = frozenset([view]), view, [], digests
        shape = (len(digests), len(view))
        wrong = f"check units of {len(view)}-dim view {list(view)} have other offsets or sizes"
        try:
            lo, sz = np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64)
        except ValueError as exc:  # ragged rows
            raise ValueError(wrong) from exc
        if lo.shape != shape or sz.shape != shape:
            raise ValueError(wrong)
        self._lo, self._hi = lo, lo + sz

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Any]]) -> UnitIndex:
        """From the description's rows; a malformed row raises ``ValueError``, ``TypeError`` and the like."""
        views = {tuple(int(x) for x in r[0]) for r in rows}
        if len(views) != 1:
            ints = [[tuple(int(x) for x in r[i]) for i in range(3)] for r in rows]
            return cls([Unit(v, o, s, int(r[3], 16)) for (v, o, s), r in zip(ints, rows)])
        index = cls.__new__(cls)
        index._uniform(views.pop(), [r[1] for r in rows], [r[2] for r in rows], [int(r[3], 16) for r in rows])
        return index

    def __len__(self) -> int:
        return len(self._digests)

    def unit(self, i: int) -> Unit:
        """The unit at position ``i`` (as :meth:`meeting` numbers them)."""
        if self.view is None:
            return self._mixed[i]
        lo = tuple(self._lo[i].tolist())
        return Unit(self.view, lo, tuple(h - f for h, f in zip(self._hi[i].tolist(), lo)), self._digests[i])

    @property
    def units(self) -> list[Unit]:
        """Every unit, made now (``smpckpt verify`` walks them all; reads use :meth:`touched`)."""
        return [self.unit(i) for i in range(len(self))]

    def whole_inside(self, offsets: Sequence[int], sizes: Sequence[int]) -> WholeUnits | None:
        """The units box ``(offsets, sizes)`` overlaps, as arrays, when it holds each of them whole (any box read
        at its saved layout); ``None`` when one is cut by the box, or the units are in several views."""
        if self.view is None:
            return None
        idx, ulo, uhi = self.meeting(offsets, sizes)
        box_lo = np.asarray(offsets, dtype=np.int64)
        if not ((ulo >= box_lo).all() and (uhi <= box_lo + np.asarray(sizes, dtype=np.int64)).all()):
            return None
        return WholeUnits(self, idx, ulo - box_lo, uhi - ulo)

    def meeting(self, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(units in one view) :meth:`touched` as arrays: the positions of the units box ``(offsets, sizes)``
        overlaps, and their corners ``lo``, ``hi`` (no :class:`Unit` made)."""
        if self.view is None:
            raise ValueError("units in several views")
        box_lo = np.asarray(offsets, dtype=np.int64)
        box_hi = box_lo + np.asarray(sizes, dtype=np.int64)
        idx = np.flatnonzero((np.minimum(self._hi, box_hi) > np.maximum(self._lo, box_lo)).all(axis=1))
        return idx, self._lo[idx], self._hi[idx]

    def digest(self, i: int) -> int:
        return self._digests[i]

    def touched(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[tuple[Unit, Box]]:
        """The units box ``(offsets, sizes)`` overlaps by at least one element, with each overlap."""
        if self.view is None:
            hits = [(u, intersect((tuple(offsets), tuple(sizes)), (u.offsets, u.sizes))) for u in self._mixed]
            return [(u, box) for u, box in hits if box is not None and all(n > 0 for n in box[1])]
        idx, lo, hi = self.meeting(offsets, sizes)
        lo = np.maximum(lo, np.asarray(offsets, dtype=np.int64))
        hi = np.minimum(hi, np.asarray(offsets, dtype=np.int64) + np.asarray(sizes, dtype=np.int64))
        return [
            (self.unit(i), (tuple(f), tuple(h - a for h, a in zip(e, f))))
            for i, f, e in zip(idx.tolist(), lo.tolist(), hi.tolist())
        ]


@dataclasses.dataclass(frozen=True)
class WholeUnits:
    """Units lying wholly inside a box: ``within`` (offsets from its corner), ``sizes``, ``idx`` (positions)."""

    index: UnitIndex
    idx: np.ndarray
    within: np.ndarray
    sizes: np.ndarray

    def volume(self) -> int:
        """Elements the units cover (the box's own when they tile it)."""
        return int(self.sizes.prod(axis=1).sum()) if len(self.idx) else 0

    def digests(self, buf: memoryview, box_sizes: Sequence[int], itemsize: int) -> list[int]:
        """Each unit's xxh3 over its bytes in ``buf`` (the box's row-major bytes), for all units at once with
        arrays: a slice per unit, or a slice per row for a tile."""
        m, nd = self.sizes.shape
        if m == 0:
            return []
        if nd == 0:  # a 0-d tensor: one element, one unit
            return [hash_bytes(buf[:itemsize])] * m
        sizes_arr = np.asarray(box_sizes, dtype=np.int64)
        strides = np.asarray(c_strides(box_sizes), dtype=np.int64) * itemsize
        # k: the innermost dim a unit does not span whole (0 when it spans all inner dims); its bytes
        # are then runs of sizes[k] * strides[k] bytes, one per index of the dims before k
        cut = self.sizes != sizes_arr
        cut[:, 0] = True
        k = nd - 1 - np.argmax(cut[:, ::-1], axis=1)
        starts = (self.within * strides).sum(axis=1).tolist()
        runs = (self.sizes[np.arange(m), k] * strides[k]).tolist()
        rows = self.sizes[:, 0].tolist()
        row_stride = int(strides[0])
        out: list[int] = []
        for i, kk in enumerate(k.tolist()):
            a, n = starts[i], runs[i]
            if kk == 0:
                out.append(hash_bytes(buf[a : a + n]))
            elif kk == 1:  # a tile: its rows gathered and hashed in one call (GIL-free, see hash_rows)
                out.append(hash_rows(buf, a, rows[i], n, row_stride))
            else:
                rel, urun = box_runs(box_sizes, self.within[i].tolist(), self.sizes[i].tolist(), itemsize)
                out.append(hash_parts(buf[r : r + urun] for r in rel.tolist()))
        return out

    def first_mismatch(self, digests: Sequence[int]) -> Unit | None:
        """The first unit whose digest differs from the index's, or ``None``."""
        expected = self.index._digests
        for i, got in zip(self.idx.tolist(), digests, strict=True):
            if expected[i] != got:
                return self.index.unit(i)
        return None


@dataclasses.dataclass(frozen=True)
class CrossView:
    """How a box requested in one view of a tensor is verified by units checked in another view of the
    same bytes (a fused ``[3h, d]`` saved without a view spec, read as ``[3, h/tp, d]``). ``inside``: units
    wholly among the requested bytes, with the ``(position, length)`` pieces of ``out`` holding them, in
    hash order; ``partial``: units read whole, checked, their shared bytes copied as ``(from, to,
    length)``; ``direct``: the rest, read straight into ``out`` as ``(tensor offset, position, length)``;
    ``covered``: requested bytes some unit covers."""

    inside: list[tuple[Unit, list[tuple[int, int]]]]
    partial: list[tuple[Unit, np.ndarray, int, list[tuple[int, int, int]]]]
    direct: list[tuple[int, int, int]]
    covered: int


def intervals(starts: np.ndarray, run: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of ``run`` bytes at ``starts`` as maximal intervals ``[lo, hi)``, with each one's position."""
    s = np.asarray(starts, dtype=np.int64)
    if not len(s):
        return s, s, s
    breaks = np.flatnonzero(s[1:] != s[:-1] + run) + 1
    firsts = np.concatenate([[0], breaks]).astype(np.int64)
    lasts = np.concatenate([breaks, [len(s)]]).astype(np.int64)
    return s[firsts], s[lasts - 1] + run, firsts * run


def cross_view(index: UnitIndex, starts: np.ndarray, run: int, itemsize: int) -> CrossView:
    """Match the requested runs (``run`` bytes at ``starts``) against ``index``'s units byte by byte."""
    if index.view is None:
        raise ValueError("units in several views")
    view = index.view
    lo, hi, pos = intervals(starts, run)  # the requested bytes, and where each interval starts in ``out``
    strides = np.asarray(c_strides(view), dtype=np.int64)
    # candidates: units whose byte extent meets a requested interval
    first = (index._lo * strides).sum(axis=1) * itemsize
    last = ((index._hi - 1) * strides).sum(axis=1) * itemsize + itemsize
    k = np.searchsorted(hi, first, side="right")
    meets = (k < len(lo)) & (lo[np.minimum(k, len(lo) - 1)] < last)
    inside: list[tuple[Unit, list[tuple[int, int]]]] = []
    partial: list[tuple[Unit, np.ndarray, int, list[tuple[int, int, int]]]] = []
    covered = 0
    for i in np.flatnonzero(meets).tolist():
        u = index.unit(i)
        ustarts, urun = box_runs(view, u.offsets, u.sizes, itemsize)
        j = np.searchsorted(lo, ustarts, side="right") - 1
        jj = np.maximum(j, 0)
        if ((j >= 0) & (ustarts + urun <= hi[jj])).all():
            inside.append((u, list(zip((pos[jj] + ustarts - lo[jj]).tolist(), [urun] * len(ustarts)))))
            covered += len(ustarts) * urun
            continue
        copies: list[tuple[int, int, int]] = []
        for n, a in enumerate(ustarts.tolist()):
            b = a + urun
            for m in range(max(0, int(np.searchsorted(hi, a, side="right"))), len(lo)):
                if lo[m] >= b:
                    break
                x, y = max(a, int(lo[m])), min(b, int(hi[m]))
                copies.append((n * urun + x - a, int(pos[m]) + x - int(lo[m]), y - x))
        if copies:
            partial.append((u, ustarts, urun, copies))
            covered += sum(c[2] for c in copies)
    taken = sorted((dst, dst + n) for *_, copies in partial for _, dst, n in copies)
    direct: list[tuple[int, int, int]] = []
    t = 0
    for a, p, end in zip(lo.tolist(), pos.tolist(), (pos + hi - lo).tolist()):
        at = p
        while at < end:
            while t < len(taken) and taken[t][1] <= at:
                t += 1
            if t < len(taken) and taken[t][0] <= at:
                at = min(end, taken[t][1])
                continue
            nxt = min(end, taken[t][0]) if t < len(taken) else end
            direct.append((a + at - p, at, nxt - at))
            at = nxt
    return CrossView(inside, partial, direct, covered)


def unit_extent(
    view: tuple[int, ...], offsets: Sequence[int], sizes: Sequence[int], itemsize: int, units: Sequence[Unit]
) -> tuple[int, int] | None:
    """Bytes ``[lo, hi)`` of a tensor that reading box ``(offsets, sizes)`` of it as ``view`` touches: the
    box's runs and the whole ``units`` it overlaps (:meth:`UnitIndex.touched`'s)."""
    starts, run = box_runs(view, offsets, sizes, itemsize)
    if not len(starts):
        return None
    lo, hi = int(starts[0]), int(starts[-1]) + run
    for u in units:
        ustarts, urun = box_runs(u.view, u.offsets, u.sizes, itemsize)
        lo, hi = min(lo, int(ustarts[0])), max(hi, int(ustarts[-1]) + urun)
    return lo, hi


def read_intervals(
    view: tuple[int, ...], offsets: Sequence[int], sizes: Sequence[int], itemsize: int, units: Sequence[Unit]
) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of a tensor that reading box ``(offsets, sizes)`` of it as ``view`` touches (the box's runs
    and the whole ``units`` it overlaps, as :func:`unit_extent`), as :func:`run_intervals`: what an object
    store must fetch, gaps apart."""
    box = box_runs(view, offsets, sizes, itemsize)
    return run_intervals([box, *(box_runs(u.view, u.offsets, u.sizes, itemsize) for u in units)])


def run_intervals(runs: Sequence[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Runs (``(starts, run)`` pairs, as :func:`box_runs` gives them) as sorted disjoint byte intervals
    ``[lo, hi)``, overlapping and touching ones joined."""
    runs = [(s, n) for s, n in runs if len(s)]
    if not runs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lo = np.concatenate([s for s, _ in runs]).astype(np.int64)
    hi = np.concatenate([s + n for s, n in runs]).astype(np.int64)
    order = np.argsort(lo, kind="stable")
    lo, reach = lo[order], np.maximum.accumulate(hi[order])
    new = np.flatnonzero(lo[1:] > reach[:-1]) + 1  # an interval starting past every earlier one's end
    return lo[np.concatenate([[0], new])], reach[np.concatenate([new - 1, [len(lo) - 1]])]


def bytes_of(sub: torch.Tensor, dtype: torch.dtype) -> memoryview | None:
    """A writable view of ``sub``'s bytes when it is a contiguous CPU tensor of ``dtype``; else ``None``."""
    if sub.dtype != dtype:
        return None
    mv = cpu_bytes(sub)
    return None if mv is None or mv.readonly or not mv.nbytes else mv
