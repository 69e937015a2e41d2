"""Read I/O: ranged reads of data files (``preadv`` on local disk, GET bodies streamed into our buffers
on S3, ``cat_file`` elsewhere), block verification, the read-buffer pool of one ``read_data`` call, and
column slices on local disk (:func:`read_box`: rows read a request each, merged runs of rows, or
sequential spans of whole rows as the planner's cost model says, each row group's tiles inside the
slice's columns verified before its bytes are used).

Runs on the reader's worker threads; a corrupt or short file fails the read with a
:class:`~smpckpt.errors.CheckpointCorrupt` naming the file and the keys affected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from smpckpt.errors import CheckpointCorrupt, CheckpointError
from smpckpt.storage.backends._fs import (
    is_local,
    is_s3,
    pread_into,
)
from smpckpt.storage.format._checksum import hash_rows
from smpckpt.storage.format._columns import STREAM_PIECE_BYTES, Into
from smpckpt.storage.format._reading import NOT_SUPPORTED, advise_random, in_memory, pread_cached
from smpckpt.storage.format.manifest import FileRecord
from smpckpt.storage.full._files import data_file
from smpckpt.storage.read._plan import ROWS_PER_CALL, BoxRead, Item

__all__ = ["BufferPool", "reading", "check_complete", "verify_blocks", "read_range", "DirectPart"]
__all__ += ["read_direct", "reads_into", "BoxRows", "read_box", "verify_box"]

# a read's turn at the device (see _run.InOrder); held only around the I/O, never around verification
Turn = AbstractContextManager[None]


class BufferPool:
    """Read buffers reused within one ``read_data`` call: a fresh 64 MiB ``bytearray`` costs a memset and
    page faults on every request. Thread-safe. Buffers are sized to the request, rounded up to a
    multiple of ``min_size``; at most ``max_kept`` are kept for reuse."""

    def __init__(self, *, min_size: int, max_kept: int) -> None:
        self.min_size = min_size
        self.max_kept = max_kept
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        """A buffer of at least ``n`` bytes (a kept one when one is large enough)."""
        with self._lock:
            for i, b in enumerate(self._free):
                if len(b) >= n:
                    del self._free[i]
                    return b
        return bytearray(-(-max(n, 1) // self.min_size) * self.min_size)

    def give_back(self, data: memoryview) -> None:
        """Keep the buffer under ``data`` for reuse (when it came from :meth:`take`). Every view of it,
        and every tensor made from one, must be gone by then."""
        base = data.obj
        if isinstance(base, bytearray):
            with self._lock:
                if len(self._free) < self.max_kept:
                    self._free.append(base)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def reads_into(fs: Any) -> bool:
    """Whether ranged reads of ``fs`` can land in caller buffers (local ``preadv``; S3 GET bodies streamed
    in): then reads go into pooled buffers or straight into destinations, never through a ``bytes``."""
    return is_local(fs) or is_s3(fs)


@contextlib.contextmanager
def reading(path: str, keys: Sequence[str], turn: Turn | None = None) -> Iterator[None]:
    """Around I/O on data file ``path`` for ``keys``: the read's ``turn`` at the device, in :func:`data_file`."""
    with data_file(path, keys), turn or contextlib.nullcontext():
        yield


def check_complete(path: str, keys: Sequence[str], lo: int, hi: int, got: int) -> None:
    """Raise when a read of file bytes ``[lo, hi)`` returned only ``got`` bytes (the file is truncated)."""
    if got < hi - lo:
        raise CheckpointCorrupt(
            f"{path}: truncated: needed bytes {lo}..{hi} for keys {list(keys)[:5]}, file ends at {lo + got}"
        )


#: ``digest(first, rows, run, stride)``: the xxh3-64 of ``rows`` runs of ``run`` file bytes, the first at
#: file offset ``first``, each ``stride`` file bytes after the one before (a block: one run), as read
RowsDigest = Callable[[int, int, int, int], int]

#: verified local reads go in requests of about this many bytes (whole check units; a tiled row group is
#: never split), each unit hashed right after its request returns, while its bytes are still in the CPU's
#: cache: one pass over memory instead of two (figures: benchmarks/RESULTS.md, "Disk warm loads against
#: /dev/shm"; ``profile_load.py --fuse-bytes`` measures other sizes).
FUSE_BYTES = 256 << 10


