"""``save_checkpoint(..., async_save=True)``: training blocks only while the state is staged.

Which rank does what ("all" = every rank of the group)::

    (caller)  previous failure?   raise it once, naming its tag (never silently)
    (caller)  previous save?      wait for it (logged with how long), or raise with wait_for_previous=False
    (caller)  resolve_save, build_save_state         as a synchronous save (collectives on the caller's group)
    (caller)  stage                                  copy every tensor into host buffers reused across
                                                     saves (pinned for CUDA tensors): later in-place
                                                     updates never reach the checkpoint
    (thread)  write_checkpoint, publish_newest, retain   on a gloo group of their own, so the training
                                                     loop's collectives never interleave with the save's
    (thread)  future.set_result                      only after data, manifest and ``newest`` are durable
                                                     and retention ran

At most one save is in flight per process. ``wait_for_saves()`` finishes it; the interpreter's exit
waits for it too (before thread pools shut down: ``_register_exit_wait``), but a process group destroyed
first leaves a multi-rank save without its collectives: call ``wait_for_saves()`` before
``destroy_process_group()``. A process killed while a background save runs leaves ``newest`` on the previous committed
tag: ``newest`` moves only after the commit, and uncommitted folders are never taken as checkpoints.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from smpckpt.api._dist import DistContext
from smpckpt.errors import CheckpointError

__all__ = [
    "submit",
    "submit_drain",
    "drain_status",
    "DrainStatus",
    "wait_for_drain",
    "background_group",
    "stream_groups",
    "wait_for_saves",
    "free_staging_buffers",
    "check_previous",
    "staging_bytes",
    "async_used",
    "set_exit_status_on_failed_save",
]

log = logging.getLogger("smpckpt.api")


@dataclasses.dataclass
class _Lane:
    """One background thread's work: the background saves', or the drains' to the durable tier (tiered
    checkpoints). ``failed`` is kept for the next call to raise."""

    name: str  #: the thread's name prefix
    what: str  #: the work, as logs and errors name it
    executor: concurrent.futures.ThreadPoolExecutor | None = None
    fut: concurrent.futures.Future[None] | None = None
    tag: str = ""
    failed: tuple[str, BaseException] | None = None


@dataclasses.dataclass
class _State:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    save: _Lane = dataclasses.field(default_factory=lambda: _Lane("smpckpt-async-save", "the background save"))
    drain: _Lane = dataclasses.field(default_factory=lambda: _Lane("smpckpt-drain", "the drain to the durable tier"))
    groups: dict[Any, Any] = dataclasses.field(default_factory=dict)
    buffers: dict[tuple[str, tuple[int, ...], torch.dtype, bool], torch.Tensor] = dataclasses.field(
        default_factory=dict
    )
    atexit_registered: bool = False
    #: the process's exit status when a background save fails at (or before, unreported) its exit
    exit_status: int | None = 1
    #: the status the main thread last asked ``sys.exit`` for (``_record_exit_requests``): a program that
    #: exits with a failure status of its own keeps it
    program_status: int = 0


_STATE = _State()


def set_exit_status_on_failed_save(status: int | None = 1) -> None:
    """The exit status of a process whose background save failed and was never raised to it (the last
    save of a script that returns while it runs, or one whose failure no later call reported).

    Default 1: a job scheduler then sees the failure instead of a clean exit with its last checkpoint
    lost. ``None`` keeps the interpreter's own status (the failure is still logged at ERROR). A
    non-zero status ends the process with ``os._exit`` once the remaining ``atexit`` hooks have run
    and the standard streams are flushed: Python offers no other way to change the status of a
    program whose main code already returned. A program that ends with ``sys.exit(N)``, ``N`` a
    failure status of its own, keeps ``N``: CPython holds the status of a ``SystemExit`` where no
    exit hook can read it, so ``sys.exit`` is wrapped to note what the main thread asks of it (from
    the first background save on; a bare ``raise SystemExit(N)`` is not seen and gets this status)."""
    if status is not None and (isinstance(status, bool) or not isinstance(status, int) or not 0 <= status <= 255):
        raise ValueError(f"status must be an exit status 0..255 or None, got {status!r}")
    _STATE.exit_status = status


def async_used() -> bool:
    """Whether this process ever started a background save (then every save checks on it first)."""
    return _STATE.save.executor is not None or _STATE.drain.executor is not None


def check_previous(wait: bool) -> None:
    """(caller) Raise a background failure once; then wait for (or refuse) a save still in flight."""
    lane = _STATE.save
    if lane.fut is not None and not lane.fut.done() and not wait:
        raise CheckpointError(
            f"a background save of {lane.tag!r} is still running (wait_for_previous=False); call "
            "smpckpt.wait_for_saves() or save with wait_for_previous=True"
        )
    _wait_logged(lane.fut, f"the background save of {lane.tag!r} to finish")
    _raise_failed(" (this save was not started)")


def _wait_logged(fut: concurrent.futures.Future[None] | None, what: str) -> None:
    """Wait for ``fut`` when it is running, logging how long."""
    if fut is not None and not fut.done():
        started = time.monotonic()
        concurrent.futures.wait([fut])
        log.info("waited %.2fs for %s", time.monotonic() - started, what)


def _raise_failed(suffix: str) -> None:
    """Raise the failure the save thread kept, else the drain thread's (each once: it is then cleared)."""
    for lane in (_STATE.save, _STATE.drain):
        if lane.failed is not None:
            (tag, exc), lane.failed = lane.failed, None
            what = (
                f"the background save of checkpoint {tag!r}"
                if lane is _STATE.save
                else f"the drain of checkpoint {tag!r} to the durable tier"
            )
            kept = "" if lane is _STATE.save else "; it is still in the fast tier"
            raise CheckpointError(f"{what} failed: {type(exc).__name__}: {exc}{kept}{suffix}") from exc


