"""Staging: tensor bytes moved between where they live and a small pool of reused host buffers, the
device stage of every save (what cannot be written in place) and of every load into a CUDA tensor
(:class:`DeviceCopies`, :func:`copy_into`), through a :class:`Stage` (README, "Storage": the interface,
and ``SMPCKPT_TEST_DEVICE=cpu``, under which CI runs the pipeline a GPU machine runs).

A pool holds at most ``limit`` bytes in buffers of ``buffer_bytes``, allocated when first needed; a
buffer returns to it only when every use of its bytes has finished (:meth:`BufferPool.release`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import math
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, cast

import torch

from smpckpt.storage.format._reading import range_boxes

__all__ = ["STAGING_BYTES", "BUFFER_BYTES", "MIN_STAGING_BYTES", "HostBuffer", "BufferPool", "Ticket", "Stage"]
__all__ += ["HostStage", "CudaStage", "Stages", "stage_kind", "settle", "TEST_DEVICE_ENV", "narrow_box", "copy_chunks"]
__all__ += ["copy_into", "DeviceCopies", "in_place"]

#: default cap of host memory a save (or a load into CUDA tensors) stages through, per rank
STAGING_BYTES = 128 << 20
#: the pool's buffer size (a chunk of a large tensor), at most; smaller pools use smaller buffers
BUFFER_BYTES = 16 << 20
#: the smallest cap accepted: two buffers of 512 KiB
MIN_STAGING_BYTES = 1 << 20
#: the environment variable that selects the CPU stand-in for tests (``SMPCKPT_TEST_DEVICE=cpu``)
TEST_DEVICE_ENV = "SMPCKPT_TEST_DEVICE"


def stage_kind(t: torch.Tensor, *, in_place: bool) -> Literal["cuda", "host"] | None:
    """How a tensor's bytes reach storage (or a load's reach it): ``None`` in place (``in_place``),
    ``"cuda"`` through a :class:`CudaStage`, ``"host"`` through a :class:`HostStage` (CPU tensors that
    cannot be used in place; every CPU tensor under ``SMPCKPT_TEST_DEVICE=cpu``)."""
    if t.is_cuda:
        return "cuda"
    if t.device.type != "cpu":
        return "host"  # another accelerator: its own copy_ moves the bytes, synchronously
    if in_place and os.environ.get(TEST_DEVICE_ENV) != "cpu":
        return None
    return "host"


def buffer_size(limit: int) -> int:
    """A pool's buffer size: :data:`BUFFER_BYTES`, or a quarter of a smaller ``limit``, rounded down to a power
    of two (torch's pinned allocator rounds requests up to one: 5 MiB would pin 8 MiB, past the cap)."""
    return max(4096, 1 << (min(BUFFER_BYTES, limit // 4).bit_length() - 1))


class HostBuffer:
    """One buffer of a pool: a flat uint8 tensor (pinned for CUDA) and a memoryview of it. A pageable buffer
    is its own anonymous mapping, unmapped when it goes (from ``malloc``, freed buffers stayed in the heap
    and each fresh pool grew the process: ``test_failed_loads_do_not_grow_memory``); pinned ones come
    from torch's caching host allocator."""

    __slots__ = ("index", "tensor", "view", "pinned")

    def __init__(self, index: int, size: int, pinned: bool) -> None:
        self.index = index
        self.pinned = pinned
        if pinned:
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        else:
            # the tensor keeps the mapping alive (frombuffer holds the exporter until its storage goes)
            self.tensor = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
        self.view = memoryview(cast(Any, self.tensor.numpy()))

    @property
    def size(self) -> int:
        return self.tensor.numel()


class BufferPool:
    """At most ``limit`` bytes of host buffers, handed out one at a time and given back when their bytes
    are no longer read. Thread-safe. One pool serves every stage of a save or load, so the cap holds for
    any mix: a buffer is made pinned when a CUDA stage first needs it, and a stage takes a free buffer of
    the other kind rather than exceed the cap. ``on_wait`` (tests) runs, unlocked, when :meth:`acquire` waits."""

    def __init__(self, limit: int, *, on_wait: Callable[[], None] | None = None) -> None:
        self.buffer_bytes = buffer_size(limit)
        self.count = max(2, limit // self.buffer_bytes)
        self._on_wait = on_wait
        self._free: list[HostBuffer] = []
        self._made = 0
        self._in_use = 0
        self.peak_in_use = 0
        self._cond = threading.Condition()
        self._deferred: collections.deque[tuple[Ticket, HostBuffer]] = collections.deque()

    @property
    def limit(self) -> int:
        """Bytes the pool holds at most."""
        return self.count * self.buffer_bytes

    def try_acquire(self, *, pinned: bool = False) -> HostBuffer | None:
        """A free buffer (made when fewer than ``count`` exist), or ``None`` when all are in use."""
        self._settle(block=False)
        with self._cond:
            return self._take(pinned)

    def acquire(self, *, pinned: bool = False) -> HostBuffer:
        """A free buffer, waiting for one when all are in use."""
        buf = self.try_acquire(pinned=pinned)
        if buf is not None:
            return buf
        if self._on_wait is not None:
            self._on_wait()
        while True:
            if self._settle(block=True):  # a buffer whose copy was still running is free now
                with self._cond:
                    buf = self._take(pinned)
                if buf is not None:
                    return buf
                continue
            with self._cond:
                while not self._free and self._made >= self.count and not self._deferred:
                    self._cond.wait()
                buf = self._take(pinned)
            if buf is not None:
                return buf

    def _take(self, pinned: bool) -> HostBuffer | None:
        match = next((i for i in range(len(self._free) - 1, -1, -1) if self._free[i].pinned == pinned), None)
        if match is not None:
            buf = self._free.pop(match)
        elif self._made < self.count:
            buf = HostBuffer(self._made, self.buffer_bytes, pinned)
            self._made += 1
        elif self._free:
            buf = self._free.pop()
        else:
            return None
        self._in_use += 1
        self.peak_in_use = max(self.peak_in_use, self._in_use)
        return buf

    def release(self, buf: HostBuffer) -> None:
        """Give ``buf`` back: nothing reads or writes its bytes any more."""
        with self._cond:
            self._in_use -= 1
            self._free.append(buf)
            self._cond.notify()

    def release_after(self, ticket: Ticket, buf: HostBuffer) -> None:
        """Give ``buf`` back once ``ticket`` completes (the copy out of it, into a device tensor)."""
        with self._cond:
            self._deferred.append((ticket, buf))
            self._cond.notify()

    def _settle(self, *, block: bool) -> bool:
        """Release deferred buffers whose copies completed (waiting for the oldest when ``block``); any?"""
        released = False
        while True:
            with self._cond:
                if not self._deferred:
                    return released
                ticket, buf = self._deferred[0]
                if not (ticket.done() or (block and not released)):
                    return released
                self._deferred.popleft()
            try:
                ticket.wait()
            finally:  # a failed copy has stopped too: its buffer goes back either way
                self.release(buf)
            released = True

    def drain(self) -> None:
        """Wait for every deferred release (the end of a load)."""
        while self._settle(block=True):
            pass

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._in_use


class Ticket:
    """Completion of the copies enqueued on a stage before it was made."""

    def __init__(
        self, future: concurrent.futures.Future[None] | None = None, event: Any = None, device: Any = None
    ) -> None:
        self._future, self._event, self._device = future, event, device

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block until the copies completed (their errors raised here)."""
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            self._event.synchronize()

    def before_use(self) -> None:
        """Order the copies before the destinations' next use: on CUDA by the stream, else on the host."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        else:
            self.wait()


class Stage(Protocol):
    """Moves bytes between tensors and host buffers, asynchronously and in order."""

    pool: BufferPool
    #: whether its buffers should be pinned (``pool.acquire(pinned=stage.pinned)``)
    pinned: bool

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)``; the caller keeps both alive and unchanged until a later ticket completes."""
        ...

    def fence(self) -> Ticket:
        """A ticket that completes when every copy enqueued so far has."""
        ...

    def close(self) -> None:
        """Wait for every enqueued copy, then stop (idempotent)."""
        ...


class HostStage:
    """Copies on one copier thread, in order: CPU sources that cannot be written in place, and the CPU
    stand-in of :class:`CudaStage`. Unfenced copies are kept per calling thread: a fence submits, and its
    ticket fails with, the caller's own copies only (file threads share one stage)."""

    pinned = False

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._local = threading.local()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="smpckpt-stage")

    def _pending(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pending: list[tuple[torch.Tensor, torch.Tensor]] | None = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        return pending

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._pending().append((dst, src))

    def fence(self) -> Ticket:
        batch = self._pending()
        self._local.pending = []
        return Ticket(self._thread.submit(self._run, batch))

    def _run(self, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in batch:
            dst.copy_(src)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class CudaStage:
    """Copies on a side stream of one CUDA device into (saves) or from (loads) pinned pool buffers; each
    fence records an event. The side stream first waits for the work queued on the current stream, which
    produced the values or last used the destinations."""

    pinned = True

    def __init__(self, pool: BufferPool, device: torch.device, producer: Any = None) -> None:
        self.pool = pool
        self.device = device
        # the stream that made the values (a save) or uses the destinations (a load): the caller's
        # current stream when the save or load began, not a worker thread's (the default stream)
        self._producer = producer if producer is not None else torch.cuda.current_stream(device)
        self._stream = torch.cuda.Stream(device=device)
        self._synced = False  # the side stream waits on the producer's stream before its first copy
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # the calling thread's stream may have just made ``src`` (a ``.contiguous()`` temporary): without
        # this wait the copy could read it unwritten -- wrong bytes with a matching checksum
        caller = torch.cuda.current_stream(self.device)
        with self._lock, torch.cuda.stream(self._stream):
            if not self._synced:
                self._stream.wait_stream(self._producer)
                self._synced = True
            self._stream.wait_stream(caller)
            device_tensor = src if src.is_cuda else dst
            if src.is_cuda and (src.is_conj() or src.is_neg()):
                # a non-blocking device-to-host copy of a conjugate or negative view applies the
                # conjugation to the host buffer before the transfer lands (pytorch/pytorch#146286):
                # resolve it on the device, on this stream, first
                src = src.resolve_conj().resolve_neg()
            dst.copy_(src, non_blocking=True)
            # the caching allocator must not hand this memory to another stream's work before the copy
            device_tensor.record_stream(self._stream)

    def fence(self) -> Ticket:
        with self._lock:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._synced = False  # values produced after this point are waited for by the next copy
            return Ticket(event=event, device=self.device)

    def close(self) -> None:
        self._stream.synchronize()


def settle(stage: Stage) -> None:
    """(on an error path) Wait for every copy enqueued on ``stage``, whatever they raise."""
    with contextlib.suppress(Exception):  # the error being raised is the one to report
        stage.fence().wait()


class Stages:
    """The stages of one save or load over one :class:`BufferPool` of ``limit`` bytes, made when first needed
    (a :class:`HostStage`, a :class:`CudaStage` per device). Thread-safe; :meth:`close` waits for every copy."""

    def __init__(self, limit: int, *, on_wait: Callable[[], None] | None = None) -> None:
        self.pool = BufferPool(limit, on_wait=on_wait)
        self._stages: dict[Any, Stage] = {}
        self._lock = threading.Lock()
        # made on the caller's thread (dcp.save's, dcp.load's): its current streams are the producers'
        self._producers: dict[int, Any] = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._producers = {i: torch.cuda.current_stream(i) for i in range(torch.cuda.device_count())}

    def get(self, t: torch.Tensor, kind: Literal["cuda", "host"]) -> Stage:
        key: Any = t.device if kind == "cuda" else "host"
        with self._lock:
            stage = self._stages.get(key)
            if stage is None:
                if kind == "cuda":
                    stage = CudaStage(self.pool, t.device, self._producers.get(t.device.index or 0))
                else:
                    stage = HostStage(self.pool)
                self._stages[key] = stage
            return stage

    def close(self) -> None:
        with self._lock:
            stages, self._stages = list(self._stages.values()), {}
        try:
            for stage in stages:
                try:
                    stage.close()
                except BaseException:
                    # close the others anyway (no copier thread outlives the save); the first error is raised
                    for rest in stages[stages.index(stage) + 1 :]:
                        with contextlib.suppress(Exception):
                            rest.close()
                    raise
        finally:
            self.pool.drain()


# -- tensors copied a chunk at a time through a stage's pool buffers (the load side), and the views a chunk
# is made of (``range_boxes`` cut into views by ``narrow_box``): any strides copy with no whole-tensor temporary.


def narrow_box(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` at the box ``(offsets, sizes)`` (no copy)."""
    view = t
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        if o or n != t.shape[d]:
            view = view.narrow(d, o, n)
    return view


def copy_chunks(flat: torch.Tensor, t: torch.Tensor, first: int, last: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs ``(piece of flat, view of t)`` covering elements ``[first, last)`` of ``t`` (row-major), ``flat`` a
    contiguous 1-D tensor of ``last - first`` elements: copying each view into (or out of) its piece moves the range."""
    pairs = []
    pos = 0
    for offsets, sizes in range_boxes(tuple(t.shape), first, last):
        view = narrow_box(t, offsets, sizes)
        count = math.prod(sizes)
        pairs.append((flat[pos : pos + count].view(view.shape), view))
        pos += count
    return pairs


def copy_into(stages: Stages, dst: torch.Tensor, src: torch.Tensor, kind: Literal["cuda", "host"]) -> Ticket:
    """``dst.copy_(src)`` through pool buffers of ``stages``: ``src`` (host memory reused once this returns) a
    buffer at a time into the pool, then asynchronously to ``dst``, each buffer released once copied.
    Returns the last chunk's ticket: ``before_use()`` it before the destination is read."""
    stage = stages.get(dst, kind)
    pool = stage.pool
    size = src.element_size()
    numel = src.numel()
    step = max(1, pool.buffer_bytes // max(1, size))
    ticket = Ticket()
    for first in range(0, numel, step):
        last = min(numel, first + step)
        buf = pool.acquire(pinned=stage.pinned)
        try:
            typed = buf.tensor[: (last - first) * size].view(src.dtype)
            for piece, view in copy_chunks(typed, src, first, last):
                piece.copy_(view)  # into the pool now: the caller's buffer is free when this returns
            for piece, view in copy_chunks(typed, dst, first, last):
                stage.copy(view, piece)
            ticket = stage.fence()
        except BaseException:
            settle(stage)  # nothing copies out of it any more
            pool.release(buf)
            raise
        pool.release_after(ticket, buf)
    return ticket


def in_place(target: torch.Tensor) -> bool:
    """Whether a load may read straight into ``target``: a CPU tensor, unless ``SMPCKPT_TEST_DEVICE=cpu``."""
    return stage_kind(target, in_place=True) is None


class DeviceCopies:
    """A load's copies into its destinations: ``copy_`` in place, else :func:`copy_into` (CUDA tensors;
    everything under ``SMPCKPT_TEST_DEVICE=cpu``) through a pool of ``limit`` bytes made when first needed.
    :meth:`close` (always, last) waits for every copy."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._stages: Stages | None = None
        self._lock = threading.Lock()  # the reader's threads copy concurrently: one pool for all

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, ordered before ``dst``'s next use; ``src`` may be reused on return."""
        kind = stage_kind(dst, in_place=True)
        if kind is None:
            dst.copy_(src)
            return
        with self._lock:
            if self._stages is None:
                self._stages = Stages(self.limit)
            stages = self._stages
        copy_into(stages, dst, src, kind).before_use()

    def close(self) -> None:
        with self._lock:
            stages, self._stages = self._stages, None
        if stages is not None:
            stages.close()