def unit_rows(rec: FileRecord, i: int) -> tuple[int, int, int, int]:
    """``(first, rows, run, stride)`` of unit ``i`` of ``rec`` (file offsets): a block is one run; a
    tile is one run of its column group's width per row of its row group."""
    bs, be = rec.block_start(i), rec.block_ends[i]
    t = rec.tiling_at(bs)
    if t is None:
        return bs, 1, be - bs, be - bs
    try:
        first, rows = t.tile_rows(bs, be)
    except ValueError as exc:
        raise CheckpointCorrupt(f"manifest entry {rec.name}: {exc}") from exc
    return first, rows, t.segment, t.row_bytes


class Landing:
    """Where one request's file bytes land: ``(file offset, byte view)`` segments in file order, back to
    back (a destination's bytes, and scratch buffers for a block-widening head or tail)."""

    __slots__ = ("segs",)

    def __init__(self, segs: Sequence[tuple[int, memoryview]]) -> None:
        self.segs = segs

    def views(self, lo: int, hi: int) -> list[memoryview]:
        """The views that hold file bytes ``[lo, hi)``, in order."""
        out = []
        for off, mv in self.segs:
            a, b = max(lo, off), min(hi, off + len(mv))
            if a < b:
                out.append(mv[a - off : b - off])
        return out

    def digest(self, first: int, rows: int, run: int, stride: int) -> int:
        """A :data:`RowsDigest` over the landed bytes: one call per unit, wherever it lies (a tile's rows
        are gathered and hashed at once, see :func:`~smpckpt.storage.format._checksum.hash_rows`)."""
        end = first + (rows - 1) * stride + run
        for off, mv in self.segs:
            if off <= first and end <= off + len(mv):
                return hash_rows(mv, first - off, rows, run, stride)
        # a unit across two buffers (a widened head or tail beside the destination): its bytes joined
        joined = memoryview(bytearray(end - first))
        pos = 0
        for v in self.views(first, end):
            joined[pos : pos + len(v)] = v
            pos += len(v)
        return hash_rows(joined, 0, rows, run, stride)


def verify_blocks(
    path: str,
    rec: FileRecord,
    lo: int,
    hi: int,
    items: Sequence[Item],
    digest: RowsDigest,
    *,
    blocks: Iterable[int] | None = None,
) -> None:
    """Check every unit of ``rec`` that overlaps file bytes ``[lo, hi)`` (a range cut by
    ``rec.widen``), or just ``blocks``, with ``digest`` (see :data:`RowsDigest`). A mismatch names the
    unit and the keys among ``items`` it holds."""
    for i in rec.blocks_covering(lo, hi) if blocks is None else blocks:
        first, rows, run, stride = unit_rows(rec, i)
        if digest(first, rows, run, stride) != rec.block_digests[i]:
            last = first + (rows - 1) * stride + run
            bad = sorted({it.fqn for it in items if it.start < last and it.end > first})
            raise CheckpointCorrupt(
                f"{path}: checksum mismatch in {unit_text(i, first, rows, run, stride)} holding key(s) {bad}; "
                "the file is corrupt"
            )


def unit_text(i: int, first: int, rows: int, run: int, stride: int) -> str:
    """Where check unit ``i`` (geometry as :func:`unit_rows` gives it) lies in its file: a block's bytes,
    or a tile's first to last byte and its row segments. A tile's offsets in the block list are as if it
    were contiguous: named so, they missed the damaged byte (a tile's bytes are row segments across its
    row group). Loads, ``smpckpt verify`` and the drain's check name units alike."""
    if rows == 1:
        return f"bytes {first}..{first + run} (block {i})"
    return f"bytes {first}..{first + (rows - 1) * stride + run} (block {i}: a tile, {rows} runs of {run} bytes every {stride})"


#: a fused chunk's check units, flat: ``index, first, rows, run, stride`` of each in turn (see
#: :func:`unit_rows`). Flat ints, not a tuple per unit: a tuple is an object the cyclic garbage collector
#: counts, and a load of thousands of small tensors made enough of them to set off collections during
#: its I/O (``tests/test_gc_pauses.py``); ints are not counted.
Units = list[int]
#: the fields per unit in :data:`Units`
UNIT_FIELDS = 5


