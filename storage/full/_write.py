"""Full (consolidated) mode, writing: every rank's shard bytes into the artifact's files, by one of two
algorithms chosen by the storage (``FullArtifactWriter``), and the object values (one small file each,
written by the rank that holds them).

**POSIX filesystems**: the coordinator creates every file at its final size with its header
(:func:`create_files`), then every rank ``pwrite``\\ s its boxes in place (:meth:`_RankWriter.run`;
column shards with short rows are first swapped into blocks of whole rows, ``_exchange``), hashing
each check unit from the same buffer.

**Object stores**: every file has an owner rank (round-robin) that streams it front to back
(:func:`gather_rank`), assembling tensor by tensor from its own boxes and those the other ranks send.
Every rank walks the same global order of boxes (file, tensor offset, sending rank), so each send meets
its receive: no deadlock. An owner holds one tensor (plus one received box) at a time. The sink borrows
what it is given: none of it changes before the sink's commit. Why two: README, "Full checkpoints".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.errors import no_data, not_plain
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._sinks import Sink, write_back
from smpckpt.storage.format._check_units import ItemChecks, item_checks
from smpckpt.storage.format._checksum import BlockHasher, hash_bytes
from smpckpt.storage.format._reading import box_runs, cpu_bytes, range_boxes, split_box
from smpckpt.storage.format._staging import HostBuffer, Stage, Stages, Ticket, copy_chunks, settle, stage_kind
from smpckpt.storage.full._exchange import Block, Swapper, batches, global_rank, paste
from smpckpt.storage.full._source import ArtifactFile, FullWrite, RankFullData
from smpckpt.storage.full._units import BoxUnits, unit_extent
from smpckpt.storage.write._pipeline import chunk_bytes

__all__ = ["create_files", "gather_rank", "write_objects", "box_buffer", "box_view", "box_units", "unit_digests"]
__all__ += ["ObjectResult"]

log = logging.getLogger(__name__)

#: contiguous runs at least this long start their writeback as soon as they are written (256 KiB
#: measured best among 8 KiB .. 8 MiB on local disk)
_FLUSH_RUN = 256 << 10


class ObjectResult(tuple):
    """``(file name, size, digest)`` of one object file."""


def create_files(folder: Folder, files: Sequence[ArtifactFile], *, sync: bool) -> None:
    """(coordinator, before any rank writes) Each file created in this save's staging folder at its final
    size with its header; the rest is holes that the tiling check guarantees some rank fills."""
    for f in files:
        folder.create_sized(f.name, f.size, f.pieces, sync=sync)


def chunk_of(planner: SavePlanner, item: WriteItem, *, cpu: bool = True) -> torch.Tensor:
    """The item's tensor, detached, in global-view coordinates; on the CPU unless ``cpu=False``."""
    tensor = planner.resolve_data(item)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{item.index.fqn!r}: expected a tensor, the planner gave {type(tensor).__name__}")
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.is_nested:  # DCP's own planner
        raise not_plain(item.index.fqn, tensor)
    if tensor.is_meta:
        raise no_data(item.index.fqn, tensor)
    chunk = tensor.detach().cpu() if cpu else tensor.detach()
    td = item.tensor_data
    return chunk.reshape(tuple(td.chunk.sizes)) if td is not None else chunk


def box_view(chunk: torch.Tensor, w: FullWrite) -> torch.Tensor:
    """The write's box of ``chunk`` in the artifact's axis order (shape ``w.sizes``): a view, no copy."""
    sub = chunk
    dest_sizes = [w.sizes[p] for p in w.perm]
    for d, (o, n) in enumerate(zip(w.dest_offsets, dest_sizes)):
        if o or n != sub.shape[d]:
            sub = sub.narrow(d, o, n)
    inverse = sorted(range(len(w.perm)), key=w.perm.__getitem__)  # permute(inverse) undoes permute(perm)
    return sub.permute(inverse) if list(w.perm) != sorted(w.perm) else sub


def box_buffer(chunk: torch.Tensor, w: FullWrite) -> memoryview:
    """The write's box as contiguous row-major bytes of the artifact dtype (a copy where needed)."""
    box = box_view(chunk, w)
    if box.dtype != w.dtype:
        box = box.to(w.dtype)
    mv = cpu_bytes(box.contiguous())
    if mv is None:
        raise TypeError(f"{w.key!r}: cannot take the bytes of a {box.dtype} box of shape {list(box.shape)}")
    return mv