def _recorded(lane: _Lane, tag: str, work: Callable[[], None]) -> None:
    """(a background thread) ``work()``; its failure is kept in ``lane.failed`` for the next call to raise."""
    try:
        work()
    except BaseException as exc:
        lane.failed = (tag, exc)
        log.error("%s of checkpoint %r failed: %s", lane.what, tag, exc)
        raise


def submit_drain(tag: str, work: Callable[[], None], lane: _Lane | None = None) -> concurrent.futures.Future[None]:
    """Run ``work`` on ``lane``'s thread (default: a drain to the durable tier, after the drain before it);
    the exit wait is registered the first time."""
    st = _STATE
    lane = lane or st.drain
    with st.lock:
        if not st.atexit_registered:
            _register_exit_wait()
            st.atexit_registered = True
        lane.executor = lane.executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=lane.name)
        lane.fut, lane.tag = lane.executor.submit(_recorded, lane, tag, work), tag
        return lane.fut


@dataclasses.dataclass(frozen=True)
class DrainStatus:
    """The last drain of this process to the durable tier (tiered checkpoints)."""

    tag: str
    state: Literal["running", "done", "failed"]
    error: str | None = None  #: the failure, until ``wait_for_saves`` or the next save raised it


def drain_status() -> DrainStatus | None:
    """The state of this process's last drain to the durable tier (``None``: none started)."""
    lane = _STATE.drain
    if lane.fut is None:
        return None
    if not lane.fut.done():
        return DrainStatus(lane.tag, "running")
    if lane.failed is not None and lane.failed[0] == lane.tag:
        return DrainStatus(lane.tag, "failed", f"{type(lane.failed[1]).__name__}: {lane.failed[1]}")
    return DrainStatus(lane.tag, "failed" if lane.fut.exception() is not None else "done")


def wait_for_drain() -> None:
    """Wait for the drain in flight (no error raised here: the next save or ``wait_for_saves`` does)."""
    _wait_logged(_STATE.drain.fut, f"the drain of {_STATE.drain.tag!r} to the durable tier")


def background_group(process_group: Any, ctx: DistContext, purpose: str = "save") -> Any:
    """(all ranks of the group, collectively, the first time) A gloo group over the same ranks, one per
    ``purpose``: ``"save"`` (background saves, the fast tier's transfers) and ``"drain"`` (the drain
    thread, which runs beside them: two threads never share a group's collectives)."""
    if not ctx.active or ctx.world_size == 1:
        return None
    key = (purpose, id(process_group) if process_group is not None else "default")
    group = _STATE.groups.get(key)
    if group is None:
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None)
        _STATE.groups[key] = group
    return group


def _stage(state: Any, prefix: str = "") -> Any:
    """A copy of ``state`` whose tensors live in buffers of ours, reused across saves of the same structure."""
    if isinstance(state, dict):
        return {k: _stage(v, f"{prefix}{k}.") for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_stage(v, f"{prefix}{i}.") for i, v in enumerate(state))
    if not isinstance(state, torch.Tensor):
        return state
    t = state.detach()
    if not (type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)):
        return t.clone()  # DTensor and other subclasses: a copy on their own device
    cuda = t.device.type == "cuda"
    key = (prefix, tuple(t.shape), t.dtype, cuda)
    buf = _STATE.buffers.get(key)
    if buf is None:
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        _STATE.buffers[key] = buf
    buf.copy_(t, non_blocking=cuda)
    return buf


def staging_bytes() -> int:
    """Bytes held in reused staging buffers (one copy of the state saved asynchronously)."""
    return sum(b.numel() * b.element_size() for b in _STATE.buffers.values())


def free_staging_buffers() -> None:
    """Release the reused staging buffers (after waiting for the save in flight)."""
    wait_for_saves(raise_errors=False)
    _STATE.buffers.clear()


