"""Staging an async save into host buffers a Checkpointer keeps across saves (pinned for CUDA tensors),
so later in-place updates never reach the checkpoint.

:meth:`Stager.stage`: the tensors the optimizers own (parameters and their state, which only ``step``
changes) are copied on the lane thread, overlapping the next forward and backward
(``AsyncOptions.overlap_staging``); everything else before the save returns. Each optimizer's step
pre-hook (:class:`StagingGate`) waits for staging still unfinished. A deferred tensor changed in place
some other way (its version counter moved) fails the save, naming it -- a safety net only: the contract is
that only the optimizers' steps write these tensors. CUDA: the deferred copies run on a side stream after
an event recorded at the save, and the current stream waits for their event (no CPU wait).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from smpckpt.errors import CheckpointError

__all__ = ["Stager", "Pending", "StagingGate", "copy_into", "owned_storages"]


Pair = tuple[str, torch.Tensor, torch.Tensor]  #: (key, source, buffer)


def copy_into(pairs: Iterable[Pair], stream: Any = None) -> None:
    """Copy each ``(source, buffer)``: on ``stream`` (CUDA sources, non-blocking into pinned buffers) or
    in place on the CPU."""
    if stream is None:
        for _, src, buf in pairs:
            buf.copy_(src)
        return
    with torch.cuda.stream(stream):
        for _, src, buf in pairs:
            buf.copy_(src, non_blocking=src.device.type == "cuda")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def owned_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[tuple[str, int]]:
    """The storages the optimizers' ``step`` writes: their parameters' and their state tensors'."""
    out = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if type(p) is torch.nn.Parameter or type(p) is torch.Tensor:
                    out.add(_storage_key(p))
        for per_param in opt.state.values():
            for v in per_param.values():
                if type(v) is torch.Tensor:
                    out.add(_storage_key(v))
    return out


class Pending:
    """The deferred part of one staging (``tag``'s): copied on the lane thread (:meth:`run`);
    :meth:`wait_issued` is what an optimizer step waits for."""

    def __init__(self, tag: str, pairs: list[Pair], ready: Any, stream: Any) -> None:
        self.tag, self.pairs, self.ready, self.stream = tag, pairs, ready, stream
        self.versions = [src._version for _, src, _ in pairs]  #: at the save: an in-place change moves them
        self.issued = threading.Event()  #: every copy issued (CPU: done); set on failure too
        self.done: Any = None  #: CUDA: the copies' event

    def run(self) -> None:
        """(the lane thread) Issue the copies, check that nothing changed them meanwhile, let the optimizers
        step, and wait until the copies landed."""
        try:
            if self.stream is not None:
                self.stream.wait_event(self.ready)
                copy_into(self.pairs, self.stream)
                self.done = torch.cuda.Event()
                self.done.record(self.stream)
                torch.cuda.current_stream(self.stream.device).wait_event(self.done)  # what is queued next
            else:
                copy_into(self.pairs)
            self._unchanged()
        finally:
            self.issued.set()
        if self.done is not None:
            self.done.synchronize()
        self.pairs = []  # the sources: not kept past the copy

    def _unchanged(self) -> None:
        changed = [key for (key, src, _), v in zip(self.pairs, self.versions) if src._version != v]
        if changed:
            raise CheckpointError(
                f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} changed in place after the async save "
                f"of checkpoint {self.tag!r} started and before it was staged, not by an optimizer's step (which "
                "waits for the staging): the save is refused rather than written with values from after it. "
                "Change them only once the save's future is done, or save with AsyncOptions(overlap_staging=False)"
            )

    def wait_issued(self) -> None:
        """(an optimizer step) Wait until the copies are issued; on CUDA the step's stream (the device's
        current one waits already) then runs what follows after them: no CPU wait."""
        self.issued.wait()
        if self.done is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.done)


class StagingGate:
    """The step pre-hook a Checkpointer registers once on each optimizer it saves asynchronously: a step
    waits for the staging in flight, if any (holds no reference to the Checkpointer)."""

    def __init__(self) -> None:
        self.pending: Pending | None = None
        self._handles: dict[int, Any] = {}  # id(optimizer) -> its hook's handle

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            if id(opt) not in self._handles:
                self._handles[id(opt)] = opt.register_step_pre_hook(self._before_step)
                weakref.finalize(opt, self._handles.pop, id(opt), None)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        pending = self.pending
        if pending is not None:
            pending.wait_issued()

    def close(self) -> None:
        """Remove every hook."""
        handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.remove()


class Stager:
    """Host copies of a state's tensors in buffers reused across saves of the same structure (one copy of
    the state saved asynchronously: :meth:`nbytes`)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype, bool], torch.Tensor] = {}
        self._stream: Any = None

    def stage(self, tag: str, state: Any, deferred: set[tuple[str, int]]) -> tuple[Any, Pending | None]:
        """(caller) A copy of ``state`` whose tensors live in this stager's buffers: those whose storage is
        in ``deferred`` filled later by the :class:`Pending` returned (``None``: nothing deferred), the
        others now."""
        now: list[Pair] = []
        later: list[Pair] = []
        staged = self._walk(state, "", deferred, now, later, {})
        cuda_now = [p for p in now if p[1].device.type == "cuda"]
        copy_into([p for p in now if p[1].device.type != "cuda"])
        if cuda_now:
            copy_into(cuda_now, torch.cuda.current_stream())
            torch.cuda.current_stream().synchronize()  # the device-to-host copies were issued non-blocking
        if not later:
            return staged, None
        cuda = any(src.device.type == "cuda" for _, src, _ in later)
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream()
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
        return staged, Pending(tag, later, ready, self._stream if cuda else None)

    def _walk(
        self,
        state: Any,
        prefix: str,
        deferred: set[tuple[str, int]],
        now: list[Pair],
        later: list[Pair],
        seen: dict[tuple[Any, ...], torch.Tensor],
    ) -> Any:
        if isinstance(state, dict):
            return {k: self._walk(v, f"{prefix}{k}.", deferred, now, later, seen) for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self._walk(v, f"{prefix}{i}.", deferred, now, later, seen) for i, v in enumerate(state))
        if not isinstance(state, torch.Tensor):
            return state
        t = state.detach()
        if not (type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)):
            # DTensor and other subclasses: a copy on their own device, now; one DTensor under two keys
            # (a tied head) stays one copy, so the tie is recorded as by a synchronous save
            local = getattr(t, "_local_tensor", None)
            if local is None or not local.numel():
                return t.clone()
            placed = (local.device, local.data_ptr(), local.dtype, tuple(local.shape), local.stride())
            twin = (placed, tuple(t.shape), tuple(getattr(t, "placements", ())), id(getattr(t, "device_mesh", None)))
            if twin not in seen:
                seen[twin] = t.clone()
            return seen[twin]
        # one tensor under two keys (a head tied to its embedding) stays one buffer: the save planner
        # writes a tie once and records it, as a synchronous save of the same state does
        where = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
        if where is not None and where in seen:
            return seen[where]
        cuda = t.device.type == "cuda"
        key = (prefix, tuple(t.shape), t.dtype, cuda)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
            self._buffers[key] = buf
        (later if _storage_key(t) in deferred else now).append((prefix[:-1], t, buf))
        if where is not None:
            seen[where] = buf
        return buf

    def nbytes(self) -> int:
        """Bytes held in reused staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def free(self) -> None:
        """Release the buffers (the next async save allocates them again)."""
        self._buffers = {}
