"""Block checksums of data files (xxh3-64 from the C-accelerated ``xxhash`` package). Unit boundaries
are recorded as end offsets because they follow the items: every raw tensor record starts a fresh unit
and is cut into units sized for it (blocks, or tiles: :mod:`._check_units`), so a resharding load's
slices start and end on unit boundaries and verification adds little to the bytes read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import xxhash

from smpckpt.storage.backends._sinks import byte_view
from smpckpt.storage.format._check_units import ItemChecks, Tiling

__all__ = ["ALGORITHM", "DEFAULT_BLOCK_SIZE", "BlockHasher", "hash_bytes", "hash_parts", "hash_rows", "update_rows"]

#: The checksum algorithm's name as the manifest records it (and names its digest fields after).
ALGORITHM = "xxh3_64"
DEFAULT_BLOCK_SIZE = 1 << 20


def hash_bytes(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data`` (xxhash releases the GIL above 64 KiB, so large hashes overlap other threads)."""
    return xxhash.xxh3_64_intdigest(data)


def hash_parts(parts: Iterable[bytes | bytearray | memoryview]) -> int:
    """xxh3-64 of the concatenation of ``parts`` (equal to :func:`hash_bytes` of the joined bytes)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


#: rows shorter than this are gathered (numpy, GIL released) and hashed in one call; longer ones are fed
#: one ``update`` each: xxhash holds the GIL for inputs up to 64 KiB, so a tile row by row serialised threads
GATHER_BELOW = 64 << 10
#: bytes gathered per hash call (a thread's scratch buffer never grows past this): a tile of the default
#: 1 MiB unit in one call
_GATHER_BYTES = 1 << 20
_scratch = threading.local()


def hash_rows(data: memoryview, first: int, rows: int, run: int, stride: int) -> int:
    """xxh3-64 of ``rows`` runs of ``run`` bytes of ``data`` (flat), the first at ``first``, each ``stride``
    bytes after the one before (a tile's row segments): equal to :func:`hash_parts` of those runs."""
    if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1):
        data = data.cast("B")  # offsets count bytes
    if rows < 0 or run < 0 or stride < run or first < 0 or (rows and first + (rows - 1) * stride + run > len(data)):
        raise ValueError(f"rows {rows} x {run} bytes every {stride} from {first} do not fit {len(data)} bytes")
    if rows == 0 or run == 0:
        return hash_bytes(b"")
    if rows == 1 or run == stride:
        return hash_bytes(data[first : first + (rows - 1) * stride + run])
    if run < GATHER_BELOW and rows * run <= _GATHER_BYTES:  # one gather, one call: no streaming state
        rows_view = np.ndarray((rows, run), np.uint8, buffer=data, offset=first, strides=(stride, 1))
        return hash_bytes(_gather(rows_view, _gather_buffer(rows * run)))
    h = xxhash.xxh3_64()
    update_rows(h, data, first, rows, run, stride)
    return h.intdigest()


