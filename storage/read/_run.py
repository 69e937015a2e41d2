"""One ``read_data`` call carried out: planned requests run on worker threads, results delivered to the
planner on the calling thread.

Work is one stream of tasks: buffered requests under 1 MiB first (a small read queued behind large
ones waits for them), then each file's tasks in offset order with the files read side by side (the
next task from the file with the fewest bytes issued), each file's last requests tapered so that
verifying them overlaps other reads. Task kinds:

* :class:`~smpckpt.storage.read._plan.FetchTask`: a coalesced request into a pooled buffer; once read
  and verified, each of its items is decoded and copied into its destination (``commit_tensor`` /
  ``load_bytes``).
* :class:`_DirectBatch`: consecutive pieces (about 16 MiB each) of direct items, read straight into
  their destinations with one request of up to ``max_request_bytes`` and verified by the worker that
  read them; an item is committed when its last piece is done (:class:`_OpenItem` counts them down).
* :class:`_BoxPart`: whole row groups of a column slice on local disk (about 16 MiB each, so several
  threads share a slice), a request per row (or per run of close rows), or sequential spans of whole
  rows where the planner's cost model says so (``_plan.streams``), columns copied out (``_fetch.read_box``);
  on object stores, a slice past ``max_request_bytes``: a span of whole row groups of at most that
  many bytes per part and request (a row group past it: runs of the slice's column groups,
  ``_remote_box``), verified, its columns copied into the destination on the worker.

A direct candidate whose destination turns out unsuitable (other dtype, strided, not on the CPU) is
read as a buffered fetch instead, in parts of whole check units (:class:`_FetchPart`) when it is larger
than ``max_request_bytes``. At most ``2 * thread_count`` tasks are in flight, so the planner is
asked for destinations only shortly before their bytes are read. ``reads_in_flight`` below
``thread_count`` lets that many workers read at a time, in the stream's order (:class:`InOrder`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import heapq
import io
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner

from smpckpt.errors import CheckpointCorrupt, CheckpointError, LayoutMismatch
from smpckpt.storage.backends._fs import is_local, join
from smpckpt.storage.format._columns import Into
from smpckpt.storage.format._reading import Fetch, c_strides, range_boxes
from smpckpt.storage.format._safe_pickle import MEMO_BYTES, ViewFile, check_weights_only
from smpckpt.storage.format._staging import DeviceCopies, in_place
from smpckpt.storage.format.manifest import FileRecord
from smpckpt.storage.read._fetch import BoxRows, BufferPool, DirectPart, read_box, read_direct, read_range
from smpckpt.storage.read._plan import (
    PIECE_BYTES,
    BoxRead,
    DirectCandidate,
    FetchTask,
    Item,
    ReadPlan,
    box_destination,
    item_destination,
    pieces,
    writable_bytes,
)
from smpckpt.storage.read._remote_box import fetch_rows

if TYPE_CHECKING:
    from smpckpt.storage.read.reader import FsspecStorageReader

__all__ = ["ReadRun", "InOrder", "ReadAborted"]


class ReadAborted(RuntimeError):
    """A read waiting for its turn was given up because an earlier one failed."""


class InOrder:
    """Admits reads in ticket order (0, 1, 2, ...), at most ``depth`` at once (``reads_in_flight``: for
    devices that punish concurrent streams; verification overlaps the next read). Thread-safe.

    Tickets are handed out on the calling thread in submission order and tasks run FIFO on the pool,
    so the lowest waiting ticket is always held by a running worker: no wait can block forever unless a
    ticket is never used -- :meth:`abort` (on any failure) releases every waiter with
    :class:`ReadAborted`.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"reads in flight must be >= 1, got {depth}")
        self.depth = depth
        self._next = 0
        self._active = 0
        self._aborted = False
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def turn(self, ticket: int) -> Iterator[None]:
        with self._cv:
            while not self._aborted and (self._next != ticket or self._active >= self.depth):
                self._cv.wait()
            if self._aborted:
                raise ReadAborted("an earlier read of this load failed")
            self._next += 1
            self._active += 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def abort(self) -> None:
        with self._cv:
            self._aborted = True
            self._cv.notify_all()


@dataclasses.dataclass
class _OpenItem:
    """A direct item being read: committed to the planner when its last piece is verified."""

    item: Item
    target: torch.Tensor
    pieces_left: int


