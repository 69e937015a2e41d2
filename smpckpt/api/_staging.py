"""Staging of an async save (:class:`Stager`): a copy of the state in host buffers kept across saves
(pinned for CUDA tensors), so later in-place updates never reach the checkpoint. The tensors the optimizers
own (only ``step`` changes them) are copied on the save's lane thread (:mod:`smpckpt.api._async`),
overlapping the next forward and backward (``AsyncOptions.overlap_staging``); everything else before the save
returns. Every optimizer's step (a global step pre-hook, :class:`StagingGate`) waits for staging still
unfinished; a deferred tensor changed in place some other way (its version counter moved) fails the save on
every rank, naming it -- a safety net only. CUDA: the deferred copies run on a side stream after an event
recorded at the save; the current stream waits for their event.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

from smpckpt._gc import forget_at_fork
from smpckpt.errors import CheckpointError, no_data, not_plain

__all__ = ["Stager", "Pending", "StagingGate", "copy_into", "owned_storages"]

# held while the process's one step hook is looked up and registered (:meth:`_GatesHook.shared`): two first
# overlapped saves at once registered two (rev65h F2); as wide as torch's registry, one per process
_REGISTERING = threading.Lock()
_STRIDED = torch.strided  # read once: every staged key compares its layout with it
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_REGISTERING._at_fork_reinit)  # type: ignore[attr-defined]


Pair = tuple[str, torch.Tensor, torch.Tensor]  #: (key, source, buffer)


def copy_into(pairs: Iterable[Pair], stream: Any = None) -> None:
    """Copy each ``(source, buffer)``: on ``stream`` (CUDA, non-blocking into pinned buffers) or the CPU."""
    if stream is None:
        for _, src, buf in pairs:
            buf.copy_(src)
        return
    with torch.cuda.stream(stream):
        for _, src, buf in pairs:
            buf.copy_(src, non_blocking=src.device.type == "cuda")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except RuntimeError:
        # an efficient zero tensor (``torch._efficientzerotensor``, some autograd paths' zero gradients) has no
        # storage: nothing changes it in place, so no optimizer owns it; it stages as its zeros, by value
        if t._is_zerotensor():
            return (str(t.device), 0)
        raise


def _bits(t: torch.Tensor) -> tuple[bool, bool]:
    """The conjugate and negative bits: a view with either shows values its memory does not hold."""
    return t.is_conj(), t.is_neg()


def _subclass_copy(t: torch.Tensor, seen: dict[tuple[Any, ...], Any]) -> torch.Tensor:
    """A DTensor's (or another subclass's) copy on its own device, now; one DTensor under two keys (a tied
    head) stays one copy, so the tie is recorded as by a synchronous save."""
    local = getattr(t, "_local_tensor", None)
    if local is None or not local.numel():
        return t.clone()
    placed = (local.device, local.data_ptr(), local.dtype, tuple(local.shape), local.stride(), _bits(local))
    twin = (placed, tuple(t.shape), tuple(getattr(t, "placements", ())), id(getattr(t, "device_mesh", None)))
    if twin not in seen:
        seen[twin] = t.clone()
    return seen[twin]


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


class _GatesHook:
    """The one global optimizer step pre-hook of the process (torch's registry holds it; smpckpt keeps no
    module state): every step waits for the staging in flight of each open :class:`StagingGate`. One hook,
    registered once: adding or removing an entry of torch's hook dict while a step on another thread iterates
    it (waiting in a hook) fails that step, "OrderedDict mutated during iteration" (rev65e F1, rev65g F1);
    gates join and leave this hook's set instead, and closed ones cost nothing (rev65g F2)."""

    def __init__(self) -> None:
        # read by every step without a lock (a set replaced whole): a step taking a lock could deadlock on a
        # finalizer closing a gate on its own thread, or in a child forked while it was held (rev65h F1, F3)
        self.gates: frozenset[StagingGate] = frozenset()
        self.lock = threading.RLock()  # the writers'; a child made by fork starts with a fresh one
        forget_at_fork(self)

    def _forget(self) -> None:
        self.lock = threading.RLock()

    def change(self, gate: StagingGate, join: bool) -> None:
        with self.lock:
            self.gates = self.gates | {gate} if join else self.gates - {gate}

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for gate in self.gates:
            pending = gate.pending
            if pending is not None:
                pending.wait_issued()

    @staticmethod
    def shared() -> _GatesHook:
        with _REGISTERING:
            for hook in list(_global_optimizer_pre_hooks.values()):
                if type(hook).__name__ == "_GatesHook" and hasattr(hook, "gates"):  # this module's, maybe reloaded
                    return cast(_GatesHook, hook)
            hook = _GatesHook()
            register_optimizer_step_pre_hook(hook)
            return hook


