"""The background lanes of a :class:`~smpckpt.Checkpointer`: its async saves and its drains each run, in
order, on a thread of their own (a gloo group of the Checkpointer's own, so training's collectives never
interleave); training blocks only while the state is staged (below). A previous failure is raised
once, naming its tag; a future completes only after data, manifest and ``newest`` are durable and
retention ran.

No registry of lanes: their threads are :class:`LaneThread`\\ s, so :func:`wait_for_saves` and
:func:`drain_status` find every live Checkpointer's work in the interpreter's thread list. The exit waits
for it too (:func:`register_exit_wait`), but a multi-rank save needs its process group: call
``wait_for_saves()`` before ``destroy_process_group()``.

Staging (:class:`Stager`, below) copies an async save into host buffers kept across saves (pinned for CUDA
tensors), so later in-place updates never reach the checkpoint. The tensors the optimizers own (only
``step`` changes them) are copied on the lane thread, overlapping the next forward and backward
(``AsyncOptions.overlap_staging``); everything else before the save returns. Every optimizer's step (a
global step pre-hook, :class:`StagingGate`) waits for staging still unfinished; a deferred tensor changed in
place some other way (its version counter moved) fails the save on every rank, naming it -- a safety net
only. CUDA: the deferred copies run on a side stream after an event recorded at the save; the current
stream waits for their event.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours (ours runs first)
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

from smpckpt.api._dist import DistContext
from smpckpt.errors import CheckpointError

__all__ = ["Lane", "LaneThread", "GlooGroups", "DrainStatus", "check_previous", "raise_failed", "wait_lanes"]
__all__ += ["wait_logged", "Stager", "Pending", "StagingGate", "copy_into", "owned_storages"]
__all__ += ["register_exit_wait", "live_lanes", "wait_for_saves", "drain_status", "free_staging_buffers"]

log = logging.getLogger("smpckpt.api")


class LaneThread(threading.Thread):
    """The thread of one :class:`Lane` (how :func:`wait_for_saves` finds it among the interpreter's)."""

    def __init__(self, lane: Lane) -> None:
        super().__init__(name=lane.name, daemon=True)  # its exit hook waits for its work, then ends it
        self.lane = lane

    def run(self) -> None:
        self.lane.run()


class Lane:
    """One kind of background work of one Checkpointer (saves, or drains), run in order on a
    :class:`LaneThread` started at the first :meth:`submit`; ``failed`` is kept for the next call to raise."""

    def __init__(self, kind: Literal["save", "drain"], what: str, owner: Any) -> None:
        self.kind, self.what, self.name = kind, what, f"smpckpt-{'async-save' if kind == 'save' else 'drain'}"
        self.owner = weakref.ref(owner)  #: the Checkpointer (module functions reach it through the thread)
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, Callable[[], None], concurrent.futures.Future[None]]] = (
            collections.deque()
        )
        self._thread: LaneThread | None = None  #: the thread running the lane's work, while it runs
        self.used = False  #: work was ever submitted (then every save checks on this lane first)
        self._stopping = False
        self.fut: concurrent.futures.Future[None] | None = None  #: the last work submitted
        self.tag = ""  #: its tag
        self.submitted = 0.0  #: when (``time.monotonic``): the newest drain of the process is the last one
        self.failed: tuple[str, BaseException] | None = None
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    @property
    def running(self) -> bool:
        return self.fut is not None and not self.fut.done()

    def submit(self, tag: str, work: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Run ``work()`` on the lane's thread after the work before it; its failure is kept in ``failed``."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                thread = LaneThread(self)
                thread.start()  # kept only once started: stop(join=True) must never join one that is not
                self._thread = thread
            self.used = True
            self._queue.append((tag, work, fut))
            self.fut, self.tag, self.submitted = fut, tag, time.monotonic()
            self._cond.notify()
        return fut

    def run(self) -> None:
        while True:
            with self._cond:
                # a stopped lane's thread stays while a failure is kept: how wait_for_saves finds it (hunt63b L1)
                while not self._queue and not (self._stopping and self.failed is None):
                    self._cond.wait()
                if not self._queue:
                    # let go of the lane under its lock: a submit after this starts a thread of its own
                    # (this one is still alive for a moment and would never run what it queued)
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                tag, work, fut = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept for the next call, raised by the future
                self.failed = (tag, exc)
                log.error("%s of checkpoint %r failed: %s", self.what, tag, exc)
                fut.set_exception(exc)
            else:
                fut.set_result(None)
            del work  # it holds the staged state and the Checkpointer: nothing of it is kept while idle

    def wait(self) -> None:
        """Wait for the work in flight (no error raised here)."""
        fut = self.fut
        if fut is not None:
            concurrent.futures.wait([fut])

    def take_failed(self) -> tuple[str, BaseException] | None:
        """The failure kept, once (then cleared; a stopped lane's thread, kept for it, ends)."""
        with self._cond:
            failed, self.failed = self.failed, None
            self._cond.notify()
        return failed

    def stop(self, join: bool = False) -> None:
        """End the thread once the work submitted is done and its failure raised (a later :meth:`submit`
        starts another); ``join``: wait for that, the work done (not while a failure is kept)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if join and thread is not None and thread is not threading.current_thread() and self.failed is None:
            thread.join()

    def _forget(self) -> None:
        """(a forked child) The parent's work is not this process's: no thread here will ever finish its
        future, so a child that waited for it (at exit, or in its own save) would hang."""
        self._cond = threading.Condition()  # the parent's may have been held by a thread that is gone
        self._queue.clear()
        self._thread, self.fut, self.failed, self.used = None, None, None, False


def _forget_in_child(ref: weakref.ref[Any]) -> None:
    """(a forked child) ``_forget`` the lane or staging gate ``ref`` names, if it still exists."""
    obj = ref()
    if obj is not None:
        obj._forget()


def wait_logged(fut: concurrent.futures.Future[None] | None, what: str) -> None:
    if fut is not None and not fut.done():
        started = time.monotonic()
        concurrent.futures.wait([fut])
        log.info("waited %.2fs for %s", time.monotonic() - started, what)


def raise_failed(lanes: Iterable[Lane], suffix: str) -> None:
    """Raise the first failure a lane kept (each once: it is then cleared); saves before drains."""
    for lane in sorted(lanes, key=lambda lane: lane.kind != "save"):
        if (failed := lane.take_failed()) is not None:
            tag, exc = failed
            if lane.kind == "save":
                what, kept = f"the background save of checkpoint {tag!r}", ""
            else:
                what, kept = f"the drain of checkpoint {tag!r} to the durable tier", "; it is still in the fast tier"
            raise CheckpointError(f"{what} failed: {type(exc).__name__}: {exc}{kept}{suffix}") from exc


def check_previous(save: Lane, drain: Lane, wait: bool) -> None:
    """(caller) Refuse a save while one is in flight (``wait`` false), else wait; then raise a failure once."""
    if save.running and not wait:
        raise CheckpointError(
            f"a background save of {save.tag!r} is still running (wait_for_previous=False); call "
            "wait() (smpckpt.wait_for_saves()) or save with wait_for_previous=True"
        )
    wait_logged(save.fut, f"the background save of {save.tag!r} to finish")
    raise_failed((save, drain), " (this save was not started)")


def wait_lanes(save: Lane, drain: Lane, *, raise_errors: bool) -> None:
    """The save first: a background save of a durable tag submits its drain when its fast tier committed."""
    save.wait()
    drain.wait()
    if raise_errors:
        raise_failed((save, drain), "")


def live_lanes() -> list[Lane]:
    """Every live Checkpointer's lanes that ever ran work (their threads are the interpreter's)."""
    return [t.lane for t in threading.enumerate() if isinstance(t, LaneThread)]


def wait_for_saves(*, raise_errors: bool = True) -> None:
    """Block until every :class:`~smpckpt.Checkpointer`'s background save in flight, and then its drain,
    have finished; with ``raise_errors``, a failure of either is raised here (not again by the next save)."""
    for lane in sorted(live_lanes(), key=lambda lane: lane.kind != "save"):
        lane.wait()
    drains = [lane for lane in live_lanes() if lane.kind == "drain"]  # a save may have started the first one
    for lane in drains:
        lane.wait()
    if raise_errors:
        raise_failed(live_lanes(), "")


def free_staging_buffers() -> None:
    """Release every live Checkpointer's staging buffers (after waiting for its save in flight)."""
    for lane in live_lanes():
        owner = lane.owner()
        if owner is not None and lane.kind == "save":
            owner.free_staging_buffers()


