"""Read planning: which bytes each load item needs, widened to checksum blocks, coalesced into requests,
and which items may be read straight into their destination.

No I/O here, and no planner calls (``_run`` resolves a direct candidate's destination when its turn comes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.planner import ReadItem

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage.format._check_units import Tiling
from smpckpt.storage.format._columns import REQUEST_COST_BYTES, Into, streams
from smpckpt.storage.format._reading import Fetch, Need, coalesce, cpu_bytes, slice_byte_range
from smpckpt.storage.format.manifest import FileRecord

__all__ = ["BoxRead", "box_read", "DIRECT_MIN_BYTES", "PIECE_BYTES", "ROW_GAP", "ROWS_PER_CALL", "REQUEST_COST_BYTES"]
__all__ += ["streams", "Item", "FetchTask", "DirectCandidate", "ReadPlan", "raw_item", "plan_reads", "writable_bytes"]
__all__ += ["pieces", "box_destination", "item_destination"]

# raw tensor items at least this large skip the shared buffer (read into the destination tensor)
DIRECT_MIN_BYTES = 1 << 20
# bytes of a direct item read (then verified) per task: pieces of one tensor run on several threads
PIECE_BYTES = 16 << 20
#: a strided (column) slice's rows share one request, gaps and all, when the bytes between them are at
#: most this many (or the reader's ``coalesce_gap``): less than a page, which the device reads anyway
#: for the rows on either side; wider gaps cost device bytes (``benchmarks/RESULTS.md``, "Strided reads").
#: Devices that punish small requests may set ``coalesce_gap``.
ROW_GAP = (4 << 10) - 1
#: iovecs per ``preadv`` (Linux's IOV_MAX is 1024): a merged request carries a row and a gap each
ROWS_PER_CALL = 511


@dataclasses.dataclass(frozen=True)
class Item:
    """One load item and the exact bytes ``[start, end)`` of ``file`` it decodes from."""

    req: ReadItem
    file: str
    start: int
    end: int
    raw: bool  # raw tensor bytes (decode with dtype/shape) vs a torch.save record / object bytes
    dtype: torch.dtype | None = None
    chunk_sizes: tuple[int, ...] = ()

    @property
    def fqn(self) -> str:
        return self.req.storage_index.fqn


@dataclasses.dataclass(frozen=True)
class FetchTask:
    """One coalesced request into a pooled buffer: bytes ``fetch.start..fetch.end`` of ``file``."""

    file: str
    fetch: Fetch[Item]
    #: no other request of this load ends where it starts or starts where it ends in its file: read-ahead
    #: would fetch bytes nobody asked for, so its descriptor gets none (``POSIX_FADV_RANDOM``)
    scattered: bool = False

    @property
    def nbytes(self) -> int:
        return self.fetch.end - self.fetch.start


@dataclasses.dataclass(frozen=True)
class DirectCandidate:
    """A raw item that may be read straight into its destination; ``need`` holds its block-widened
    range. Whether it is depends on the destination, resolved when its turn comes."""

    file: str
    need: Need[Item]
    scattered: bool = False  #: as :attr:`FetchTask.scattered`

    @property
    def nbytes(self) -> int:
        return self.need.end - self.need.start


@dataclasses.dataclass(frozen=True)
class BoxRead:
    """A column slice read as one run per row: rows ``[row0, row1)`` of the record at ``base`` (rows of
    ``row_bytes``), bytes ``[col0, col1)`` of each. Inside a ``tiling`` (when verifying) that is whole
    column groups of whole row groups, so the tiles read verify; else exactly the slice's bytes.

    The rows land back to back (``width`` bytes each). ``merge``: neighbouring rows share one request,
    the gap between them read into a scratch buffer (a gap of at most :data:`ROW_GAP`); else each row
    is a request of its own. ``stream`` (the planner's cost model, :func:`streams`; never with
    ``merge``): the rows are read as sequential spans of whole rows instead, gaps included, and their
    columns copied out. Either way a box is read in tasks of whole row groups (:meth:`chunks`),
    spread over the reader's threads."""

    file: str
    item: Item
    base: int
    row_bytes: int
    row0: int
    row1: int
    col0: int
    col1: int
    tiling: Tiling | None = None
    merge: bool = False
    stream: bool = False

    @property
    def start(self) -> int:
        return self.base + self.row0 * self.row_bytes + self.col0

    @property
    def width(self) -> int:
        return self.col1 - self.col0

    @property
    def nbytes(self) -> int:
        return (self.row1 - self.row0) * self.width

    @property
    def group_rows(self) -> int:
        """Rows read and verified together: a tiling's row group (tasks and requests never cut one);
        without one (not verified), :data:`ROWS_PER_CALL`."""
        return self.tiling.rows_per_group if self.tiling is not None else ROWS_PER_CALL

    @property
    def unit_rows(self) -> int:
        """Rows that parts and pieces never cut: a tiling's row group (verified whole); a streamed box
        without one reads whole rows in one request each piece, so one row (``ROWS_PER_CALL``, the
        iovec limit of a request per row, would make its pieces 511 rows of any width)."""
        return 1 if self.stream and self.tiling is None else self.group_rows

    def requested(self, a: int, b: int) -> tuple[int, int]:
        """``(bytes, requests)`` asked of storage for rows ``[a, b)`` (a range of whole row groups):
        merged rows read their gaps too, ``ROWS_PER_CALL`` rows per request within each row group; a
        streamed box its span, gaps included, counted as one request here (the reader reads it in
        pieces and counts those as it issues them)."""
        if self.stream:
            return (b - a - 1) * self.row_bytes + self.width, 1
        if not self.merge:
            return (b - a) * self.width, b - a
        gap = self.row_bytes - self.width
        nbytes = requests = 0
        for g0 in range(a, b, self.group_rows):
            for r0 in range(g0, min(b, g0 + self.group_rows), ROWS_PER_CALL):
                n = min(ROWS_PER_CALL, b - r0, g0 + self.group_rows - r0)
                nbytes += n * self.width + (n - 1) * gap
                requests += 1
        return nbytes, requests

    def chunks(self, limit: int) -> list[tuple[int, int]]:
        """The box's rows as ``[a, b)`` ranges of whole row groups of about ``limit`` requested bytes (of
        whole rows where they may be read so: a streamed span stays within ``limit`` too)."""
        per_row = self.row_bytes if self.merge or self.stream else self.width
        step = max(1, limit // max(1, per_row * self.unit_rows)) * self.unit_rows
        return [(a, min(self.row1, a + step)) for a in range(self.row0, self.row1, step)]

    def item_rows(self) -> tuple[int, int, int]:
        """``(first row, end row, first byte column)`` of the item's own slice in the record."""
        r0, c0 = divmod(self.item.start - self.base, self.row_bytes)
        r1 = (self.item.end - 1 - self.base) // self.row_bytes + 1
        return r0, r1, c0


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    fetches: list[FetchTask]  # by file, then offset
    empty: list[Item]  # items of no bytes (delivered without a read)
    direct: list[DirectCandidate]  # by file, then offset
    #: bytes of the requested slices / records per file (exact: a strided slice counts its elements)
    needed_per_file: dict[str, int] = dataclasses.field(default_factory=dict)
    boxes: list[BoxRead] = dataclasses.field(default_factory=list)  # column slices read row by row


def raw_item(req: ReadItem, file: str, offset: int, length: int, dtype: torch.dtype, sizes: tuple[int, ...]) -> Item:
    """The item for a raw tensor record of ``length`` bytes at ``offset`` of ``file`` holding a chunk of
    shape ``sizes``: only the bytes of the requested slice (their enclosing span when it is strided)."""
    itemsize = dtype.itemsize
    lo, hi = slice_byte_range(sizes, list(req.storage_offsets), list(req.lengths), itemsize)
    if math.prod(sizes) * itemsize != length:
        raise CheckpointCorrupt(
            f"{file}: record of {req.storage_index.fqn!r} is {length} bytes, "
            f"its shape {list(sizes)} x {dtype} needs {math.prod(sizes) * itemsize}"
        )
    if not 0 <= lo <= hi <= length:
        raise CheckpointCorrupt(
            f"{file}: requested slice of {req.storage_index.fqn!r} (offsets {list(req.storage_offsets)}, "
            f"lengths {list(req.lengths)}) is outside its stored chunk {list(sizes)}"
        )
    return Item(req, file, offset + lo, offset + hi, True, dtype, sizes)


def plan_reads(
    items: list[Item],
    records: Mapping[str, FileRecord],
    *,
    verify: bool,
    local: bool,
    direct: bool,
    direct_min_bytes: int,
    coalesce_gap: int,
    max_request_bytes: int,
    row_gap: int = ROW_GAP,
    request_cost: int = REQUEST_COST_BYTES,
) -> ReadPlan:
    """Widen each item to whole checksum blocks (of files in ``records``, when ``verify``), set aside
    row-by-row box reads (``local`` files; rows at most ``row_gap`` apart share requests; elsewhere a
    strided slice whose widened span exceeds ``max_request_bytes``; everywhere, rows whose gaps cost less
    than a request, ``request_cost`` bytes, stream, :func:`streams`, in requests of at most that, and
    rows farther apart take a request each: a verified untiled record's run widened to its blocks) and
    direct candidates (where ``direct``: reads can land in the destination), coalesce the rest per file,
    and mark the requests no neighbour continues (``scattered``)."""
    per_file: dict[str, list[Need[Item]]] = {}
    empty: list[Item] = []
    candidates: list[DirectCandidate] = []
    boxes: list[BoxRead] = []
    needed_per_file: dict[str, int] = {}
    for it in items:
        if it.end <= it.start:
            empty.append(it)
            continue
        exact = _exact_bytes(it)
        needed_per_file[it.file] = needed_per_file.get(it.file, 0) + exact
        rec = records.get(it.file) if verify else None
        contiguous = it.raw and exact == it.end - it.start  # the slice is one run of the stored chunk's bytes
        # the reader's record checks have put the item inside the file and the file in the manifest
        lo, hi = rec.widen(it.start, it.end) if rec is not None else (it.start, it.end)
        # on object stores (fewer, larger requests) a strided slice whose rows stream is one request up to
        # max_request_bytes; past that, spans of whole rows (coalesce never splits an item: its span would
        # take one buffer)
        box = box_read(it, rec, verify=verify, spans=not local) if it.raw and not contiguous else None
        if box is not None:
            merge = local and box.row_bytes - box.width <= row_gap
            # one cost model on every backend (its request cost: the reader's, per backend): rows far apart
            # take a request each, verified (tiles) or not. An untiled record's blocks straddle its rows: on
            # an object store each row's run is then read widened to whole blocks, every block it touches
            # checked, so the gap a request per row leaves is what lies between the widened runs
            width = box.width
            if not local and rec is not None and box.tiling is None:
                wlo, whi = rec.widen(box.start, box.start + box.width)
                width = whi - wlo
            stream = not merge and streams(box.row_bytes, width, request_cost)
            if local or not stream or hi - lo > max_request_bytes:
                boxes.append(dataclasses.replace(box, merge=merge, stream=stream))
                continue
        if direct and contiguous and it.end - it.start >= direct_min_bytes:
            # candidate for reading straight into the destination (decided when its target is resolved)
            candidates.append(DirectCandidate(it.file, Need(lo, hi, it)))
            continue
        per_file.setdefault(it.file, []).append(Need(lo, hi, it))
    fetches = [
        FetchTask(name, f)
        for name in sorted(per_file)
        for f in coalesce(per_file[name], gap=coalesce_gap, max_bytes=max_request_bytes)
    ]
    candidates.sort(key=lambda d: (d.file, d.need.start))
    boxes.sort(key=lambda b: (b.file, b.start))
    fetches, candidates = _mark_scattered(fetches, candidates, {n: r.size for n, r in records.items()})
    return ReadPlan(fetches, empty, candidates, needed_per_file, boxes)


def _mark_scattered(
    fetches: list[FetchTask], candidates: list[DirectCandidate], sizes: Mapping[str, int]
) -> tuple[list[FetchTask], list[DirectCandidate]]:
    """Mark the requests followed in their file by bytes this load does not read (``sizes``: file
    sizes, where known; past the last request of a file of unknown size nothing counts as unread), so
    the kernel's read-ahead does not fetch another rank's slice for nothing."""
    spans = sorted(
        [(t.file, t.fetch.start, t.fetch.end) for t in fetches]
        + [(d.file, d.need.start, d.need.end) for d in candidates]
    )
    followed: set[tuple[str, int]] = set()  # (file, start) of requests with unread bytes right after them
    k = 0
    while k < len(spans):
        # a run of requests whose bytes touch or overlap: only the one reaching its end can be followed
        f, j, reach, last = spans[k][0], k, spans[k][2], k
        while j + 1 < len(spans) and spans[j + 1][0] == f and spans[j + 1][1] <= reach:
            j += 1
            if spans[j][2] > reach:
                reach, last = spans[j][2], j
        more = j + 1 < len(spans) and spans[j + 1][0] == f  # a later request of the file, past a gap
        if more or reach < sizes.get(f, reach):
            followed.add((f, spans[last][1]))
        k = j + 1

    def alone(file: str, start: int) -> bool:
        return (file, start) in followed

    return (
        [dataclasses.replace(t, scattered=alone(t.file, t.fetch.start)) for t in fetches],
        [dataclasses.replace(d, scattered=alone(d.file, d.need.start)) for d in candidates],
    )


def _exact_bytes(it: Item) -> int:
    """The bytes the item's destination receives: a strided (column) slice counts only its elements,
    not the span that encloses them, so ``last_read_stats`` shows what a column read really costs."""
    if it.raw and it.dtype is not None:
        return math.prod(int(x) for x in it.req.lengths) * it.dtype.itemsize
    return it.end - it.start


def writable_bytes(it: Item, target: torch.Tensor, nbytes: int | None = None) -> memoryview | None:
    """A writable view of ``target``'s bytes when they take the item's stored bytes as they are: a
    contiguous CPU tensor of the saved dtype and the requested shape, of ``nbytes`` bytes (default: the
    slice is one run in the file, ``end - start``)."""
    if target.dtype != it.dtype or tuple(target.shape) != tuple(int(n) for n in it.req.lengths):
        return None
    dst = cpu_bytes(target)
    if dst is None or dst.readonly or dst.nbytes != (it.end - it.start if nbytes is None else nbytes):
        return None
    return dst


def pieces(rec: FileRecord | None, lo: int, hi: int) -> list[tuple[int, int]]:
    """Split ``[lo, hi)`` into pieces of about :data:`PIECE_BYTES`, cut where whole units of ``rec``
    end (the file's record when verifying, else ``None``), so each piece verifies on its own."""
    if hi - lo <= PIECE_BYTES:
        return [(lo, hi)]
    if rec is None:
        return [(a, min(a + PIECE_BYTES, hi)) for a in range(lo, hi, PIECE_BYTES)]
    out: list[tuple[int, int]] = []
    start = lo
    for i in rec.blocks_covering(lo, hi):
        be = rec.block_ends[i]
        if (be - start >= PIECE_BYTES and rec.is_cut(be)) or be >= hi:
            out.append((start, be))
            start = be
    if start < hi:  # pragma: no cover - widened ranges end on a block end
        out.append((start, hi))
    return out


def box_read(it: Item, rec: FileRecord | None, *, verify: bool, spans: bool = False) -> BoxRead | None:
    """The row-by-row read of a strided slice: verifying, the column groups it touches over the row
    groups it touches when its record is tiled in ``rec``; not verifying, exactly its bytes (rows merged,
    streamed or a request each: the caller's cost model decides, for short runs too, so a slice never
    takes its whole enclosing span in one buffer). ``spans`` (object stores, read as spans of rows, each
    widened to whole units when verified): also a slice of untiled rows, or touching every column group.
    ``None``: read a range."""
    t = rec.tiling_at(it.start) if verify and rec is not None else None
    if t is not None and it.end <= t.end:
        base, row_bytes = t.start, t.row_bytes
    elif verify and not spans:
        return None
    elif it.chunk_sizes and it.dtype is not None:
        t = None
        row_bytes = math.prod(it.chunk_sizes[1:]) * it.dtype.itemsize
        first, _ = slice_byte_range(it.chunk_sizes, it.req.storage_offsets, it.req.lengths, it.dtype.itemsize)
        base = it.start - first  # the record's start
    else:
        return None
    row0, col0 = divmod(it.start - base, row_bytes)
    row1, last = divmod(it.end - 1 - base, row_bytes)
    if last < col0:
        return None
    if t is None:
        return BoxRead(it.file, it, base, row_bytes, row0, row1 + 1, col0, last + 1)
    g0, g1 = col0 // t.segment, last // t.segment + 1
    if (g1 - g0) * t.segment == row_bytes and not spans:
        return None
    rows = (row0 // t.rows_per_group * t.rows_per_group, min(t.rows, (row1 // t.rows_per_group + 1) * t.rows_per_group))
    return BoxRead(it.file, it, base, row_bytes, rows[0], rows[1], g0 * t.segment, g1 * t.segment, t)


def box_destination(box: BoxRead, target: torch.Tensor) -> memoryview | None:
    """The destination's bytes when the box's rows can be read straight into them: the box is exactly
    the item's rows and columns (tile columns that match the slice), each row of the slice one run, and
    the destination a contiguous CPU tensor of the saved dtype and the slice's shape."""
    it = box.item
    r0, r1, c0 = box.item_rows()
    if (r0, r1, c0) != (box.row0, box.row1, box.col0) or it.dtype is None:
        return None
    lengths = [int(n) for n in it.req.lengths]
    if math.prod(lengths[1:]) * it.dtype.itemsize != box.width:
        return None
    return writable_bytes(it, target, box.nbytes)


def item_destination(box: BoxRead, target: torch.Tensor) -> Into | None:
    """The destination's bytes as rows of the item's slice, when a streamed box's rows can be copied into
    them as stored: a contiguous CPU tensor of the saved dtype and the slice's shape, the slice two
    dimensions or more whose rows are each one run of the record's rows."""
    it = box.item
    if it.dtype is None or not it.chunk_sizes:
        return None
    lengths = [int(n) for n in it.req.lengths]
    width = math.prod(lengths[1:]) * it.dtype.itemsize
    r0, r1, c0 = box.item_rows()
    # each destination row one run of the record row: trailing dimensions whole past the first
    if list(it.chunk_sizes[2:]) != lengths[2:] or r1 - r0 != lengths[0] or c0 + width > box.row_bytes:
        return None
    dst = writable_bytes(it, target, lengths[0] * width)
    return Into(dst, r0, width, c0) if dst is not None else None