def _put(fd: int, w: FullWrite, buf: memoryview) -> None:
    """The box's row-major bytes to its place in the file: one ``pwrite`` per contiguous run."""
    itemsize = w.dtype.itemsize
    starts, run = box_runs(w.view, w.offsets, w.sizes, itemsize)
    pos = 0
    for s in starts.tolist():
        n = os.pwrite(fd, buf[pos : pos + run], w.start + s)
        while n < run:  # pwrite may write less than asked (signals, some filesystems)
            n += os.pwrite(fd, buf[pos + n : pos + run], w.start + s + n)
        pos += run
    if run >= _FLUSH_RUN:
        # Start writeback now, so the final flush waits for less; not for short runs, whose pages other
        # ranks' columns dirty again (measured 1.5x slower).
        for s in starts.tolist():
            write_back(fd, w.start + s, run, wait=False)


def box_units(w: FullWrite, check_block: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], ItemChecks]:
    """The check units of one box: their offsets and sizes, and how a
    :class:`~smpckpt.storage.format._checksum.BlockHasher` fed the box's row-major bytes cuts them (slices
    along dim 0, or tiles for wide rows as :func:`~._check_units.item_checks` cuts records)."""
    itemsize = w.dtype.itemsize
    checks = item_checks(w.sizes, itemsize, check_block)
    offsets: list[tuple[int, ...]] = []
    sizes: list[tuple[int, ...]] = []
    if checks.groups > 1:
        rows = w.sizes[0]
        width = w.sizes[1] // checks.groups
        for r0 in range(0, rows, checks.rows_per_group):
            n = min(checks.rows_per_group, rows - r0)
            for g in range(checks.groups):
                offsets.append((w.offsets[0] + r0, w.offsets[1] + g * width, *w.offsets[2:]))
                sizes.append((n, width, *w.sizes[2:]))
        return offsets, sizes, checks
    for lo, size in split_box(w.offsets, w.sizes, itemsize, checks.unit):
        offsets.append(tuple(lo))
        sizes.append(tuple(size))
    # slices of one size (the last may be shorter), back to back in the box's row-major bytes: blocks
    unit = max(1, math.prod(sizes[0]) * itemsize) if sizes else 1
    return offsets, sizes, ItemChecks(unit)


def unit_digests(w: FullWrite, buf: memoryview, check_block: int) -> BoxUnits:
    """The check units of one box, hashed from its row-major bytes (see :func:`box_units`)."""
    hasher = _BoxHasher(w, check_block)
    hasher.update(buf)
    return hasher.finish()


class _BoxHasher:
    """A box's check units hashed as its row-major bytes stream in, in any pieces (a staged box comes
    a buffer at a time); tiles of whole row groups each in one gathered hash (``hash_rows``)."""

    def __init__(self, w: FullWrite, check_block: int) -> None:
        self.w = w
        self.offsets, self.sizes, self.checks = box_units(w, check_block)
        self.nbytes = math.prod(w.sizes) * w.dtype.itemsize
        self.hasher = BlockHasher(check_block)
        self.hasher.start_item(self.nbytes, self.checks)

    def update(self, data: memoryview) -> None:
        if len(data):
            self.hasher.update(data)

    def finish(self) -> BoxUnits:
        _, digests = self.hasher.finish()
        if not self.nbytes:
            digests = [hash_bytes(b"")] * len(self.offsets)  # empty units, one per slice
        if len(digests) != len(self.offsets):
            raise RuntimeError(f"{self.w.key!r}: {len(digests)} digests for {len(self.offsets)} check units")
        return BoxUnits.pack(self.w.key, self.w.view, self.offsets, self.sizes, digests)


def _flush(fds: dict[str, int], writes: Sequence[FullWrite]) -> None:
    """Make this rank's bytes reach the disk before it reports success. On Linux each rank writes back and
    waits for the spans of its own boxes (``sync_file_range``, every span submitted before the first wait),
    and the coordinator fsyncs each file once before the commit: no rank waits on the others' pages.
    Elsewhere: fsync."""
    spans: dict[str, tuple[int, int]] = {}  # per file, the byte span [lo, hi) covering this rank's boxes
    for w in writes:
        ext = unit_extent(w.view, w.offsets, w.sizes, w.dtype.itemsize, ())
        if ext is not None:
            lo, hi = spans.get(w.file, (w.start + ext[0], 0))
            spans[w.file] = (min(lo, w.start + ext[0]), max(hi, w.start + ext[1]))
    for name, fd in fds.items():
        lo, hi = spans.get(name, (0, 1))  # never length 0: sync_file_range reads it as "to the end"
        write_back(fd, lo, hi - lo, wait=False)
    for name, fd in fds.items():
        lo, hi = spans.get(name, (0, 1))
        if not write_back(fd, lo, hi - lo, wait=True):
            os.fsync(fd)