@dataclasses.dataclass(frozen=True)
class DrainStatus:
    """The last drain of a Checkpointer to the durable tier (tiered checkpoints)."""

    tag: str
    state: Literal["running", "done", "failed"]
    error: str | None = None  #: the failure, until ``wait_for_saves`` or the next save raised it

    @classmethod
    def of(cls, lane: Lane) -> DrainStatus | None:
        fut = lane.fut
        if fut is None:
            return None
        if not fut.done():
            return cls(lane.tag, "running")
        if lane.failed is not None and lane.failed[0] == lane.tag:
            return cls(lane.tag, "failed", f"{type(lane.failed[1]).__name__}: {lane.failed[1]}")
        return cls(lane.tag, "failed" if fut.exception() is not None else "done")


def drain_status() -> DrainStatus | None:
    """The newest drain of any live Checkpointer (``None``: none started); ``Checkpointer.drain_status``."""
    drains = [lane for lane in live_lanes() if lane.kind == "drain"]
    return DrainStatus.of(max(drains, key=lambda lane: lane.submitted)) if drains else None


class GlooGroups:
    """A Checkpointer's gloo groups, one per purpose (``"save"``: background saves and the fast tier's
    agreements; ``"drain"``; further transfer streams), each created collectively when first needed."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self._groups: dict[str, Any] = {}

    def get(self, ctx: DistContext, purpose: str = "save") -> Any:
        """(all ranks, collectively the first time) The group for ``purpose`` (``None``: no process group)."""
        if not ctx.active or ctx.world_size == 1:
            return None
        group = self._groups.get(purpose)
        if group is None:
            pg = self.process_group
            ranks = dist.get_process_group_ranks(pg) if pg is not None else None
            group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None)
            self._groups[purpose] = group
        return group

    def streams(self, ctx: DistContext) -> tuple[Any, ...]:
        """(all ranks, collectively the first time) The groups the fast tier moves files over: the
        ``"save"`` group and ``STREAMS - 1`` more (``()`` without a process group)."""
        from smpckpt.storage.tier import STREAMS

        if not ctx.active or ctx.world_size == 1:
            return ()
        return (self.get(ctx), *(self.get(ctx, f"stream{i}") for i in range(1, STREAMS)))

    def destroy(self) -> None:
        """(all ranks, collectively) Each group once every rank is past its last collective there."""
        groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            if dist.is_available() and dist.is_initialized():
                with contextlib.suppress(Exception):  # a group torn down with the job's already
                    dist.barrier(group=group)
                    dist.destroy_process_group(group)


class ExitRecorder:
    """Stands in for ``sys.exit`` and notes the status asked for (``status``), so the exit wait keeps a
    program's own failure status (CPython keeps a ``SystemExit``'s where no exit hook can read it)."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real, self.status = real, 0
        self.__doc__ = real.__doc__

    def __call__(self, *args: Any) -> Any:
        if threading.current_thread() is threading.main_thread():  # another thread's SystemExit ends only it
            code = args[0] if args else None
            self.status = 0 if code is None else int(code) & 0xFF if isinstance(code, int) else 1
        return self.real(*args)