class StagingGate:
    """A Checkpointer's part of the process's step pre-hook (:class:`_GatesHook`): any step waits for the
    staging in flight, if any -- not only those of the optimizers passed to the save: another over the same
    parameters (a fused step moves no version counter) or the inner one of a wrapper without
    ``Optimizer.__init__`` (accelerate's) would change a value being staged unseen. It holds no reference to
    the Checkpointer."""

    def __init__(self) -> None:
        self.pending: Pending | None = None
        self._hook: _GatesHook | None = None
        forget_at_fork(self)

    def _forget(self) -> None:
        """(a forked child) The parent's staging is not this process's: no thread here will ever stage it,
        so every optimizer step of the child would wait for it forever."""
        self.pending = None

    def guard(self) -> None:
        if self._hook is None:
            self._hook = _GatesHook.shared()
            self._hook.change(self, join=True)

    def close(self) -> None:
        self.pending = None
        if self._hook is not None:  # never registers anything: close may run on a lane thread (a finalizer)
            self._hook.change(self, join=False)


class Stager:
    """Host copies of a state's tensors in buffers reused across saves of the same structure."""

    def __init__(self) -> None:
        # one per key: a key whose shape or dtype changed replaces its buffer (kept per shape, every
        # earlier one stayed held, pinned on CUDA, for the Checkpointer's life)
        self._buffers: dict[str, tuple[bool, torch.Tensor]] = {}
        self._previous: dict[str, tuple[bool, torch.Tensor]] = {}  # the last save's, during a walk
        self._stream: Any = None

    def stage(self, tag: str, state: Any, deferred: set[tuple[str, int]]) -> tuple[Any, Pending | None]:
        """(caller) A copy of ``state`` in this stager's buffers: tensors whose storage is in ``deferred``
        filled later by the :class:`Pending` returned (``None``: nothing deferred), the others now."""
        now: list[Pair] = []
        later: list[Pair] = []
        # a fresh map each save: the buffers of keys this state no longer holds (renamed, removed, now a
        # tie) are let go, not kept for the Checkpointer's life (an in-flight save keeps its own references)
        self._previous, self._buffers = self._buffers, {}
        staged = self._walk(state, "", deferred, now, later, {})
        self._previous = {}
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
        seen: dict[tuple[Any, ...], Any],  # a DTensor's copy, or a plain tensor's (key, source, buffer)
    ) -> Any:
        if isinstance(state, dict):
            return {k: self._walk(v, f"{prefix}{k}.", deferred, now, later, seen) for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self._walk(v, f"{prefix}{i}.", deferred, now, later, seen) for i, v in enumerate(state))
        if not isinstance(state, torch.Tensor):
            return state
        t = state.detach()
        if not (type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)):
            return _subclass_copy(t, seen)
        # a tensor staging cannot copy is refused by key before a buffer is made: the copy failed in torch's
        # words (rev69f F5). Checked where it costs nothing per key: sparse and nested tensors have no data
        # pointer or strides (raising here), a quantized one never has a buffer of its dtype (checked below)
        device = t.device
        kind = device.type
        if kind == "meta":
            raise no_data(prefix[:-1], t)
        try:
            # no data pointer with elements (an efficient zero tensor, no storage): never one tensor with another
            ptr = t.data_ptr() if t.numel() else 0
            where: tuple[Any, ...] | None = (device, ptr, t.dtype, tuple(t.shape), t.stride()) if ptr else None
        except RuntimeError:
            if t.layout is not _STRIDED or t.is_nested:
                raise not_plain(prefix[:-1], t) from None
            raise
        # one tensor under two keys (a head tied to its embedding) stays one buffer: the save planner
        # writes a tie once and records it, as a synchronous save of the same state does; a conjugate or
        # negated view of it shows other values: a buffer of its own (the planner does not tie it either),
        # as is an empty tensor (a rank's empty piece of a split tied pair: no tie to show, the planners' ranks
        # holding its values decide; empty views of one flat buffer are no tie either, fix71a).
        # The bits are read only on a hit (rare): every key paid for them (rev69f F8, 96 -> 134 ms at 80k keys)
        if where is not None:
            hit = seen.get(where)
            if hit is not None:
                if _bits(hit[1]) == _bits(t):
                    return hit[2]
                where += _bits(t)  # a conjugate or negated twin: its own buffer, shared by its own twins
                hit = seen.get(where)
                if hit is not None:
                    return hit[2]
        cuda = kind == "cuda"
        pinned, buf = self._previous.get(prefix, (cuda, None))
        if buf is None or pinned != cuda or buf.shape != t.shape or buf.dtype != t.dtype:
            if t.layout is not _STRIDED or t.is_quantized or t.is_nested:  # an empty one reaches here too
                raise not_plain(prefix[:-1], t)
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        self._buffers[prefix] = (cuda, buf)
        pair = (prefix[:-1], t, buf)
        (later if _storage_key(t) in deferred else now).append(pair)
        if where is not None:
            seen[where] = pair  # its source for the bits (a twin's key adds them); no tuple more per key
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for _, b in self._buffers.values())

    def free(self) -> None:
        """Release the buffers (the next async save allocates them again)."""
        self._buffers = {}