def _chunks(rec: FileRecord, lo: int, hi: int) -> Iterator[tuple[int, int, Units]]:
    """``[lo, hi)`` (cut on unit ends, as ``rec.widen`` cuts) as ``(start, end, units)``: runs of whole
    units of about :data:`FUSE_BYTES`, each ending where every unit in it has all its bytes (a tile's
    rows run to the end of its row group; a tile of one row is contiguous), with each unit's geometry
    as :func:`unit_rows` gives it. One pass in file order, the tilings walked alongside: this runs under
    the GIL on every reader thread for every unit of a verified local read."""
    blocks = rec.blocks_covering(lo, hi)
    ends, tilings = rec.block_ends, rec.tilings
    j, nt = 0, len(tilings)
    a, reach = lo, lo
    units: Units = []
    bs = ends[blocks.start - 1] if blocks.start else 0
    last = blocks.stop - 1
    for i in blocks:
        be = ends[i]
        while j < nt and tilings[j].end <= bs:
            j += 1
        t = tilings[j] if j < nt and tilings[j].start <= bs else None
        if t is None:
            units.extend((i, bs, 1, be - bs, be - bs))
            reach = max(reach, be)
        else:
            try:
                first, rows = t.tile_rows(bs, be)
            except ValueError as exc:
                raise CheckpointCorrupt(f"manifest entry {rec.name}: {exc}") from exc
            seg, row = t.segment, t.row_bytes
            units.extend((i, first, rows, seg, row))
            reach = max(reach, first + (rows - 1) * row + seg)
        if i == last or (be - a >= FUSE_BYTES and reach <= be):
            yield a, min(be, hi), units
            a, units = be, []
        bs = be


def _verify_chunk(
    path: str, rec: FileRecord, a: int, b: int, units: Units, items: Sequence[Item], digest: RowsDigest
) -> None:
    """Check ``units`` (one of :func:`_chunks`' chunks, file bytes ``[a, b)``) against ``rec`` with
    ``digest``, as :func:`verify_blocks` does, from the geometry :func:`_chunks` already worked out."""
    digests = rec.block_digests
    for k in range(0, len(units), UNIT_FIELDS):
        i, first, rows, run, stride = units[k : k + UNIT_FIELDS]
        if digest(first, rows, run, stride) != digests[i]:
            verify_blocks(path, rec, a, b, items, digest, blocks=[i])  # raises, naming the unit and its keys
            raise CheckpointCorrupt(f"{path}: checksum mismatch in block {i}")  # pragma: no cover - raised above


def _read_local(
    path: str,
    keys: Sequence[str],
    land: Landing,
    lo: int,
    hi: int,
    rec: FileRecord | None,
    items: Sequence[Item],
    turn: Turn | None,
    scattered: bool = False,
) -> None:
    """(worker thread) Local file bytes ``[lo, hi)`` into ``land``, each unit verified against ``rec``
    (``None``: not verified); a ``scattered`` request's descriptor gets no read-ahead (``advise_random``).

    Bytes in memory are read a chunk of whole units at a time (:data:`FUSE_BYTES`), each verified right
    after it is read; from the first byte that is not (a cold disk), the rest goes in one request,
    verified after. Unverified reads, filesystems that cannot tell (NFS, FUSE) and reads under a turn at
    the device (``reads_in_flight``) are one request."""
    with reading(path, keys, turn):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            if scattered:
                advise_random(fd)
            if rec is None or turn is not None:
                check_complete(path, keys, lo, hi, pread_into(fd, land.views(lo, hi), lo, hi - lo))
            else:
                lo = _read_fused(fd, path, keys, land, lo, hi, rec, items)
        finally:
            os.close(fd)
    if rec is not None and lo < hi:
        verify_blocks(path, rec, lo, hi, items, land.digest)


def _read_fused(
    fd: int, path: str, keys: Sequence[str], land: Landing, lo: int, hi: int, rec: FileRecord, items: Sequence[Item]
) -> int:
    """Read ``[lo, hi)``; chunks found in memory are verified as they come. Returns where the bytes left
    to verify start (``hi``: none)."""
    dev = os.fstat(fd).st_dev
    nowait, memory = True, None  # what the file's filesystem can tell, asked once per request
    for a, b, units in _chunks(rec, lo, hi):
        got = pread_cached(fd, land.views(a, b), a, dev) if nowait else NOT_SUPPORTED
        if got == NOT_SUPPORTED:
            nowait = False
            memory = in_memory(dev) if memory is None else memory
            if not memory:  # no way to tell what is in memory: the rest in one request
                check_complete(path, keys, a, hi, pread_into(fd, land.views(a, hi), a, hi - a))
                return a
            check_complete(path, keys, a, b, pread_into(fd, land.views(a, b), a, b - a))
        elif got < b - a:  # not (all) in the page cache: the rest in one request
            rest = pread_into(fd, land.views(a + got, hi), a + got, hi - a - got)
            check_complete(path, keys, a, hi, got + rest)
            return a
        _verify_chunk(path, rec, a, b, units, items, land.digest)
    return hi


