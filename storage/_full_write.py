"""Full (consolidated) mode, writing: each rank puts its shards' bytes at their offsets in the artifact.

POSIX filesystems (local disk, Lustre/FSx, NFS) only: the coordinator creates every file at its final
size with its header (:func:`create_files`), then every rank opens the files and ``pwrite``\\ s its boxes
(:func:`write_rank`) -- one run per row for a column shard, one run for a row shard -- hashing each
check unit from the same buffer, and ``fsync``\\ s before reporting success. Object values (user
content, non-tensor state) go to one small file each, written by the rank that holds them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import math
import os
import threading
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.storage._checksum import hash_bytes
from smpckpt.storage._fs import join, write_bytes_atomic
from smpckpt.storage._full_plan import ArtifactFile, FullWrite, RankFullData
from smpckpt.storage._regions import box_runs, split_box
from smpckpt.storage._sinks import write_back

__all__ = ["create_files", "write_rank", "write_objects", "box_buffer", "unit_digests", "UnitResult", "ObjectResult"]

#: boxes at least this large start their writeback as soon as they are written
_FLUSH_AFTER = 8 << 20


class UnitResult(tuple):
    """``(artifact key, view, offsets, sizes, digest)`` of one written check unit (picklable, small)."""


class ObjectResult(tuple):
    """``(file name, size, digest)`` of one object file."""


def create_files(folder: str, files: Sequence[ArtifactFile], *, sync: bool) -> None:
    """(coordinator, before any rank writes) Each file at its final size, header in place.

    Truncating an existing file (debris of an unfinished save under this fixed name) first means no
    stale byte survives: every byte is either the header, written by a rank, or a hole (zeros) that the
    tiling check guarantees some rank fills."""
    os.makedirs(folder, exist_ok=True)
    for f in files:
        fd = os.open(join(folder, f.name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, f.size)
            os.pwrite(fd, f.header, 0)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)


def _inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def box_buffer(chunk: torch.Tensor, w: FullWrite) -> memoryview:
    """The write's box as contiguous row-major bytes of the artifact dtype."""
    sub = chunk
    dest_sizes = [w.sizes[p] for p in w.perm]
    for d, (o, n) in enumerate(zip(w.dest_offsets, dest_sizes)):
        if o or n != sub.shape[d]:
            sub = sub.narrow(d, o, n)
    box = sub.permute(_inverse(w.perm)) if list(w.perm) != sorted(w.perm) else sub
    if box.dtype != w.dtype:
        box = box.to(w.dtype)
    box = box.contiguous()
    if box.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, box.reshape(-1).view(torch.uint8).numpy()))


def _write_box(fd: int, w: FullWrite, buf: memoryview, check_block: int) -> list[UnitResult]:
    itemsize = w.dtype.itemsize
    starts, run = box_runs(w.view, w.offsets, w.sizes, itemsize)
    pos = 0
    for s in starts.tolist():
        n = os.pwrite(fd, buf[pos : pos + run], w.start + s)
        while n < run:  # pwrite may write less than asked (signals, some filesystems)
            n += os.pwrite(fd, buf[pos + n : pos + run], w.start + s + n)
        pos += run
    if buf.nbytes >= _FLUSH_AFTER and len(starts) == 1:
        # Start writeback now, so the final flush waits for less (as the partial writer does). Only
        # for one-run boxes: a strided box shares its pages with other ranks' columns, which would
        # dirty them again and write them twice.
        write_back(fd, w.start + int(starts[0]), int(starts[-1]) + run - int(starts[0]), wait=False)
    return unit_digests(w, buf, check_block)


def unit_digests(w: FullWrite, buf: memoryview, check_block: int) -> list[UnitResult]:
    """The check units of one box, hashed from its row-major bytes (each unit a contiguous slice)."""
    itemsize = w.dtype.itemsize
    units = []
    pos = 0
    for offsets, sizes in split_box(w.offsets, w.sizes, itemsize, check_block):
        n = math.prod(sizes) * itemsize
        units.append(UnitResult((w.key, w.view, offsets, sizes, hash_bytes(buf[pos : pos + n]))))
        pos += n
    return units


