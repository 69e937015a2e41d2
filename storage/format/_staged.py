"""Tensors copied a chunk at a time through a stage's pool buffers (the load side of
:mod:`smpckpt.storage.backends._staging`), and the views a chunk is made of.

A chunk is a range of a tensor's elements in row-major order: :func:`~._regions.range_boxes` cuts it
into boxes, and :func:`narrow_box` makes each a view, so any strides (a transposed source, a strided
destination) copy chunk by chunk with no whole-tensor temporary.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Literal

import torch

from smpckpt.storage.backends._staging import Stages, Ticket, settle, stage_kind
from smpckpt.storage.format._regions import range_boxes

__all__ = ["narrow_box", "copy_chunks", "copy_into", "DeviceCopies", "in_place"]


def narrow_box(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` at the box ``(offsets, sizes)`` (no copy)."""
    view = t
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        if o or n != t.shape[d]:
            view = view.narrow(d, o, n)
    return view


def copy_chunks(flat: torch.Tensor, t: torch.Tensor, first: int, last: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs ``(piece of flat, view of t)`` covering elements ``[first, last)`` of ``t`` in row-major
    order, where ``flat`` is a contiguous 1-D tensor of ``last - first`` elements (a buffer's typed
    view): copying each view into (or out of) its piece moves the range."""
    pairs = []
    pos = 0
    for offsets, sizes in range_boxes(tuple(t.shape), first, last):
        view = narrow_box(t, offsets, sizes)
        count = math.prod(sizes)
        pairs.append((flat[pos : pos + count].view(view.shape), view))
        pos += count
    return pairs


def copy_into(stages: Stages, dst: torch.Tensor, src: torch.Tensor, kind: Literal["cuda", "host"]) -> Ticket:
    """``dst.copy_(src)`` through pool buffers of ``stages``: ``src`` (host memory the caller reuses as
    soon as this returns, such as a reader's buffer) is copied a buffer at a time into the pool (pinned
    for CUDA), and from there to ``dst`` asynchronously (a host-to-device copy on the stage's side
    stream; the copier thread for ``kind="host"``), each buffer back in the pool once its copy is done.
    The ticket of the last chunk: ``before_use()`` it before the destination is read."""
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
    """Whether a load may read stored bytes straight into ``target``'s memory: a CPU tensor, unless the
    CPU stand-in of the device stage is on (``SMPCKPT_TEST_DEVICE=cpu``)."""
    return stage_kind(target, in_place=True) is None


class DeviceCopies:
    """A load's copies into its destinations: ``copy_`` for those filled in place, :func:`copy_into`
    for the others (CUDA tensors; every destination under ``SMPCKPT_TEST_DEVICE=cpu``), whose pool of
    ``limit`` bytes is made when first needed. :meth:`close` (always, last) waits for every copy."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._stages: Stages | None = None
        self._lock = threading.Lock()  # the reader's threads copy concurrently: one pool for all

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``; the destination's next use (``commit_tensor``) is ordered after it, and
        ``src`` may be reused as soon as this returns."""
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
