"""Read I/O: ranged reads of data files (``preadv`` on local disk, ``cat_file`` elsewhere), block
verification, and the read-buffer pool of one ``read_data`` call.

The functions here run on the reader's worker threads; each reads, checks that every byte arrived and
verifies every checksum block it read before returning, so a corrupt or short file fails the read with
a :class:`~smpckpt.errors.CheckpointCorrupt` naming the file and the keys affected.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage._checksum import hash_bytes, hash_parts
from smpckpt.storage._errors import translate_errors
from smpckpt.storage._fs import is_local
from smpckpt.storage._read_plan import Item
from smpckpt.storage.manifest import FileRecord

__all__ = [
    "BufferPool",
    "pread_into",
    "missing_file_error",
    "check_complete",
    "verify_blocks",
    "read_range",
    "read_direct",
]


class BufferPool:
    """Read buffers reused within one ``read_data`` call: a fresh 64 MiB ``bytearray`` costs a memset and
    page faults on every request. Thread-safe. Buffers are at least ``min_size`` bytes; at most
    ``max_kept`` are kept for reuse."""

    def __init__(self, *, min_size: int, max_kept: int) -> None:
        self.min_size = min_size
        self.max_kept = max_kept
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Buffers kept for reuse."""
        with self._lock:
            return len(self._free)

    def take(self, n: int) -> bytearray:
        """A buffer of at least ``n`` bytes (a kept one when one is large enough)."""
        with self._lock:
            for i, b in enumerate(self._free):
                if len(b) >= n:
                    del self._free[i]
                    return b
        return bytearray(max(n, self.min_size))

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


def pread_into(fd: int, buffers: Sequence[memoryview], offset: int, want: int) -> int:
    """Read file bytes ``[offset, offset + want)`` of ``fd`` into ``buffers`` (byte views, filled in order;
    capacity past ``want`` bytes is left alone), looping on short reads. Returns the bytes read: fewer
    than ``want`` only when the file ends first."""
    got = 0
    while got < want:
        views: list[memoryview] = []
        skip, room = got, want - got
        for mv in buffers:
            if skip >= len(mv):
                skip -= len(mv)
                continue
            part = mv[skip : skip + room]
            views.append(part)
            room -= len(part)
            skip = 0
            if not room:
                break
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
    return got


def _pread_file(path: str, buffers: Sequence[memoryview], offset: int, want: int) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return pread_into(fd, buffers, offset, want)
    finally:
        os.close(fd)


def missing_file_error(path: str, keys: Sequence[str]) -> CheckpointCorrupt:
    """The error for a data file that the metadata names but storage does not have."""
    return CheckpointCorrupt(f"{path}: data file is missing (needed for keys {list(keys)[:5]})")


def check_complete(path: str, keys: Sequence[str], lo: int, hi: int, got: int) -> None:
    """Raise when a read of file bytes ``[lo, hi)`` returned only ``got`` bytes (the file is truncated)."""
    if got < hi - lo:
        raise CheckpointCorrupt(
            f"{path}: truncated: needed bytes {lo}..{hi} for keys {list(keys)[:5]}, file ends at {lo + got}"
        )


def verify_blocks(
    path: str, rec: FileRecord, lo: int, hi: int, items: Sequence[Item], digest: Callable[[int, int], int]
) -> None:
    """Check every block of ``rec`` that overlaps file bytes ``[lo, hi)`` (``digest(start, end)`` hashes
    a block's bytes as read); a mismatch names the block and the keys among ``items`` it holds."""
    for i in rec.blocks_covering(lo, hi):
        bs, be = rec.block_start(i), rec.block_ends[i]
        if digest(bs, be) != rec.block_digests[i]:
            bad = sorted({it.fqn for it in items if it.start < be and it.end > bs})
            raise CheckpointCorrupt(
                f"{path}: checksum mismatch in bytes {bs}..{be} (block {i}) holding key(s) {bad}; the file is corrupt"
            )


def read_range(
    fs: Any, path: str, lo: int, hi: int, items: Sequence[Item], rec: FileRecord | None, pool: BufferPool
) -> memoryview:
    """(worker thread) File bytes ``[lo, hi)`` serving ``items``, verified against ``rec`` (the file's
    record; ``None``: not verified). Local files are read into a buffer from ``pool``."""
    keys = sorted({it.fqn for it in items})
    want = hi - lo
    try:
        with translate_errors(path):
            if is_local(fs):
                buf = pool.take(want)
                data = memoryview(buf)[: _pread_file(path, [memoryview(buf)], lo, want)]
            else:
                data = memoryview(fs.cat_file(path, start=lo, end=hi))
    except FileNotFoundError as exc:
        raise missing_file_error(path, keys) from exc
    check_complete(path, keys, lo, hi, len(data))
    if rec is not None:
        verify_blocks(path, rec, lo, hi, items, lambda bs, be: hash_bytes(data[bs - lo : be - lo]))
    return data


def read_direct(path: str, it: Item, dst: memoryview, lo: int, hi: int, rec: FileRecord | None) -> None:
    """(worker thread, local files) Read file bytes ``[lo, hi)`` of a direct item: the item's own bytes
    straight into ``dst`` (its destination's bytes), the block-widening head/tail into scratch buffers;
    then verify every block of the piece against ``rec`` (``None``: not verified)."""
    a, b = max(lo, it.start), min(hi, it.end)
    segs: list[tuple[int, memoryview]] = []  # (file offset, buffer), covering [lo, hi) in order
    if a > lo:
        segs.append((lo, memoryview(bytearray(a - lo))))
    segs.append((a, dst[a - it.start : b - it.start]))
    if hi > b:
        segs.append((b, memoryview(bytearray(hi - b))))
    try:
        with translate_errors(path):
            got = _pread_file(path, [mv for _, mv in segs], lo, hi - lo)
    except FileNotFoundError as exc:
        raise missing_file_error(path, [it.fqn]) from exc
    check_complete(path, [it.fqn], lo, hi, got)
    if rec is None:
        return

    def digest(bs: int, be: int) -> int:
        if bs >= a and be <= b:
            return hash_bytes(dst[bs - it.start : be - it.start])
        return hash_parts(
            mv[max(bs, off) - off : min(be, off + len(mv)) - off]
            for off, mv in segs
            if max(bs, off) < min(be, off + len(mv))
        )

    verify_blocks(path, rec, lo, hi, [it], digest)