def read_range(
    fs: Any,
    path: str,
    lo: int,
    hi: int,
    items: Sequence[Item],
    rec: FileRecord | None,
    pool: BufferPool,
    turn: Turn | None = None,
    scattered: bool = False,
) -> memoryview:
    """(worker thread) File bytes ``[lo, hi)`` serving ``items``, verified against ``rec`` (the file's
    record; ``None``: not verified). Local files and S3 objects are read into a buffer from ``pool``;
    other backends through ``cat_file``. ``scattered``: see :func:`_read_local`."""
    keys = sorted({it.fqn for it in items})
    want = hi - lo
    if is_local(fs):
        data = memoryview(pool.take(want))[:want]
        _read_local(path, keys, Landing([(lo, data)]), lo, hi, rec, items, turn, scattered)
        return data
    with reading(path, keys, turn):
        if reads_into(fs):  # S3 (local files went above): its GET body streamed into our buffer
            from smpckpt.storage.backends._s3 import get_range_into

            # a pooled buffer, not a fresh `bytes` per request: no join copy, no page faults
            buf = memoryview(pool.take(want))
            data = buf[: get_range_into(fs, path, lo, hi, [buf[:want]])]
        else:
            data = memoryview(fs.cat_file(path, start=lo, end=hi))
    check_complete(path, keys, lo, hi, len(data))
    if rec is not None:
        verify_blocks(path, rec, lo, hi, items, Landing([(lo, data)]).digest)
    return data


@dataclasses.dataclass(frozen=True)
class DirectPart:
    """File bytes ``[lo, hi)`` of a direct item ``it``, read into ``dst`` (the destination's bytes)."""

    it: Item
    dst: memoryview
    lo: int
    hi: int

    def segments(self) -> list[tuple[int, memoryview]]:
        """(file offset, buffer) pairs covering ``[lo, hi)`` in order: the item's own bytes go straight
        into ``dst``; a block-widening head or tail goes into scratch buffers."""
        it, dst, lo, hi = self.it, self.dst, self.lo, self.hi
        a, b = max(lo, it.start), min(hi, it.end)
        segs: list[tuple[int, memoryview]] = []
        if a > lo:
            segs.append((lo, memoryview(bytearray(a - lo))))
        segs.append((a, dst[a - it.start : b - it.start]))
        if hi > b:
            segs.append((b, memoryview(bytearray(hi - b))))
        return segs


def read_direct(
    fs: Any,
    path: str,
    parts: Sequence[DirectPart],
    rec: FileRecord | None,
    turn: Turn | None = None,
    scattered: bool = False,
) -> None:
    """(worker thread; a ``fs`` that :func:`reads_into`) Read consecutive direct parts (each part's ``lo``
    is the previous one's ``hi``) into their destinations and verify every unit against ``rec``
    (``None``: not verified): on local disk as :func:`_read_local` reads (units in memory verified
    as they arrive, a cold remainder in one request), on S3 with one GET whose body streams into the
    destinations. ``scattered``: see :func:`_read_local`."""
    land = Landing([seg for part in parts for seg in part.segments()])
    lo, hi = parts[0].lo, parts[-1].hi
    items = [part.it for part in parts]
    keys = [it.fqn for it in items]
    if is_local(fs):
        _read_local(path, keys, land, lo, hi, rec, items, turn, scattered)
        return
    from smpckpt.storage.backends._s3 import get_range_into  # S3: its GET body streamed into the destinations

    with reading(path, keys, turn):
        got = get_range_into(fs, path, lo, hi, land.views(lo, hi))
    check_complete(path, keys, lo, hi, got)
    if rec is not None:
        verify_blocks(path, rec, lo, hi, items, land.digest)


@dataclasses.dataclass(frozen=True)
class BoxRows:
    """What :func:`read_box` read: the part's rows from the box's first column on, ``pitch`` bytes apart
    in ``data`` (``None``: in the destination given); the bytes and requests asked of storage."""

    data: memoryview | None
    pitch: int
    nbytes: int
    requests: int