def update_rows(h: xxhash.xxh3_64, data: memoryview, first: int, rows: int, run: int, stride: int) -> None:
    """Feed ``h`` the runs :func:`hash_rows` lays out, short ones gathered a batch at a time."""
    if rows <= 0 or run <= 0:
        return
    if rows == 1 or run == stride:
        h.update(data[first : first + (rows - 1) * stride + run])
        return
    if run >= GATHER_BELOW:
        for a in range(first, first + rows * stride, stride):
            h.update(data[a : a + run])
        return
    # a view of the rows (numpy checks that they lie inside ``data``), gathered a batch at a time
    rows_view = np.ndarray((rows, run), np.uint8, buffer=data, offset=first, strides=(stride, 1))
    per = max(1, _GATHER_BYTES // run)
    out = _gather_buffer(min(rows, per) * run)
    for r in range(0, rows, per):
        h.update(_gather(rows_view[r : r + per], out))


def _gather_buffer(n: int) -> np.ndarray:
    """This thread's scratch buffer of at least ``n`` bytes (reused: fresh pages fault in every time)."""
    buf: np.ndarray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < n:
        buf = _scratch.buf = np.empty(n, dtype=np.uint8)
    return buf


def _gather(rows: np.ndarray, out: np.ndarray) -> memoryview:
    """``rows`` (a 2-D byte view) back to back into ``out``; a view of them there."""
    n = rows.shape[0] * rows.shape[1]
    np.copyto(out[:n].reshape(rows.shape), rows)  # numpy releases the GIL for the copy
    return out[:n].data


class BlockHasher:
    """Streams a file's bytes into check units and records (end offset, digest) per unit: items fed with
    :meth:`start_item` alone pack into ``block_size`` blocks (a large item starts a fresh one); items fed
    with an :class:`~._check_units.ItemChecks` get units of their own (blocks or tiles, listed in
    :attr:`tilings`). Not thread-safe: one file's bytes in order from one thread."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.ends: list[int] = []
        self.digests: list[int] = []
        self.tilings: list[Tiling] = []
        self._pos = 0
        self._fill = 0
        self._h = xxhash.xxh3_64()
        self._unit = block_size
        self._item_end = -1  # end of an item with units of its own (-1: none open)
        self._tiling: Tiling | None = None
        self._tile_h: list[xxhash.xxh3_64] = []

    def start_item(self, nbytes: int, checks: ItemChecks | None = None) -> None:
        """Called before an item's bytes: one of at least a block, or with ``checks``, starts a unit."""
        if self._fill and (checks is not None or nbytes >= self.block_size):
            self._cut()
        if checks is None or nbytes == 0:
            return
        self._unit = checks.unit
        self._item_end = self._pos + nbytes
        self._tiling = None
        if checks.groups > 1:
            self._tiling = Tiling(self._pos, self._item_end, checks.row_bytes, checks.groups, checks.rows_per_group)
            self.tilings.append(self._tiling)
            self._tile_h = [xxhash.xxh3_64() for _ in range(self._tiling.groups)]

    def update(self, data: memoryview) -> None:
        mv = byte_view(data)
        if self._tiling is not None:
            self._update_tiles(mv)
            return
        i, n = 0, len(mv)
        while i < n:
            take = min(self._unit - self._fill, n - i)
            if take == self._unit:
                # whole unit: one-shot digest, no streaming state
                self.digests.append(xxhash.xxh3_64_intdigest(mv[i : i + take]))
                self._pos += take
                self.ends.append(self._pos)
            else:
                self._h.update(mv[i : i + take])
                self._fill += take
                self._pos += take
                if self._fill == self._unit:
                    self._cut()
            i += take
        if self._pos == self._item_end:
            self._end_item()

    def _update_tiles(self, mv: memoryview) -> None:
        t = self._tiling
        assert t is not None
        seg, row, hs = t.segment, t.row_bytes, self._tile_h
        i, n = 0, len(mv)
        while i < n:
            col = (self._pos - t.start) % row
            rg_end = t.group_ceil(self._pos + 1)
            if col == 0 and n - i >= row:
                # whole rows up to the row group's end: each tile's segments of these rows gathered and
                # hashed in one call (``hash_rows``; not one update per 4-8 KiB segment under the GIL)
                k = min((n - i) // row, (rg_end - self._pos) // row)
                if self._pos == t.group_floor(self._pos) and k * row == rg_end - self._pos:
                    # the whole row group is here: each tile's digest at once
                    width = k * seg
                    for g in range(t.groups):
                        self.digests.append(hash_rows(mv, i + g * seg, k, seg, row))
                        self.ends.append(self._pos + (g + 1) * width)
                    i += k * row
                    self._pos += k * row
                    if self._pos == t.end:
                        self._end_item()
                    continue
                for g in range(t.groups):
                    update_rows(hs[g], mv, i + g * seg, k, seg, row)
                take = k * row
            else:
                take = min(seg - col % seg, n - i)
                hs[col // seg].update(mv[i : i + take])
            i += take
            self._pos += take
            if self._pos == rg_end:
                self._close_row_group(t)

    def _close_row_group(self, t: Tiling) -> None:
        rg_start = t.group_floor(self._pos - 1)
        width = (self._pos - rg_start) // t.groups
        for g, h in enumerate(self._tile_h):
            self.digests.append(h.intdigest())
            self.ends.append(rg_start + (g + 1) * width)
            h.reset()
        if self._pos == t.end:
            self._end_item()

    def _end_item(self) -> None:
        if self._fill:
            self._cut()
        self._unit = self.block_size
        self._item_end = -1
        self._tiling = None

    def _cut(self) -> None:
        self.digests.append(self._h.intdigest())
        self.ends.append(self._pos)
        self._h.reset()
        self._fill = 0

    def finish(self) -> tuple[list[int], list[int]]:
        """Close the last partial block; returns (unit end offsets, digests)."""
        if self._fill:
            self._cut()
        return self.ends, self.digests