@dataclasses.dataclass(frozen=True)
class _DirectBatch:
    """Consecutive pieces of direct items in ``file`` (each piece's ``lo`` is the previous one's ``hi``),
    read with one request; ``entries[i]`` is the open item of ``parts[i]``."""

    file: str
    entries: tuple[_OpenItem, ...]
    parts: tuple[DirectPart, ...]
    scattered: bool = False  #: see FetchTask.scattered

    @property
    def nbytes(self) -> int:
        return self.parts[-1].hi - self.parts[0].lo


@dataclasses.dataclass(frozen=True)
class _BoxPart:
    """Rows ``[a, b)`` of a box (whole row groups), read into ``dst`` (the destination's own rows, when it
    takes the box's bytes as they are) or a pooled buffer; ``entry`` is the box's item."""

    box: BoxRead
    rows: tuple[int, int]
    entry: _OpenItem
    dst: memoryview | None
    nbytes: int  #: bytes the part will request (orders the work; _complete counts what was asked)
    into: Into | None = None  #: a streamed box's destination, whole (see _columns.Into)

    @property
    def file(self) -> str:
        return self.box.file


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FetchPart(FetchTask):
    """Whole check units of an item too large for one request whose destination cannot take its bytes as
    they are (``fetch.needs``: that item alone); ``entry`` commits the item after its last part."""

    entry: _OpenItem


_Task = FetchTask | _DirectBatch | _BoxPart

# buffered requests below this size are issued before every larger one (see ReadRun._interleaved)
SMALL_FIRST = 1 << 20
# the tapered tail's smallest requests (see ReadRun._batched)
TAPER_FLOOR = PIECE_BYTES
#: a streamed column slice's parts (bytes of whole rows): smaller than PIECE_BYTES so the threads share
#: the work evenly (measured faster warm, the same cold)
STREAM_PART_BYTES = 8 << 20