def stream_groups(process_group: Any, ctx: DistContext) -> tuple[Any, ...]:
    """(all ranks, collectively the first time) The gloo groups the fast tier moves files over: the
    ``"save"`` group and ``STREAMS - 1`` more (``()`` without a process group)."""
    from smpckpt.storage.tier import STREAMS

    if not ctx.active or ctx.world_size == 1:
        return ()
    return (
        background_group(process_group, ctx),
        *(background_group(process_group, ctx, f"stream{i}") for i in range(1, STREAMS)),
    )


def submit(
    tag: str,
    ctx: DistContext,
    process_group: Any,
    state: dict[str, Any],
    work: Callable[[dict[str, Any], Any], None],
) -> concurrent.futures.Future[None]:
    """(caller) Stage ``state``, then run ``work(staged_state, background_group)`` on the save thread."""
    group = background_group(process_group, ctx)
    started = time.monotonic()
    staged = _stage(state)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the device-to-host copies were issued non-blocking
    log.info("staged checkpoint %r in %.3fs; writing in the background", tag, time.monotonic() - started)
    return submit_drain(tag, lambda: work(staged, group), _STATE.save)


def _forget_in_child() -> None:
    """(a forked child) The parent's save in flight is not this process's: no thread here will ever
    finish its future, so a child that waited for it (at exit, or in its own save) would hang."""
    global _STATE
    _STATE = _State(atexit_registered=True)  # the inherited exit hook stays, with nothing to wait for


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _register_exit_wait() -> None:
    """Finish the save in flight when the interpreter exits.

    Why not ``atexit``: at exit CPython first runs the hooks ``threading`` keeps (concurrent.futures'
    among them: after it, no thread pool takes work), then joins non-daemon threads, and only then runs
    ``atexit`` hooks. A background save still opening its writer pools then failed ("cannot schedule
    new futures after interpreter shutdown") and the checkpoint was lost while the process exited 0.
    Registered after concurrent.futures', ours runs before it (those hooks run newest first)."""
    # not CPython >= 3.9 (no threading._register_atexit): the plain hook is the best left
    (getattr(threading, "_register_atexit", None) or atexit.register)(_wait_at_exit)
    _record_exit_requests()


def _record_exit_requests() -> None:
    """Wrap ``sys.exit`` so the exit hook knows the status the program asked for (see
    :func:`set_exit_status_on_failed_save`); it still raises ``SystemExit`` with the same argument."""
    real = sys.exit
    if getattr(real, "_smpckpt_records", False):
        return

    def exit(*args: Any) -> Any:  # noqa: A001 - stands in for sys.exit, under its name
        if threading.current_thread() is threading.main_thread():  # another thread's SystemExit ends only it
            _STATE.program_status = _status_of(args[0] if args else None)
        return real(*args)

    exit.__doc__ = real.__doc__
    exit._smpckpt_records = True  # type: ignore[attr-defined]
    sys.exit = exit


def _status_of(code: Any) -> int:
    """The process exit status a ``SystemExit(code)`` gives (a code other than None or an int: 1)."""
    if code is None:
        return 0
    return int(code) & 0xFF if isinstance(code, int) else 1


def _wait_at_exit() -> None:
    """(interpreter exit) Wait for the save in flight; a failure is logged at ERROR naming the tag, and
    the process exits with :func:`set_exit_status_on_failed_save`'s status (1 by default)."""
    save, drain = _STATE.save, _STATE.drain
    if save.fut is not None and not save.fut.done():
        log.info("waiting for the background save of %r to finish before exiting", save.tag)
    if drain.fut is not None and not drain.fut.done():
        log.info("waiting for the drain of %r to the durable tier before exiting", drain.tag)
    try:
        wait_for_saves(raise_errors=True)
    except CheckpointError as exc:
        status = _STATE.exit_status
        if status and _STATE.program_status:
            status = _STATE.program_status  # the program's own failure status stays what it asked for
        suffix = f"; exiting with status {status}" if status else ""
        log.error("%s (at interpreter exit; `smpckpt ls` shows what committed)%s", exc, suffix)
        if status:
            atexit._run_exitfuncs()  # what a normal exit still runs (logging's flush among them)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream must not hide the status
                    pass
            os._exit(status)


def wait_for_saves(*, raise_errors: bool = True) -> None:
    """Block until the background save in flight (if any) and then the drain to the durable tier (tiered
    checkpoints) have finished. With ``raise_errors``, a failure of either is raised here (and not again
    by the next ``save_checkpoint``)."""
    # the save first: a background save of a durable tag submits its drain when its fast tier committed
    for lane in (_STATE.save, _STATE.drain):
        if lane.fut is not None:
            concurrent.futures.wait([lane.fut])
    if raise_errors:
        _raise_failed("")