def read_box(
    path: str,
    box: BoxRead,
    rows: tuple[int, int],
    rec: FileRecord | None,
    dst: memoryview | None,
    pool: BufferPool,
    turn: Turn | None = None,
    into: Into | None = None,
) -> BoxRows:
    """(worker thread, local files) Rows ``[a, b)`` of the box (whole row groups), verified against
    ``rec`` (a tiled box: every tile inside its columns), into ``dst`` (the destination's own rows,
    ``width`` bytes each) or a pooled buffer. A row group at a time (a request per row, or ``box.merge``:
    up to :data:`~._plan.ROWS_PER_CALL` rows per request, gaps into scratch), its tiles verified while in
    cache; no read-ahead (it would fetch the gaps). ``box.stream``: sequential requests of whole rows,
    gaps included (:func:`_stream_into` into ``dst`` or ``into``, the item's whole destination; without
    either, or under a ``turn``: one request into a pooled buffer, ``pitch`` ``row_bytes``)."""
    with reading(path, [box.item.fqn], turn):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            advise_random(fd, random=not box.merge)
            if box.stream:
                if dst is not None:
                    into = Into(dst, rows[0], box.width, box.col0)
                if into is not None and turn is None:
                    return _stream_into(fd, path, box, rows, rec, into, pool)
                got = _read_span(fd, path, box, rows, dst, pool)
                if turn is None:
                    _verify_rows(path, box, rec, got, dst, rows)
            else:
                got = _read_groups(fd, path, box, rows, rec, dst, pool, verify=turn is None)
        finally:
            os.close(fd)
    if turn is not None:  # a turn at the device covers the reads only
        _verify_rows(path, box, rec, got, dst, rows)
    return got


def _verify_rows(
    path: str, box: BoxRead, rec: FileRecord | None, got: BoxRows, dst: memoryview | None, rows: tuple[int, int]
) -> None:
    """Every tile of ``rows`` inside the box's columns (a tiled box, ``rec`` given), where ``got`` put them."""
    if box.tiling is not None and rec is not None:
        verify_box(path, box, rec, got.data if got.data is not None else dst, got.pitch, rows[0], rows)


def _read_groups(
    fd: int,
    path: str,
    box: BoxRead,
    rows: tuple[int, int],
    rec: FileRecord | None,
    dst: memoryview | None,
    pool: BufferPool,
    *,
    verify: bool,
) -> BoxRows:
    """Rows ``rows`` a row group at a time into ``dst`` or a pooled buffer, each group verified after
    its rows are in (``verify``)."""
    a, b = rows
    out = dst if dst is not None else memoryview(pool.take((b - a) * box.width))
    sink = memoryview(bytearray(box.row_bytes - box.width)) if box.merge else None
    check = rec if box.tiling is not None and verify else None
    asked = [0, 0]
    for g0 in range(a, b, box.group_rows):
        g1 = min(b, g0 + box.group_rows)
        _read_rows(fd, path, box, out, a, (g0, g1), sink, asked)
        if check is not None:
            verify_box(path, box, check, out, box.width, a, (g0, g1))
    return BoxRows(None if dst is not None else out, box.width, asked[0], asked[1])


def _read_rows(
    fd: int,
    path: str,
    box: BoxRead,
    out: memoryview,
    a: int,
    rows: tuple[int, int],
    sink: memoryview | None,
    asked: list[int],
) -> None:
    """Rows ``rows`` of ``box`` into ``out`` (which starts at row ``a``); ``asked`` gets the bytes and
    requests issued."""
    w, rb = box.width, box.row_bytes
    g0, g1 = rows
    at = box.base + g0 * rb + box.col0
    if sink is None:
        for r in range(g0, g1):
            dst = out[(r - a) * w : (r - a + 1) * w]
            got = os.preadv(fd, [dst], at)
            if got != w:  # a short read: finish it (or find the file cut short)
                got += pread_into(fd, [dst[got:]], at + got, w - got)
                check_complete(path, [box.item.fqn], at, at + w, got)
            at += rb
        asked[0] += (g1 - g0) * w
        asked[1] += g1 - g0
        return
    for r0 in range(g0, g1, ROWS_PER_CALL):
        r1 = min(g1, r0 + ROWS_PER_CALL)
        views = []
        for r in range(r0, r1):
            views += [out[(r - a) * w : (r - a + 1) * w], sink]
        want = (r1 - r0 - 1) * rb + w
        start = box.base + r0 * rb + box.col0
        check_complete(path, [box.item.fqn], start, start + want, pread_into(fd, views[:-1], start, want))
        asked[0] += want
        asked[1] += 1