class ReadRun:
    """Carries out one :class:`~smpckpt.storage.read._plan.ReadPlan`; ``read_per_file`` and
    ``requests`` count what it asked storage for (see :class:`~smpckpt.storage.format._reading.ReadStats`).
    Single use; holds buffers and destinations only while :meth:`run` runs."""

    def __init__(self, reader: FsspecStorageReader, planner: LoadPlanner, max_request_bytes: int) -> None:
        """``reader``'s location, records, checks and threads; requests of up to ``max_request_bytes``."""
        self.fs, self.folder, self.planner = reader.fs, reader.path, planner
        self.local = is_local(self.fs)
        # records to verify against (none when verification is off)
        self.records: Mapping[str, FileRecord] = reader._records if reader.verify_checksums else {}
        self.allow_pickle = reader.allow_pickle
        self.thread_count = thread_count = reader.thread_count
        self.max_request_bytes = max_request_bytes
        depth = reader.reads_in_flight or thread_count
        # None: every worker reads when it gets to its task (object stores reward concurrency)
        self.gate = InOrder(depth) if depth < thread_count else None
        # buffers sized to the request (rounded up to 1 MiB), not to the largest request: a load of small
        # records must not zero-fill 64 MiB buffers
        self.pool = BufferPool(min_size=1 << 20, max_kept=2 * thread_count)
        self.requests = 0
        self.read_per_file: dict[str, int] = {}
        self._checked: set[bytes] = set()  # small object bytes found weights-only-safe (same bytes, same answer)
        # destinations not filled in place (CUDA) are copied to through a pool of pinned buffers
        self.copies = DeviceCopies(reader.staging_bytes)

    def run(self, plan: ReadPlan) -> None:
        try:
            self._run(plan)
        finally:
            # buffers are reused within one read_data call only: a reader kept by the caller (or by a
            # failed load's traceback) must not keep up to 2 * thread_count 64 MiB buffers alive
            self.pool.clear()
            self.copies.close()  # every copy to a device done before the load returns

    def _run(self, plan: ReadPlan) -> None:
        for it in plan.empty:
            self._deliver(it, memoryview(b""))
        with concurrent.futures.ThreadPoolExecutor(self.thread_count, thread_name_prefix="smpckpt-read") as pool:
            pending: dict[concurrent.futures.Future[Any], _Task] = {}
            todo = self._interleaved(plan)
            tickets = 0  # submission order = the order reads start in (FIFO pool, InOrder gate)
            try:
                while True:
                    while len(pending) < 2 * self.thread_count:
                        task = next(todo, None)
                        if task is None:
                            break
                        pending[pool.submit(self._execute, task, tickets)] = task
                        tickets += 1
                    if not pending:
                        break
                    done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                    for f in done:
                        self._complete(pending.pop(f), f.result())
            except BaseException:
                # workers waiting for a turn that will never come must not hang the pool's shutdown
                if self.gate is not None:
                    self.gate.abort()
                raise
            finally:
                for f in pending:
                    f.cancel()

    def _interleaved(self, plan: ReadPlan) -> Iterator[_Task]:
        """(calling thread) Every task: each file's in offset order, the files read side by side, the next
        task always from the file with the fewest bytes issued so far (workers reading neighbouring
        requests of one file at once measured slower on a cold disk)."""
        work: list[FetchTask | DirectCandidate | BoxRead] = [*plan.fetches, *plan.direct, *plan.boxes]
        # buffered fetches before direct candidates at the same offset (stable: plan order otherwise)
        work.sort(key=_work_key)
        # small requests first: the writer puts small tensors at the end of each file, and a small read
        # queued behind large ones waits for them at the end of a load
        small: list[FetchTask | DirectCandidate | BoxRead] = []
        by_file: dict[str, list[FetchTask | DirectCandidate | BoxRead]] = {}
        for w in work:
            if isinstance(w, FetchTask) and w.nbytes < SMALL_FIRST:
                small.append(w)
            else:
                by_file.setdefault(w.file, []).append(w)
        yield from self._tasks(small)
        # (bytes issued, file order, task stream): ties go to the earlier file, so one file reads as before
        heap = [
            (0, n, self._batched(self._tasks(ws), sum(w.nbytes for w in ws))) for n, ws in enumerate(by_file.values())
        ]
        while heap:
            issued, n, stream = heap[0]
            task = next(stream, None)
            if task is None:
                heapq.heappop(heap)
                continue
            heapq.heapreplace(heap, (issued + task.nbytes, n, stream))
            yield task

    def _tasks(self, work: list[FetchTask | DirectCandidate | BoxRead]) -> Iterator[_Task]:
        """(calling thread) The tasks of ``work`` (one file's, in offset order); a direct candidate's
        destination is resolved when its turn comes.

        A candidate whose destination cannot take the stored bytes in place (a CUDA tensor; every
        destination under the CPU stand-in) is read into a pooled buffer instead; such candidates that
        follow each other in the file share one request within ``max_request_bytes`` and, as in
        :meth:`_batched`, half the file's bytes not yet handed out (at least :data:`TAPER_FLOOR`). The
        request is ``scattered`` as the candidate reaching its end is. One larger than ``max_request_bytes``
        is read in parts (:meth:`_fetch_parts`), not into a buffer of its size."""
        held: FetchTask | None = None  # buffered candidates not yet handed out, merged so far
        left = sum(w.nbytes for w in work)  # bytes of this file's work not yet handed out

        def handed(task: _Task) -> _Task:
            nonlocal left
            left -= task.nbytes
            return task

        for w in work:
            if not isinstance(w, DirectCandidate):
                if held is not None:
                    yield handed(held)
                    held = None
                if isinstance(w, FetchTask):
                    self._add(w.file, w.nbytes, 1)
                    yield handed(w)
                else:
                    for part in self._box_parts(w):
                        yield handed(part)
                continue
            need = w.need
            target = self.planner.resolve_tensor(need.item.req).detach()
            dst = writable_bytes(need.item, target) if in_place(target) else None
            if dst is None and need.end - need.start <= self.max_request_bytes:  # not in place (larger: parts)
                f = held.fetch if held is not None else None
                if held is not None and f is not None and f.start <= need.start <= f.end:
                    end = max(f.end, need.end)  # widened neighbours may share a check block
                    if end - f.start <= min(self.max_request_bytes, max(TAPER_FLOOR, left // 2)):
                        self._add(w.file, end - f.end, 0)
                        if need.end > f.end:
                            scattered = w.scattered
                        else:
                            scattered = held.scattered or (need.end == f.end and w.scattered)
                        held = FetchTask(w.file, Fetch(f.start, end, (*f.needs, need)), scattered)
                        continue
                if held is not None:
                    yield handed(held)
                self._add(w.file, w.nbytes, 1)
                held = FetchTask(w.file, Fetch(need.start, need.end, (need,)), w.scattered)
                continue
            if held is not None:
                yield handed(held)
                held = None
            yield from map(handed, self._fetch_parts(w, target) if dst is None else self._direct(w, target, dst))
        if held is not None:
            yield handed(held)

    def _direct(self, w: DirectCandidate, target: torch.Tensor, dst: memoryview) -> list[_Task]:
        """(calling thread) A candidate read straight into its destination's bytes ``dst``, in pieces."""
        need = w.need
        spans = pieces(self.records.get(w.file), need.start, need.end)
        entry = _OpenItem(need.item, target, len(spans))
        self._add(w.file, need.end - need.start, 0)  # requests counted per batch (_batched)
        return [_DirectBatch(w.file, (entry,), (DirectPart(need.item, dst, lo, hi),), w.scattered) for lo, hi in spans]

    def _fetch_parts(self, w: DirectCandidate, target: torch.Tensor) -> list[_Task]:
        """(calling thread) A candidate larger than ``max_request_bytes`` whose destination cannot take its
        bytes in place, as parts of whole check units (each cut between elements of the item) of at most
        :data:`PIECE_BYTES` and that: a CUDA load or strided merge never buffers the whole piece."""
        need, it = w.need, w.need.item
        if it.dtype is None or target.size() != torch.Size([int(n) for n in it.req.lengths]):
            raise LayoutMismatch(
                f"{it.fqn!r}: destination {list(target.size())} vs stored slice {list(it.req.lengths)}"
            )
        limit, isz = min(PIECE_BYTES, self.max_request_bytes), it.dtype.itemsize
        rec = self.records.get(w.file)
        if rec is not None:
            ends = (rec.block_ends[i] for i in rec.blocks_covering(need.start, need.end))
            cuts = [e for e in ends if it.start < e < it.end and (e - it.start) % isz == 0 and rec.is_cut(e)]
        else:  # not verified: the item's own bytes, cut anywhere between elements
            cuts = list(range(it.start + limit - limit % isz, it.end, max(isz, limit - limit % isz)))
        spans, start, last = [], need.start, need.start
        for c in [*cuts, need.end]:
            if c - start > limit and last > start:
                spans.append((start, last))
                start = last
            last = c
        spans.append((start, need.end))
        entry = _OpenItem(it, target, len(spans))
        self._add(w.file, need.end - need.start, len(spans))
        # only the last part can be followed by bytes this load does not read
        return [
            _FetchPart(w.file, Fetch(lo, hi, (need,)), w.scattered and hi == need.end, entry=entry) for lo, hi in spans
        ]

    def _box_parts(self, box: BoxRead) -> Iterator[_BoxPart]:
        """(calling thread) A box's tasks: whole row groups of about :data:`PIECE_BYTES` each, so several
        threads read one column slice (its rows' requests are small: one thread in a row of them leaves
        the device, and the other cores, idle), each part committed when all are done."""
        target = self.planner.resolve_tensor(box.item.req).detach()
        dst = box_destination(box, target) if in_place(target) else None
        # a streamed part (any part on an object store) copies the item's columns straight into its
        # destination on the worker
        copied = box.stream or not self.local
        into = item_destination(box, target) if copied and dst is None and in_place(target) else None
        # on object stores a streamed part is one request (S3 charges by the request), of up to
        # max_request_bytes; rows a request each go in parts of about PIECE_BYTES, spread over the threads
        if self.local:
            chunks = box.chunks(STREAM_PART_BYTES if box.stream else PIECE_BYTES)
        else:
            chunks = box.chunks(self.max_request_bytes if box.stream else min(PIECE_BYTES, self.max_request_bytes))
        entry = _OpenItem(box.item, target, len(chunks))
        for a, b in chunks:
            # bytes to order the work by; what was asked of storage is counted when done (_complete)
            nbytes, _ = box.requested(a, b)
            rows = dst[(a - box.row0) * box.width : (b - box.row0) * box.width] if dst is not None else None
            yield _BoxPart(box, (a, b), entry, rows, nbytes, into)

    def _batched(self, tasks: Iterator[_Task], total: int) -> Iterator[_Task]:
        """(calling thread) Direct pieces that follow each other in one file's ``tasks`` (``total`` bytes)
        merged into one request of up to ``max_request_bytes``, and up to half the bytes left in the file.

        Tapering lets the hashing of a file's last requests overlap other reads; halving keeps the
        request count logarithmic in the tail."""
        held: _DirectBatch | None = None
        left = total  # bytes of this file not yet handed out
        for task in tasks:
            if (
                held is not None
                and isinstance(task, _DirectBatch)
                and task.parts[0].lo == held.parts[-1].hi
                and held.nbytes + task.nbytes <= min(self.max_request_bytes, max(TAPER_FLOOR, left // 2))
            ):
                # what follows the merged request is what follows ``task`` (it starts where ``held`` ends)
                scattered = task.scattered
                held = _DirectBatch(held.file, held.entries + task.entries, held.parts + task.parts, scattered)
                continue
            if held is not None:
                self.requests += 1
                left -= held.nbytes
                yield held
                held = None
            if isinstance(task, _DirectBatch):
                held = task
            else:
                left -= task.nbytes
                yield task
        if held is not None:
            self.requests += 1
            yield held

    def _add(self, file: str, nbytes: int, requests: int) -> None:
        self.requests += requests
        self.read_per_file[file] = self.read_per_file.get(file, 0) + nbytes

    def _execute(self, task: _Task, ticket: int) -> memoryview | BoxRows | None:
        """(worker thread) Read the task's bytes when its turn comes, then verify them."""
        path = join(self.folder, task.file)
        rec = self.records.get(task.file)
        turn = self.gate.turn(ticket) if self.gate is not None else None
        if isinstance(task, FetchTask):
            f = task.fetch
            items = [n.item for n in f.needs]
            return read_range(self.fs, path, f.start, f.end, items, rec, self.pool, turn, task.scattered)
        if isinstance(task, _BoxPart):
            if not self.local:
                cap, box = self.max_request_bytes, task.box
                return fetch_rows(self.fs, path, box, task.rows, rec, self.pool, cap, task.dst, task.into, turn)
            return read_box(path, task.box, task.rows, rec, task.dst, self.pool, turn, task.into)
        read_direct(self.fs, path, task.parts, rec, turn, task.scattered)
        return None

    def _complete(self, task: _Task, data: memoryview | BoxRows | None) -> None:
        """(calling thread) Hand a finished task's items to the planner."""
        if isinstance(task, _DirectBatch):
            for entry in task.entries:
                self._count_down(entry)
            return
        if isinstance(task, _BoxPart):
            if not isinstance(data, BoxRows):  # pragma: no cover - _execute returns one for a box part
                raise CheckpointError(f"internal: box part of {task.box.item.fqn!r} returned {type(data)}")
            self._add(task.file, data.nbytes, data.requests)
            if data.data is not None:
                self._deliver_rows(task, data.data, data.pitch)
                self.pool.give_back(data.data)
            self._count_down(task.entry)
            return
        if not isinstance(data, memoryview):  # pragma: no cover - _execute returns the buffer of a fetch
            raise CheckpointError(f"internal: fetch of {task.file} returned {type(data)}")
        if isinstance(task, _FetchPart):
            self._deliver_part(task, data)
            self.pool.give_back(data)
            self._count_down(task.entry)
            return
        f = task.fetch
        kept = False
        for need in f.needs:
            it = need.item
            kept |= self._deliver(it, data[it.start - f.start : it.end - f.start])
        if not kept:  # every view of it (and tensors made from them) is gone now
            self.pool.give_back(data)

    def _count_down(self, entry: _OpenItem) -> None:
        entry.pieces_left -= 1
        if entry.pieces_left == 0:
            self.planner.commit_tensor(entry.item.req, entry.target)

    def _deliver_rows(self, part: _BoxPart, data: memoryview, pitch: int) -> None:
        """The item's rows among a box part's (rows ``[a, b)`` from the box's first column on, ``pitch``
        bytes apart in ``data``) copied into their place in the destination."""
        box, (a, b) = part.box, part.rows
        r0, r1, c0 = box.item_rows()
        lo, hi = max(a, r0), min(b, r1)
        if hi <= lo:
            return
        src = _decode_raw(box.item, data[(lo - a) * pitch + c0 - box.col0 :], pitch, hi - lo)
        dst = part.entry.target.narrow(0, lo - r0, hi - lo)
        if dst.size() != src.size():
            raise LayoutMismatch(f"{box.item.fqn!r}: destination {list(dst.size())} vs stored rows {list(src.size())}")
        self.copies.copy(dst, src)

    def _deliver_part(self, part: _FetchPart, data: memoryview) -> None:
        """The item's elements among a part's bytes (``data``, from ``part.fetch.start``) copied into their
        place in the destination, a box at a time (a partial row, whole rows, a partial row)."""
        it, f, target = part.entry.item, part.fetch, part.entry.target
        a, b = max(f.start, it.start), min(f.end, it.end)
        flat = _flat(data[a - f.start : b - f.start], it)
        pos, first = 0, (a - it.start) // flat.element_size()
        for offsets, lengths in range_boxes([int(n) for n in it.req.lengths], first, first + flat.numel()):
            dst = target[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
            self.copies.copy(dst, flat[pos : pos + dst.numel()].view(lengths))
            pos += dst.numel()

    def _deliver(self, it: Item, data: memoryview) -> bool:
        """Hand one item to the planner; True when it may keep a view of ``data`` (never reuse its buffer)."""
        req, planner = it.req, self.planner
        where = f"{join(self.folder, it.file)} key {it.fqn!r} at offset {it.start}"
        if req.type == LoadItemType.BYTE_IO:
            # A planner that unpickles weights-only itself (ParallelLoadPlanner) needs no trial load here:
            # each object crosses the unpickler once. Stock planners unpickle with weights_only=False.
            # An optimizer's hyper-parameters are thousands of copies of a few small blobs: as bytes, each
            # checked once; a larger record is read from its read buffer as it is (no copy: a 512 MiB
            # user_content took 0.23 s to copy), which the planner may keep (a resume's user_content). A
            # record of less than half its buffer is copied out, and the buffer goes back to the pool: kept,
            # its view pinned the whole request (up to max_request_bytes) for a few KiB (rev69b)
            small = bytes(data) if data.nbytes <= MEMO_BYTES else None
            base = data.obj
            copied = small is None and isinstance(base, (bytes, bytearray)) and 2 * data.nbytes < len(base)
            if copied:
                data = memoryview(bytearray(data))
            if not self.allow_pickle and not getattr(planner, "loads_weights_only", False):
                if small is None or small not in self._checked:
                    check_weights_only(data if small is None else small, where=where)
                if small is not None:
                    self._checked.add(small)
            planner.load_bytes(req, io.BytesIO(small) if small is not None else ViewFile(data))  # type: ignore[arg-type]
            return small is None and not copied
        if it.raw:
            target = planner.resolve_tensor(req).detach()
            dst = writable_bytes(it, target) if in_place(target) else None
            if dst is not None and data.nbytes >= dst.nbytes:
                # stored as the destination holds it: one copy, and no torch call per item (each
                # queues for the GIL behind the reader threads; see _tensor_bytes)
                dst[:] = data[: dst.nbytes]
                planner.commit_tensor(req, target)
                return False
            src = _decode_raw(it, data)
        else:
            try:
                loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any decode failure means bad bytes
                raise CheckpointCorrupt(f"{where}: cannot decode tensor record: {exc}") from exc
            src = loaded
            for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, off, n)
            target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise LayoutMismatch(f"{it.fqn!r}: destination {list(target.size())} vs stored slice {list(src.size())}")
        self.copies.copy(target, src)
        planner.commit_tensor(req, target)
        return False


def _work_key(w: FetchTask | DirectCandidate | BoxRead) -> tuple[str, int, int]:
    if isinstance(w, FetchTask):
        return (w.file, w.fetch.start, 0)
    if isinstance(w, DirectCandidate):
        return (w.file, w.need.start, 1)
    return (w.file, w.start, 2)


def _decode_raw(it: Item, data: memoryview, row_bytes: int = 0, rows: int | None = None) -> torch.Tensor:
    """The requested slice as a tensor over ``data`` (which starts at the slice's first element); rows
    (dim 0) are ``row_bytes`` apart in ``data`` when given (a box read), else as stored; only the first
    ``rows`` rows of the slice when given (a part of a box)."""
    lengths = [int(n) for n in it.req.lengths]
    if rows is not None:
        lengths[0] = rows
    if any(n == 0 for n in lengths):
        return torch.empty(lengths, dtype=it.dtype)
    flat = _flat(data, it)
    if not it.chunk_sizes:
        return flat.reshape(())
    # data starts at the slice's first element: index the chunk's strides from there
    strides = c_strides(it.chunk_sizes)
    if row_bytes:
        strides[0] = row_bytes // flat.element_size()
    return flat.as_strided(lengths, strides)


def _flat(data: memoryview, it: Item) -> torch.Tensor:
    """``data`` as a flat tensor of the raw item's dtype."""
    dtype = it.dtype
    if dtype is None:  # pragma: no cover - raw items always carry one (raw_item)
        raise CheckpointError(f"internal: raw record of {it.fqn!r} has no dtype")
    with warnings.catch_warnings():
        # read-only buffers (bytes from object stores) are only read from here, never written
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:
        # Records are packed back to back, so an item can start at any byte offset of the buffer; torch
        # copies some dtypes assuming their alignment (complex128: SIGSEGV, measured), so move it first.
        raw = raw.clone()  # a fresh allocation: aligned for every dtype
    return raw.view(dtype)