class _RankWriter:
    """One rank's tensor writes: whole files per thread, plus its swaps in one more thread."""

    def __init__(
        self, folder: Folder, data: RankFullData, items: Sequence[WriteItem], planner: SavePlanner, stages: Stages
    ) -> None:
        self.data, self.items, self.planner, self.stages = data, items, planner, stages
        self.by_item: dict[Any, list[FullWrite]] = {}
        for w in data.writes:
            self.by_item.setdefault(w.item, []).append(w)
        self.item_of = {it.index: it for it in items}
        self.per_file: dict[str, list[WriteItem]] = {}
        for it in items:
            ws = self.by_item.get(it.index)
            if ws:
                self.per_file.setdefault(ws[0].file, []).append(it)
        names = {w.file for w in data.writes} | {w.file for e in data.exchanges for _, w in e.boxes}
        self.fds: dict[str, int] = {}
        try:
            for name in sorted(names):
                self.fds[name] = folder.open_for_write(name)  # created by this save's coordinator
        except BaseException:
            self.close()
            raise
        self.done: dict[Any, tuple[int, list[BoxUnits]]] = {}
        self.done_lock = threading.Lock()
        self.blocks: list[FullWrite] = []

    def __enter__(self) -> _RankWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def _record(self, index: Any, nbytes: int, units: list[BoxUnits]) -> None:
        with self.done_lock:
            n, us = self.done.get(index, (0, []))
            self.done[index] = (n + nbytes, us + units)

    def _write_file(self, name: str) -> None:
        """Each box of the file's items written in place when the tensor's memory is its row-major bytes of the
        artifact dtype, else staged a buffer at a time through the save's pool (device-to-host, transpose,
        cast), each chunk written and hashed while the next is copied: extra memory stays within the pool."""
        for item in self.per_file[name]:
            # one call per item: a tensor made for the export (consolidate's, read whole) dies on return,
            # before the next is resolved, so a file's thread holds one at a time, not two
            self._write_item(item)

    def _write_item(self, item: WriteItem) -> None:
        chunk = chunk_of(self.planner, item, cpu=False)  # the planner resolves each item once
        for w in self.by_item[item.index]:
            box = box_view(chunk, w)
            own = cpu_bytes(box) if box.dtype == w.dtype and box.device.type == "cpu" else None
            kind = stage_kind(box, in_place=own is not None)
            if kind is None and own is not None:
                _put(self.fds[w.file], w, own)
                self._record(item.index, own.nbytes, [unit_digests(w, own, self.data.check_block)])
            else:
                units = self._stage_box(w, box, self.stages.get(box, kind or "host"))
                self._record(item.index, math.prod(w.sizes) * w.dtype.itemsize, [units])

    def _stage_box(self, w: FullWrite, box: torch.Tensor, stage: Stage) -> BoxUnits:
        """One box through ``stage``: a buffer's worth of elements at a time (whole row groups of a tiled box),
        copied with the cast into pool buffers, each written and hashed while the next is copied."""
        pool, itemsize = stage.pool, w.dtype.itemsize
        hasher = _BoxHasher(w, self.data.check_block)
        step = max(1, chunk_bytes(pool.buffer_bytes, hasher.checks) // itemsize)
        numel = math.prod(w.sizes)
        fd = self.fds[w.file]
        pending: tuple[HostBuffer, Ticket, int, int] | None = None  # (buffer, its copies, first, last)

        def finish_pending() -> None:
            """The pending buffer written and hashed, then back to the pool."""
            nonlocal pending
            if pending is None:
                return
            (buf, ticket, first, last), pending = pending, None
            try:
                ticket.wait()
                pos = 0
                for rel, sizes in range_boxes(w.sizes, first, last):
                    n = math.prod(sizes) * itemsize
                    part = buf.view[pos : pos + n]
                    sub = dataclasses.replace(w, offsets=tuple(o + r for o, r in zip(w.offsets, rel)), sizes=sizes)
                    _put(fd, sub, part)
                    pos += n
                hasher.update(buf.view[:pos])
            finally:
                pool.release(buf)

        try:
            for first in range(0, numel, step):
                last = min(numel, first + step)
                buf = pool.try_acquire(pinned=stage.pinned)
                if buf is None:
                    finish_pending()  # ours first: never wait for a buffer while holding one
                    buf = pool.acquire(pinned=stage.pinned)
                try:
                    typed = buf.tensor[: (last - first) * itemsize].view(w.dtype)
                    for piece, view in copy_chunks(typed, box, first, last):
                        stage.copy(piece, view)  # the cast, if any, happens in the copy
                    ticket = stage.fence()
                except BaseException:
                    settle(stage)  # nothing copies into it any more
                    pool.release(buf)
                    raise
                finish_pending()
                pending = (buf, ticket, first, last)
            finish_pending()
        finally:
            if pending is not None:
                try:
                    pending[1].wait()
                finally:
                    pool.release(pending[0])
        return hasher.finish()

    def _swap_all(self, process_group: Any) -> None:
        swapper = Swapper(self.data.rank, process_group)
        # one batch's blocks are written while the next batch's rows cross the group: two batches in memory
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smpckpt-full-block") as blocks:
            writing: concurrent.futures.Future[None] | None = None
            writing_to = ""  # the files of the blocks being written
            try:
                for batch in batches(self.data.exchanges):
                    mine = [w for e in batch for r, w in e.boxes if r == self.data.rank]
                    bufs = {w: box_buffer(chunk_of(self.planner, self.item_of[w.item]), w) for w in mine}
                    got = swapper.swap(batch, bufs)
                    del bufs
                    for w in mine:
                        self._record(w.item, 0, [])  # its rows are in the other writers' blocks
                    if writing is not None:
                        pending, writing = writing, None
                        pending.result()
                    if got:
                        writing = blocks.submit(self._write_blocks, got)
                        writing_to = ", ".join(sorted({b.write.file for b in got}))
            except BaseException as exc:
                # a swap failed during the previous block's write: report that write's failure too
                lost = writing.exception() if writing is not None else None
                if lost is not None:
                    text = f"writing the previous swap blocks into {writing_to} failed too: {lost!r}"
                    if hasattr(exc, "add_note"):  # Python 3.11+; a log line before
                        exc.add_note(text)
                    else:
                        log.error("%s (while raising %r)", text, exc)
                raise
            if writing is not None:
                writing.result()

    def _write_blocks(self, got: list[Block]) -> None:
        for block in got:
            _put(self.fds[block.write.file], block.write, block.data)
            units = [unit_digests(w, buf, self.data.check_block) for w, buf in block.pieces]
            self._record(block.write.item, block.data.nbytes, units)
            with self.done_lock:
                self.blocks.append(block.write)

    def run(self, thread_count: int, process_group: Any, *, sync: bool) -> list[WriteResult]:
        """(every rank) Write this rank's boxes and row-block swaps; durable when it returns (``sync``). Each
        thread writes whole files, one at a time, in this rank's staggered file order (no two threads share a
        file); swaps (:mod:`._exchange`) run in one more thread, in the global order."""
        # this rank's files from its own place in the list: the kernel serialises buffered writes into one
        # file, so ranks starting on different files mostly stay on different files
        files = sorted(self.per_file)
        first = self.data.rank * len(files) // max(1, self.data.world)
        order = files[first:] + files[:first]
        workers = max(1, min(thread_count, len(order) // max(1, self.data.world)))
        with concurrent.futures.ThreadPoolExecutor(workers + 1, thread_name_prefix="smpckpt-full") as pool:
            swaps = pool.submit(self._swap_all, process_group) if self.data.exchanges else None
            for f in [pool.submit(self._write_file, name) for name in order]:
                f.result()
            if swaps is not None:
                swaps.result()
        if sync:
            _flush(self.fds, list(self.data.writes) + self.blocks)
        return tensor_results(self.items, self.done)


def tensor_results(items: Sequence[WriteItem], done: Mapping[Any, tuple[int, list[BoxUnits]]]) -> list[WriteResult]:
    """A result per tensor item, boxless ones too (DCP checks every item): bytes and check units."""
    results = []
    for it in items:
        if it.tensor_data is not None:
            nbytes, units = done.get(it.index, (0, []))
            results.append(WriteResult(index=it.index, size_in_bytes=nbytes, storage_data=tuple(units)))
    return results


def write_objects(
    folder: Folder, data: RankFullData, items: Sequence[WriteItem], planner: SavePlanner, sync: bool
) -> list[WriteResult]:
    """(every rank) This rank's object values, one ``<key>.pt`` file each, created (never overwritten)."""
    names = dict(data.objects)
    results = []
    for it in items:
        name = names.get(it.index)
        if name is None:
            continue
        value = planner.resolve_data(it)
        payload = value.getvalue() if isinstance(value, io.BytesIO) else bytes(cast(Any, value))
        folder.create(name, payload, sync=sync)
        results.append(
            WriteResult(
                index=it.index,
                size_in_bytes=len(payload),
                storage_data=ObjectResult((name, len(payload), hash_bytes(payload))),
            )
        )
    return results


# -- object stores: each file streamed by its owner rank ------------------------------------------
def gather_rank(
    data: RankFullData, items: Sequence[WriteItem], planner: SavePlanner, *, open_sink: Any, process_group: Any
) -> list[WriteResult]:
    """(every rank) Send this rank's boxes to the files' owners and stream the files this rank owns."""
    run = _Gather(data, items, planner, process_group)
    sinks: dict[str, Sink] = {}
    try:
        for f in data.files:
            owner = run.owner[f.name] == data.rank
            if owner:
                sinks[f.name] = open_sink(f.name)
            # front to back: the pieces that are not tensor data (headers) between the tensors
            events = sorted([(o, 0, b) for o, b in f.pieces] + [(s, 1, k) for s, k in zip(f.starts, f.keys)])
            for _, kind, what in events:
                if kind == 0:
                    if owner:
                        sinks[f.name].write(memoryview(cast(bytes, what)))
                    continue
                tensor = run.tensor(f.name, cast(str, what))
                if tensor is not None:
                    sinks[f.name].write(memoryview(cast(Any, tensor)))
            if f.name in sinks:
                sinks.pop(f.name).commit()
    except BaseException:
        for sink in sinks.values():
            sink.abort()
        raise
    return tensor_results(items, run.done)


class _Gather:
    """One rank's part in the global order of boxes."""

    def __init__(self, data: RankFullData, items: Sequence[WriteItem], planner: SavePlanner, pg: Any) -> None:
        self.data, self.planner, self.pg = data, planner, pg
        self.owner = {f.name: i % data.world for i, f in enumerate(data.files)}  # files round-robin over ranks
        self.by_index = {it.index: it for it in items}
        self.chunks: dict[Any, torch.Tensor] = {}
        self.done: dict[Any, tuple[int, list[BoxUnits]]] = {}  # item -> (bytes, check units) so far
        self.boxes: dict[tuple[str, str], list[tuple[int, FullWrite]]] = {}
        for r, w in data.all_writes:
            self.boxes.setdefault((w.file, w.key), []).append((r, w))

    def _my_box(self, w: FullWrite) -> memoryview:
        chunk = self.chunks.get(w.item)
        if chunk is None:
            chunk = self.chunks[w.item] = chunk_of(self.planner, self.by_index[w.item])
        buf = box_buffer(chunk, w)
        nbytes, units = self.done.get(w.item, (0, []))
        self.done[w.item] = (nbytes + buf.nbytes, [*units, unit_digests(w, buf, self.data.check_block)])
        return buf

    def tensor(self, file: str, key: str) -> np.ndarray | None:
        """(all ranks) This tensor's boxes: sent by their holders; assembled (and returned) by the owner."""
        me, owner = self.data.rank, self.owner[file]
        boxes = self.boxes.get((file, key), [])
        w0 = boxes[0][1] if len(boxes) == 1 and boxes[0][0] == me == owner else None
        if w0 is not None and not any(w0.offsets) and tuple(w0.sizes) == tuple(w0.view):
            # the owner holds all of it, whose own row-major bytes are the tensor's in the file: no assembly
            return np.frombuffer(self._my_box(w0), dtype=np.uint8)
        out: np.ndarray | None = None
        for r, w in boxes:
            if r != me and owner != me:
                continue
            if r == me:
                buf = self._my_box(w)
                if owner != me:
                    dist.send(torch.frombuffer(buf, dtype=torch.uint8), dst=global_rank(self.pg, owner), group=self.pg)
                    continue
                got = np.frombuffer(buf, dtype=np.uint8)
            else:
                recv = torch.empty(math.prod(w.sizes) * w.dtype.itemsize, dtype=torch.uint8)
                dist.recv(recv, src=global_rank(self.pg, r), group=self.pg)
                got = recv.numpy()
            if out is None:
                out = np.zeros(math.prod(w.view) * w.dtype.itemsize, dtype=np.uint8)
            paste(out, (0,) * len(w.view), w.view, got, w)
        return out