def register_exit_wait(lanes: tuple[Lane, Lane], exit_status: int | None) -> None:
    """Finish ``lanes``' work when the interpreter exits (the hook holds the lanes, never the
    Checkpointer), and wrap ``sys.exit`` once (:class:`ExitRecorder`). Not ``atexit``: it runs after
    ``threading``'s exit hooks, when concurrent.futures takes no more work, so a background save opening
    its writer pools failed and the checkpoint was lost while the process exited 0. Registered after
    concurrent.futures' (imported above), ours runs before it (those hooks run newest first)."""
    # not CPython >= 3.9 (no threading._register_atexit): the plain hook is the best left
    hook = functools.partial(_wait_at_exit, lanes, exit_status)
    (getattr(threading, "_register_atexit", None) or atexit.register)(hook)
    if not isinstance(sys.exit, ExitRecorder):
        sys.exit = ExitRecorder(sys.exit)


def _wait_at_exit(lanes: tuple[Lane, Lane], exit_status: int | None) -> None:
    """(interpreter exit) Wait for the work in flight, then end the lanes' threads; a failure is logged at
    ERROR naming the tag, and the process exits with :attr:`AsyncOptions.exit_status` (1 by default)."""
    save, drain = lanes
    for lane in lanes:
        if lane.running:
            log.info("waiting for %s of %r before exiting", lane.what, lane.tag)
    try:
        wait_lanes(save, drain, raise_errors=True)
    except CheckpointError as exc:
        status = exit_status
        program = sys.exit.status if isinstance(sys.exit, ExitRecorder) else 0
        if status and program:
            status = program  # the program's own failure status stays what it asked for
        suffix = f"; exiting with status {status}" if status else ""
        log.error("%s (at interpreter exit; `smpckpt ls` shows what committed)%s", exc, suffix)
        if status:
            # every other Checkpointer's work in flight finishes first (its hook would run after this one,
            # and os._exit ends the process before it): its final save is not lost to this one's failure
            for other in sorted(live_lanes(), key=lambda lane: lane.kind != "save"):
                if other is save or other is drain:
                    continue
                other.wait()
                fut = other.fut
                if fut is not None and not fut.cancelled() and fut.exception() is not None:
                    log.error("%s of %r failed (at interpreter exit): %s", other.what, other.tag, fut.exception())
            atexit._run_exitfuncs()  # what a normal exit still runs (logging's flush among them)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # a closed stream must not hide the status
                    stream.flush()
            os._exit(status)
    for lane in lanes:
        lane.stop(join=True)


# -- staging an async save (module docstring) ---------------------------------------------------------
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
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

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
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

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
        pinned, buf = self._previous.get(prefix, (cuda, None))
        if buf is None or pinned != cuda or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        self._buffers[prefix] = (cuda, buf)
        (later if _storage_key(t) in deferred else now).append((prefix[:-1], t, buf))
        if where is not None:
            seen[where] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for _, b in self._buffers.values())

    def free(self) -> None:
        """Release the buffers (the next async save allocates them again)."""
        self._buffers = {}
