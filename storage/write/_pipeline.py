"""One data file's bytes on their way to its sink: in place (a contiguous CPU tensor's own memory, or an
object's bytes: hashed inline a :data:`INLINE_CHUNK` at a time, or beside the write a :data:`BESIDE_CHUNK`
at a time), or staged through pooled buffers (:func:`~smpckpt.storage.format._staging.stage_kind` decides
per record; packed below :data:`PACK_BELOW`). README, "Storage" (write path and staging), says how and why;
a thread that needs a buffer when the pool has none free writes its own queued buffers first and waits
only with none queued, so the pool cannot deadlock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
from typing import Any

import torch

from smpckpt.storage.backends._sinks import Sink, byte_view
from smpckpt.storage.format._check_units import ItemChecks
from smpckpt.storage.format._checksum import BlockHasher
from smpckpt.storage.format._staging import HostBuffer, Stage, Stages, Ticket, copy_chunks, settle

__all__ = ["FileStream", "INLINE_CHUNK", "BESIDE_CHUNK", "PACK_BELOW", "inline_chunk"]

#: bytes of an in-place record hashed and then written at a time (:func:`inline_chunk`): fits a core's L2
INLINE_CHUNK = 1 << 20
#: bytes of an in-place record handed to the hash thread at a time when hashed beside the write
BESIDE_CHUNK = 8 << 20
#: in-place records below this many bytes are hashed inline either way (a hand-off costs more)
BESIDE_ABOVE = 256 << 10
#: staged records below this many bytes (and a quarter of a buffer) share buffers
PACK_BELOW = 1 << 20
# staged buffers a file's writer may run ahead of its hasher
_MAX_HASH_BACKLOG = 8
# staged buffers a file may have queued before it writes the oldest (the pool bounds them too)
_MAX_QUEUED = 4


@dataclasses.dataclass
class _Staged:
    """A pool buffer on its way: its copies (``ticket``), and the parts of records it holds, in file
    order: (bytes here, and -- where a record starts here -- its size and check units)."""

    stage: Stage
    buffer: HostBuffer
    parts: list[tuple[int, tuple[int, ItemChecks | None] | None]]
    fill: int = 0
    ticket: Ticket | None = None


class FileStream:
    """The bytes of one data file, in order, into ``sink`` and ``hasher`` (module docstring; ``hash_beside``
    there too). ``hooks`` (tests): ``on_hash(buffer_index)`` before a staged buffer is hashed (on the hash
    thread), ``on_written(buffer_index)`` after its write."""

    def __init__(
        self, sink: Sink, hasher: BlockHasher, stages: Stages, hooks: Any = None, *, hash_beside: bool = False
    ) -> None:
        self.sink, self.hasher, self.stages = sink, hasher, stages
        self.hash_beside = hash_beside
        self.pool = stages.pool
        # a borrowing sink (S3 parts, replication) gets copies of staged bytes: their buffers are reused
        self._copy_out = getattr(sink, "borrows", True)
        self._hash = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smpckpt-hash")
        self._backlog: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        self._queue: collections.deque[_Staged] = collections.deque()
        self._pack: _Staged | None = None
        self._hooks = hooks

    # -- in place ----------------------------------------------------------------------------------
    def put(self, data: memoryview, checks: ItemChecks | None) -> None:
        """A record written from ``data`` itself (not changed until the sink's commit)."""
        self._flush_staged()
        flat = byte_view(data)
        nbytes = flat.nbytes
        if self.hash_beside and nbytes >= BESIDE_ABOVE:  # each chunk hashed on the hash thread while written here
            self._backlog.append(self._hash.submit(self.hasher.start_item, nbytes, checks))
            for i in range(0, nbytes, BESIDE_CHUNK):
                chunk = flat[i : i + BESIDE_CHUNK]
                self._backlog.append(self._hash.submit(self.hasher.update, chunk))
                self.sink.write(chunk)
                while len(self._backlog) > _MAX_HASH_BACKLOG:
                    self._backlog.popleft().result()
            return
        self._wait_hashes()  # the hasher takes a file's bytes in order: staged buffers' first
        self.hasher.start_item(nbytes, checks)
        step = inline_chunk(checks)
        for i in range(0, nbytes, step):
            chunk = flat[i : i + step]
            # hashed first, then written from the cache the hash left it in (module docstring)
            self.hasher.update(chunk)
            self.sink.write(chunk)

    # -- staged ------------------------------------------------------------------------------------
    def stage(self, t: torch.Tensor, stage: Stage, checks: ItemChecks | None) -> int:
        """A tensor record copied through ``stage``'s pool (its bytes: the tensor's values, row-major)."""
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        if nbytes < min(PACK_BELOW, self.pool.buffer_bytes // 4):  # packed into a shared buffer
            pack = self._pack
            if pack is not None and (pack.stage is not stage or pack.fill + nbytes > pack.buffer.size):
                self._seal()
                pack = None
            if pack is None:
                pack = self._pack = _Staged(stage, self._acquire(stage), [])
            if nbytes:
                # as bytes: a packed record may start at any offset, where a typed view of the buffer cannot
                src = t.resolve_conj().resolve_neg()
                if not src.is_contiguous():
                    src = src.contiguous()  # on its device, at most PACK_BELOW bytes
                stage.copy(pack.buffer.tensor[pack.fill : pack.fill + nbytes], src.reshape(-1).view(torch.uint8))
            pack.parts.append((nbytes, (nbytes, checks)))
            pack.fill += nbytes
            return nbytes
        self._seal()
        size = t.element_size()
        step = chunk_bytes(self.pool.buffer_bytes, checks) // size
        numel = t.numel()
        for first in range(0, numel, step):
            last = min(numel, first + step)
            start = (nbytes, checks) if first == 0 else None
            staged = _Staged(stage, self._acquire(stage), [((last - first) * size, start)])
            try:
                typed = staged.buffer.tensor[: (last - first) * size].view(t.dtype)
                for piece, view in copy_chunks(typed, t, first, last):
                    stage.copy(piece, view)
            except BaseException:
                settle(stage)  # nothing copies into it any more
                self.pool.release(staged.buffer)
                raise
            staged.fill = (last - first) * size
            self._enqueue(staged)
        return nbytes

    def _seal(self) -> None:
        pack, self._pack = self._pack, None
        if pack is not None:
            self._enqueue(pack)

    def _enqueue(self, staged: _Staged) -> None:
        try:
            staged.ticket = staged.stage.fence()
        except BaseException:
            settle(staged.stage)  # nothing copies into it any more: the buffer can go back
            self.pool.release(staged.buffer)
            raise
        self._queue.append(staged)
        while len(self._queue) > _MAX_QUEUED:
            self._write_oldest()

    def _acquire(self, stage: Stage) -> HostBuffer:
        while True:
            buf = self.pool.try_acquire(pinned=stage.pinned)
            if buf is not None:
                return buf
            if self._queue:
                self._write_oldest()  # ours first: a thread never waits while holding queued buffers
                continue
            if self._pack is not None:
                self._seal()
                continue
            return self.pool.acquire(pinned=stage.pinned)

    def _write_oldest(self) -> None:
        staged = self._queue.popleft()
        buf = staged.buffer
        try:
            if staged.ticket is None:
                raise RuntimeError("a staged buffer was queued without its copies' ticket")
            staged.ticket.wait()
        except BaseException:
            self.pool.release(buf)  # nothing copies into it or reads it any more: the save is failing
            raise
        data = buf.view[: staged.fill]
        fut = self._hash.submit(self._hash_staged, staged, data)
        self._backlog.append(fut)
        try:
            self.sink.write(memoryview(bytes(data)) if self._copy_out else data)
            if self._hooks is not None:
                self._hooks.on_written(buf.index, staged.fill)
        finally:
            # back to the pool once both the write and the hash are done, even when the write failed
            fut.add_done_callback(lambda _f: self.pool.release(buf))
        while len(self._backlog) > _MAX_HASH_BACKLOG:
            self._backlog.popleft().result()

    def _hash_staged(self, staged: _Staged, data: memoryview) -> None:
        if self._hooks is not None:
            self._hooks.on_hash(staged.buffer.index)
        pos = 0
        for nbytes, start in staged.parts:
            if start is not None:
                self.hasher.start_item(*start)
            if nbytes:
                self.hasher.update(data[pos : pos + nbytes])
            pos += nbytes

    def _flush_staged(self) -> None:
        self._seal()
        while self._queue:
            self._write_oldest()

    def _wait_hashes(self) -> None:
        while self._backlog:
            self._backlog.popleft().result()

    def finish(self) -> None:
        """Every record written and hashed (errors raised here)."""
        self._flush_staged()
        self._wait_hashes()

    def close(self) -> None:
        """(always, last) Stop the hash thread; on failure, queued buffers go back once copied."""
        for fut in self._backlog:
            fut.cancel()
        self._hash.shutdown(wait=True)
        for staged in [*self._queue, *([self._pack] if self._pack is not None else [])]:
            if staged.ticket is not None:
                with contextlib.suppress(BaseException):  # the copy's error is not this one's to report
                    staged.ticket.wait()
            else:
                # an unsealed pack may have copies pending in this thread's batch: settle them before the
                # buffer goes back (its next fence would fill a buffer another file then owns)
                settle(staged.stage)
            self.pool.release(staged.buffer)
        self._queue.clear()
        self._pack = None


def inline_chunk(checks: ItemChecks | None) -> int:
    """Bytes of an in-place record hashed and written at a time: about :data:`INLINE_CHUNK`, whole check
    units or, for a tiled record, whole rows (no segment cut by the chunk)."""
    if checks is None:
        return INLINE_CHUNK
    quantum = checks.row_bytes if checks.groups > 1 else checks.unit
    return max(1, INLINE_CHUNK // quantum) * quantum


def chunk_bytes(buffer_bytes: int, checks: ItemChecks | None) -> int:
    """Bytes of one staged chunk of a large record: a buffer's worth, cut after a whole row group."""
    if checks is not None and checks.groups > 1:
        group = checks.rows_per_group * checks.row_bytes
        if group <= buffer_bytes:
            return buffer_bytes // group * group
    return buffer_bytes