def _flush(fds: dict[str, int], writes: Sequence[FullWrite]) -> None:
    """Make this rank's bytes reach the disk before it reports success.

    Every rank fsyncing every shared file would make each wait for all the others' pages too (one
    file, many writers). On Linux each rank instead writes back and waits for the span of its own
    boxes (``sync_file_range``), and the coordinator fsyncs each file once, after every rank is done
    and before the commit (``FsspecStorageWriter.finish``), which flushes the metadata and the disk
    cache with little data left to write. Elsewhere: fsync."""
    spans: dict[str, list[int]] = {}
    for w in writes:
        starts, run = box_runs(w.view, w.offsets, w.sizes, w.dtype.itemsize)
        if len(starts):
            lo, hi = w.start + int(starts[0]), w.start + int(starts[-1]) + run
            span = spans.setdefault(w.file, [lo, hi])
            span[0], span[1] = min(span[0], lo), max(span[1], hi)
    for name, fd in fds.items():
        lo, hi = spans.get(name, (0, 1))  # never length 0: sync_file_range reads it as "to the end"
        if not write_back(fd, lo, hi - lo, wait=True):
            os.fsync(fd)


def _schedule(items: list[WriteItem], by_item: dict[Any, list[FullWrite]], data: RankFullData) -> list[WriteItem]:
    """This rank's items, starting on its own file: the kernel serialises buffered writes into one
    file, so two ranks writing the same file at once each run at about half speed (measured)."""
    files = sorted({w.file for w in data.writes})
    if len(files) < 2:
        return items
    first = data.rank * len(files) // max(1, data.world)
    order = {name: (i - first) % len(files) for i, name in enumerate(files)}
    return sorted(items, key=lambda it: min(order[w.file] for w in by_item[it.index]))


def write_rank(
    folder: str,
    data: RankFullData,
    items: Sequence[WriteItem],
    planner: SavePlanner,
    *,
    sync: bool,
    thread_count: int,
    fs: Any,
) -> list[WriteResult]:
    """(every rank) Write this rank's boxes and objects; durable when it returns."""
    by_item: dict[Any, list[FullWrite]] = {}
    for w in data.writes:
        by_item.setdefault(w.item, []).append(w)
    names = sorted({w.file for w in data.writes})
    fds = {name: os.open(join(folder, name), os.O_WRONLY) for name in names}
    try:
        copying = threading.Lock()

        def one(item: WriteItem) -> WriteResult:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{item.index.fqn!r}: expected a tensor, the planner gave {type(tensor).__name__}")
            writes = by_item.get(item.index, [])
            # A device-to-host copy, a transposed box or a cast makes a temporary as large as the shard:
            # one at a time, so extra memory stays within one shard however many threads write.
            copies = tensor.device.type != "cpu" or any(
                w.dtype != tensor.dtype or list(w.perm) != sorted(w.perm) for w in writes
            )
            with copying if copies else contextlib.nullcontext():
                return _write_item(item, tensor, writes)

        def _write_item(item: WriteItem, tensor: torch.Tensor, writes: list[FullWrite]) -> WriteResult:
            td = item.tensor_data
            chunk = tensor.detach()
            if chunk.device.type != "cpu":
                chunk = chunk.cpu()
            if td is not None:
                chunk = chunk.reshape(tuple(td.chunk.sizes))  # the chunk in global-view coordinates
            units: list[UnitResult] = []
            written = 0
            for w in writes:
                buf = box_buffer(chunk, w)
                units += _write_box(fds[w.file], w, buf, data.check_block)
                written += buf.nbytes
            return WriteResult(index=item.index, size_in_bytes=written, storage_data=tuple(units))

        tensor_items = _schedule([it for it in items if it.index in by_item], by_item, data)
        results: list[WriteResult] = []
        with concurrent.futures.ThreadPoolExecutor(max(1, thread_count), thread_name_prefix="smpckpt-full") as pool:
            results = list(pool.map(one, tensor_items))
        # items with no box (empty shards) still report, so DCP's result check sees every item
        done = {r.index for r in results}
        for it in items:
            if it.tensor_data is not None and it.index not in done:
                results.append(WriteResult(index=it.index, size_in_bytes=0, storage_data=()))
        if sync:
            _flush(fds, data.writes)
    finally:
        for fd in fds.values():
            os.close(fd)
    return results + write_objects(folder, data, items, planner, fs, sync)


def write_objects(
    folder: str, data: RankFullData, items: Sequence[WriteItem], planner: SavePlanner, fs: Any, sync: bool
) -> list[WriteResult]:
    """(every rank) This rank's object values, one ``<key>.pt`` file each (torch.save bytes as given)."""
    names = dict(data.objects)
    results = []
    for it in items:
        name = names.get(it.index)
        if name is None:
            continue
        value = planner.resolve_data(it)
        payload = value.getvalue() if isinstance(value, io.BytesIO) else bytes(cast(Any, value))
        write_bytes_atomic(fs, join(folder, name), payload, sync=sync, sync_dir=False)
        results.append(
            WriteResult(
                index=it.index,
                size_in_bytes=len(payload),
                storage_data=ObjectResult((name, len(payload), hash_bytes(payload))),
            )
        )
    return results
