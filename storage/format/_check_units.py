"""Check units that follow the tensors: what a raw tensor's checksums cover, so a resharding read
verifies exactly the bytes it needs (pure functions, no I/O). Each raw tensor record gets units of its
own (a fresh block starts at the record):

* **Blocks** of about ``size / 64`` bytes (a power of two, from :data:`MIN_UNIT` to the writer's block
  size), so a dim-0 slice of a 1 MiB tensor reads within 16 KiB of its bytes.
* **Tiles**, for rows (dim 0 entries) of at least ``2 * MIN_SEGMENT`` bytes: the row-major bytes as a
  ``[rows, row_bytes]`` grid cut into ``groups`` equal column groups (2, 4 or 8, dividing ``shape[1]``)
  and row groups of ``rows_per_group`` rows; a tile's digest is over its row segments in row order, so
  a column slice reads one run per row of only the column groups it touches.

Tiles are listed like blocks (row group by row group, column group by column group), each with an end
offset as if contiguous, so every row-group boundary is a block end and only code that hashes a tile
needs :meth:`Tiling.spans`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["MIN_UNIT", "MIN_SEGMENT", "UNITS_PER_ITEM", "ItemChecks", "Tiling", "item_checks"]

#: smallest 1-D check unit of a record that is cut at all (smaller records are one unit)
MIN_UNIT = 16 << 10
#: smallest per-row segment of a tile: a page, so a column read is never a run of tiny reads
MIN_SEGMENT = 4 << 10
#: a record below 64 blocks is cut into about this many units
UNITS_PER_ITEM = 64
_GROUPS = (8, 4, 2)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """File bytes ``[start, end)`` are a row-major grid of rows of ``row_bytes``, checked as tiles of
    ``rows_per_group`` rows x ``row_bytes // groups`` bytes (the last row group may be shorter)."""

    start: int
    end: int
    row_bytes: int
    groups: int
    rows_per_group: int

    def __post_init__(self) -> None:
        if (
            self.start < 0
            or self.end <= self.start
            or self.row_bytes <= 0
            or self.groups < 2
            or self.rows_per_group <= 0
            or self.row_bytes % self.groups
            or (self.end - self.start) % self.row_bytes
        ):
            raise ValueError(f"inconsistent tiling {self}")

    @property
    def segment(self) -> int:
        return self.row_bytes // self.groups

    @property
    def rows(self) -> int:
        return (self.end - self.start) // self.row_bytes

    @property
    def group_bytes(self) -> int:
        """Bytes of a full row group."""
        return self.rows_per_group * self.row_bytes

    @property
    def tiles(self) -> int:
        return -(-self.rows // self.rows_per_group) * self.groups  # row groups x column groups

    def group_floor(self, offset: int) -> int:
        """Start of the row group holding file byte ``offset`` (inside the tiling)."""
        return self.start + (offset - self.start) // self.group_bytes * self.group_bytes

    def group_ceil(self, offset: int) -> int:
        """End of the row group holding the byte just before ``offset`` (inside the tiling)."""
        return min(self.end, self.start - (self.start - offset) // self.group_bytes * self.group_bytes)

    def tile_ends(self) -> list[int]:
        """The block-list end offsets of every tile, in order."""
        ends: list[int] = []
        for rg_start in range(self.start, self.end, self.group_bytes):
            width = min(self.rows_per_group, (self.end - rg_start) // self.row_bytes) * self.segment
            ends.extend(range(rg_start + width, rg_start + width * self.groups + 1, width))
        return ends

    def tile_rows(self, block_start: int, block_end: int) -> tuple[int, int]:
        """``(first, rows)`` of the tile ``[block_start, block_end)``: its row segments are :attr:`segment` bytes
        at ``first + r * row_bytes``, ``r < rows``; ``ValueError`` when that is no tile of this tiling."""
        rg_start = self.group_floor(block_start)
        nrows = min(self.rows_per_group, (self.end - rg_start) // self.row_bytes)
        width = nrows * self.segment
        g, rem = divmod(block_start - rg_start, width)
        if rem or block_end - block_start != width or not 0 <= g < self.groups:
            raise ValueError(f"block {block_start}..{block_end} is not a tile of {self}")
        return rg_start + g * self.segment, nrows

    def spans(self, block_start: int, block_end: int) -> list[tuple[int, int]]:
        """The file byte ranges, in hash order, of the tile ``[block_start, block_end)``; else ``ValueError``."""
        first, nrows = self.tile_rows(block_start, block_end)
        return [(first + r * self.row_bytes, first + r * self.row_bytes + self.segment) for r in range(nrows)]


@dataclasses.dataclass(frozen=True)
class ItemChecks:
    """How one record is checked: blocks of ``unit`` bytes, or tiles when ``groups`` > 1."""

    unit: int
    row_bytes: int = 0
    groups: int = 1
    rows_per_group: int = 0


def item_checks(shape: Sequence[int], itemsize: int, block_size: int) -> ItemChecks:
    """The check units of a raw tensor record of ``shape`` (row-major) under a writer ``block_size``."""
    nbytes = math.prod(shape) * itemsize
    if nbytes >= UNITS_PER_ITEM * block_size:
        unit = block_size
    else:
        unit = min(block_size, max(MIN_UNIT, 1 << max(0, (nbytes // UNITS_PER_ITEM).bit_length() - 1)))
    if len(shape) < 2 or nbytes == 0:
        return ItemChecks(unit)
    row_bytes = nbytes // shape[0]
    for groups in _GROUPS:
        if shape[1] % groups == 0 and row_bytes // groups >= MIN_SEGMENT:
            rows_per_group = max(1, min(shape[0], unit // (row_bytes // groups)))
            return ItemChecks(unit, row_bytes, groups, rows_per_group)
    return ItemChecks(unit)