def _stream_into(
    fd: int, path: str, box: BoxRead, rows: tuple[int, int], rec: FileRecord | None, into: Into, pool: BufferPool
) -> BoxRows:
    """Rows ``rows`` of ``box`` in sequential requests of whole row groups (about :data:`STREAM_PIECE_BYTES`
    each, gaps included) into one reused buffer, each piece verified, then copied into ``into``."""
    rb, w = box.row_bytes, box.width
    a, b = rows
    step = max(1, STREAM_PIECE_BYTES // (rb * box.unit_rows)) * box.unit_rows
    buf = memoryview(pool.take(min(b - a, step) * rb))
    check = rec if box.tiling is not None else None
    nbytes = requests = 0
    if b - a > step and hasattr(os, "posix_fadvise"):
        # more than one piece: the kernel starts reading exactly this part's span now, so the later pieces
        # arrive while the first is verified and copied (no read-ahead here: it would read past the part)
        with contextlib.suppress(OSError):  # advice only
            os.posix_fadvise(fd, box.base + a * rb + box.col0, (b - a - 1) * rb + w, os.POSIX_FADV_WILLNEED)
    for p0 in range(a, b, step):
        p1 = min(b, p0 + step)
        start = box.base + p0 * rb + box.col0
        want = (p1 - p0 - 1) * rb + w
        check_complete(path, [box.item.fqn], start, start + want, pread_into(fd, [buf[:want]], start, want))
        nbytes, requests = nbytes + want, requests + 1
        if check is not None:
            verify_box(path, box, check, buf, rb, p0, (p0, p1))
        into.copy(buf, p0, box.col0, (p0, p1), rb)
    pool.give_back(buf)
    return BoxRows(None, w, nbytes, requests)


def _read_span(
    fd: int, path: str, box: BoxRead, rows: tuple[int, int], dst: memoryview | None, pool: BufferPool
) -> BoxRows:
    """Rows ``rows`` of ``box`` as one sequential request -- from the box's first column of the first row
    to its last column of the last, gaps included -- into a pooled buffer; with a ``dst``, the box's
    columns of each row are then copied into it with one strided copy (numpy: no GIL)."""
    w, rb = box.width, box.row_bytes
    r0, r1 = rows
    start = box.base + r0 * rb + box.col0
    want = (r1 - r0 - 1) * rb + w
    buf = memoryview(pool.take(want))
    check_complete(path, [box.item.fqn], start, start + want, pread_into(fd, [buf[:want]], start, want))
    if dst is None:
        return BoxRows(buf, rb, want, 1)
    np.copyto(
        np.ndarray((r1 - r0, w), np.uint8, buffer=dst),
        np.ndarray((r1 - r0, w), np.uint8, buffer=buf, strides=(rb, 1)),
    )
    pool.give_back(buf)  # the arrays over it are gone with the statement above
    return BoxRows(None, w, want, 1)


def verify_box(
    path: str, box: BoxRead, rec: FileRecord, out: memoryview | None, pitch: int, a: int, rows: tuple[int, int]
) -> None:
    """Every tile of rows ``rows`` (whole row groups) inside the box's columns, from ``out`` (rows from row
    ``a`` and the box's first column on, ``pitch`` bytes apart)."""
    if out is None:  # pragma: no cover - callers pass the destination's rows then
        raise CheckpointError(f"{path}: internal: no bytes to verify for {box.item.fqn!r}")
    first = box.base + rows[0] * box.row_bytes
    last = box.base + rows[1] * box.row_bytes
    base, rb = box.base, box.row_bytes

    def digest(start: int, nrows: int, run: int, stride: int) -> int:
        row, col = divmod(start - base, rb)
        return hash_rows(out, (row - a) * pitch + col - box.col0, nrows, run, pitch)

    def in_box(i: int) -> bool:
        return box.col0 <= (unit_rows(rec, i)[0] - base) % rb < box.col1

    verify_blocks(path, rec, first, last, [box.item], digest, blocks=filter(in_box, rec.blocks_covering(first, last)))
