"""The background lanes of a :class:`~smpckpt.Checkpointer`: its async saves and its drains each run, in
order, on a thread of their own (a gloo group of the Checkpointer's own, so training's collectives never
interleave); training blocks only while the state is staged (below). A previous failure is raised
once, naming its tag; a future completes only after data, manifest and ``newest`` are durable and
retention ran.

No registry of lanes: their threads are :class:`LaneThread`\\ s, so :func:`wait_for_saves` and
:func:`drain_status` find every live Checkpointer's work in the interpreter's thread list. The exit waits
for it too (:func:`register_exit_wait`), but a multi-rank save needs its process group: call
``wait_for_saves()`` before ``destroy_process_group()``.

What an async save writes is staged first (:mod:`smpckpt.api._staging`).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours (ours runs first)
import contextlib
import dataclasses
import datetime
import functools
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch.distributed as dist

from smpckpt._gc import forget_at_fork
from smpckpt.api import _liveness
from smpckpt.api._dist import DistContext
from smpckpt.errors import CheckpointError

__all__ = ["Lane", "LaneThread", "GlooGroups", "DrainStatus", "check_previous", "raise_failed", "wait_lanes"]
__all__ += ["wait_logged", "commit_point"]
__all__ += ["register_exit_wait", "live_lanes", "wait_for_saves", "drain_status", "free_staging_buffers"]

log = logging.getLogger("smpckpt.api")


class LaneThread(threading.Thread):
    """The thread of one :class:`Lane` (how :func:`wait_for_saves` finds it among the interpreter's)."""

    def __init__(self, lane: Lane) -> None:
        super().__init__(name=lane.name, daemon=True)  # its exit hook waits for its work, then ends it
        self.lane = lane

    def run(self) -> None:
        self.lane.run()


class SeenFuture(concurrent.futures.Future[None]):
    """A lane's future, noting whether the program saw its failure (``result()`` raised it, ``exception()``
    returned it): that failure is then the program's, not one to report as unseen at exit (hunt69b F6: a
    program that handled it still exited 1). The package's own reads go through :func:`failure_of`."""

    seen = False

    def result(self, timeout: float | None = None) -> None:
        try:
            return super().result(timeout)
        except BaseException as exc:
            # the failure itself, not a TimeoutError the lane's failure landed just after (rev70d L1)
            self.seen = self.seen or (self.done() and not self.cancelled() and exc is failure_of(self))
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        self.seen = self.seen or exc is not None
        return exc


def failure_of(fut: concurrent.futures.Future[None]) -> BaseException | None:
    """(the package's read of a done future) Its failure, without marking it seen by the program."""
    return concurrent.futures.Future.exception(fut, 0)


class Lane:
    """One kind of background work of one Checkpointer (saves, or drains), run in order on a
    :class:`LaneThread` started at the first :meth:`submit`; ``failed`` is kept for the next call to raise."""

    def __init__(self, kind: Literal["save", "drain"], what: str, owner: Any) -> None:
        self.kind, self.what, self.name = kind, what, f"smpckpt-{'async-save' if kind == 'save' else 'drain'}"
        self.owner = weakref.ref(owner)  #: the Checkpointer (module functions reach it through the thread)
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, Callable[[], None], SeenFuture, int]] = collections.deque()
        self._submitted = 0  #: works submitted: the same count on every rank (their saves and drains are agreed)
        self._thread: LaneThread | None = None  #: the thread running the lane's work, while it runs
        self.used = False  #: work was ever submitted (then every save checks on this lane first)
        self._stopping = False
        self.fut: concurrent.futures.Future[None] | None = None  #: the last work submitted
        self.tag = ""  #: its tag
        self.submitted = 0.0  #: when (``time.monotonic``): the newest drain of the process is the last one
        self.failed: tuple[str, BaseException] | None = None
        self.failed_fut: SeenFuture | None = None  #: the future of ``failed``'s work (did the program see it?)
        #: work given up on while a peer was silent (``_liveness.abandon``): its thread may stay stuck in a collective
        self.abandoned: concurrent.futures.Future[None] | None = None
        self._number = 0  #: the work running's number (``_liveness.veto_key``)
        self._current: concurrent.futures.Future[None] | None = None  #: the work running, and if it passed
        self._committed: concurrent.futures.Future[None] | None = None  # its commit point (:func:`commit_point`)
        forget_at_fork(self)

    @property
    def running(self) -> bool:
        return self.fut is not None and not self.fut.done()

    def submit(self, tag: str, work: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Run ``work()`` on the lane's thread after the work before it; its failure is kept in ``failed``."""
        fut = SeenFuture()
        with self._cond:
            self.start()
            self.used = True
            self._submitted += 1
            self._queue.append((tag, work, fut, self._submitted))
            self.fut, self.tag, self.submitted = fut, tag, time.monotonic()
            self._cond.notify()
        return fut

    def start(self) -> None:
        """Start the lane's thread unless it runs. An async save starts it inside its ranks' agreement: a
        rank whose thread cannot start fails every rank's save, not only its own while the others' writes
        wait for it in their collectives."""
        with self._cond:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                _liveness.beat(self.busy)  # every rank beats before any peer's background work may wait on it
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                thread = LaneThread(self)
                thread.start()  # kept only once started: stop(join=True) must never join one that is not
                self._thread = thread

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
                tag, work, fut, number = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            self._current, self._number = fut, number
            watch = None
            if self.owner() is not None and _multi_rank():
                _liveness.busy_now()
                watch = _liveness.watch(self, fut, tag)
            error: BaseException | None = None
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - kept for the next call, raised by the future
                error = exc
            finally:
                if watch is not None:
                    watch.stop()
            with self._cond:  # settled under the lock: abandon() may be failing it from the watch right now
                self._current = None
                given_up = fut is self.abandoned
                if error is not None and not given_up:
                    self.failed, self.failed_fut = (tag, error), fut
            if error is not None and not given_up and _multi_rank():
                _liveness.refuse_broken_group(self, tag, error)
            if given_up:  # its failure was raised already (a peer fell silent); what the thread did since is moot
                log.warning("%s of checkpoint %r, given up on, ended: %s", self.what, tag, error or "done")
            elif error is not None:
                log.error("%s of checkpoint %r failed: %s", self.what, tag, error)
                fut.set_exception(error)
            else:
                fut.set_result(None)
            del work, error  # they hold the staged state and the Checkpointer: nothing of it is kept while idle

    @staticmethod
    def busy() -> bool:
        """Whether a lane's work runs in this process (its heartbeat beats then: :mod:`._liveness`)."""
        return any(lane._current is not None for lane in live_lanes())

    def wait(self) -> None:
        """Wait for the work in flight (no error raised here)."""
        fut = self.fut
        if fut is not None:
            concurrent.futures.wait([fut])

    def take_failed(self) -> tuple[str, BaseException] | None:
        """The failure kept, once (then cleared; a stopped lane's thread, kept for it, ends)."""
        with self._cond:
            failed, self.failed, self.failed_fut = self.failed, None, None
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
            if self.abandoned is None:  # a thread given up on may be stuck in a collective for its 30 minutes
                thread.join()

    def _forget(self) -> None:
        """(a forked child) The parent's work is not this process's: no thread here will ever finish its
        future, so a child that waited for it (at exit, or in its own save) would hang."""
        self._cond = threading.Condition()  # the parent's may have been held by a thread that is gone
        self._queue.clear()
        self._thread, self.fut, self.failed, self.failed_fut, self.used = None, None, None, None, False
        self.abandoned = self._current = self._committed = None


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def commit_point() -> None:
    """(before a commit, or ``newest`` is moved) On a lane's thread: :func:`._liveness.claim_commit`; elsewhere
    nothing (a synchronous save)."""
    thread = threading.current_thread()
    if isinstance(thread, LaneThread):
        _liveness.claim_commit(thread.lane)


def wait_logged(fut: concurrent.futures.Future[None] | None, what: str) -> None:
    if fut is not None and not fut.done():
        started = time.monotonic()
        concurrent.futures.wait([fut])
        log.info("waited %.2fs for %s", time.monotonic() - started, what)


def _healed(lane: Lane, failed: tuple[str, BaseException]) -> bool:
    """``lane``'s failed drain of ``failed[0]`` was drained again since, and committed, by another Checkpointer's
    drain of the same root (a job giving each save a new model object has a Checkpointer per save): nothing
    is left to report (it was raised by ``wait_for_saves`` as a failure: rev68i)."""
    owner = lane.owner()
    root = getattr(owner, "_root_key", None)
    for other in live_lanes():
        fut = other.fut
        if other is lane or other.kind != "drain" or other.tag != failed[0] or other.submitted <= lane.submitted:
            continue
        if root is not None and getattr(other.owner(), "_root_key", None) == root and fut is not None and fut.done():
            if not fut.cancelled() and failure_of(fut) is None:
                return True
    return False


def raise_failed(lanes: Iterable[Lane], suffix: str) -> None:
    """Raise the first failure a lane kept (each once: it is then cleared); saves before drains. A drain
    failure healed since (:func:`_healed`) is cleared, logged, not raised."""
    for lane in sorted(lanes, key=lambda lane: lane.kind != "save"):
        if (failed := lane.take_failed()) is not None:
            tag, exc = failed
            if lane.kind == "drain" and _healed(lane, failed):
                log.info("the failed drain of checkpoint %r was drained again since, and committed: %s", tag, exc)
                continue
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
        return cls(lane.tag, "failed" if failure_of(fut) is not None else "done")


def drain_status() -> DrainStatus | None:
    """The newest drain of any live Checkpointer (``None``: none started); ``Checkpointer.drain_status``."""
    drains = [lane for lane in live_lanes() if lane.kind == "drain"]
    return DrainStatus.of(max(drains, key=lambda lane: lane.submitted)) if drains else None


def group_alive(group: Any) -> bool:
    """Whether torch still knows ``group`` (not destroyed with its job's by ``destroy_process_group()``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - torch: KeyError (or ValueError) for a group it no longer knows
        return False
    return True


@contextlib.contextmanager
def group_kept(group: Any, what: str) -> Iterator[None]:
    """(background work over ``group``) A failure once the process group was destroyed under it names that
    cause: it came out as "dcp.save's world has 1 ranks but the layout ... describes 2" (hunt69b F2)."""
    try:
        yield
    except BaseException as exc:
        if group is None or group_alive(group):
            raise
        raise CheckpointError(
            f"{what} failed: the process group was destroyed (destroy_process_group()) while it ran: call wait() "
            "(or close(), smpckpt.wait_for_saves()) on every rank before destroy_process_group(); what was "
            f"committed before is intact ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc


class GlooGroups:
    """A Checkpointer's gloo groups, one per purpose (``"save"``: background saves and the fast tier's
    agreements; ``"drain"``; further transfer streams), each created collectively when first needed."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self._groups: dict[str, Any] = {}
        self.out_of_step = ""  # why this rank's saves no longer meet the others' (:meth:`join`)
        self.bound: float | None = None  # the join's timeout, once its group is made: bounds close()'s barriers too

    def serves(self, process_group: Any) -> bool:
        """Whether these groups are over the ranks of ``process_group`` (``None``: the world)."""
        if not (dist.is_available() and dist.is_initialized()):
            return True
        ranks = [self.process_group, process_group]
        for i, pg in enumerate(ranks):
            ranks[i] = list(range(dist.get_world_size())) if pg is None else dist.get_process_group_ranks(pg)
        return ranks[0] == ranks[1]

    def get(self, ctx: DistContext, purpose: str = "save", timeout: float | None = None) -> Any:
        """(all ranks, collectively the first time) The group for ``purpose`` (``None``: no process group),
        made with ``timeout`` seconds (``None``: torch's default)."""
        if not ctx.active or ctx.world_size == 1:
            return None
        group = self._groups.get(purpose)
        self.refuse_stale(ctx)
        if group is None:
            pg = self.process_group
            ranks = dist.get_process_group_ranks(pg) if pg is not None else None
            # torch's default (30 minutes), not the job's own timeout: the collectives of a background save, a
            # drain and a fast-tier transfer wait for other ranks' I/O, which may rightly take longer than the
            # job's collectives may (rev69g: a rank writing 15 s slower failed a save at an 8 s job timeout)
            wait = datetime.timedelta(seconds=timeout) if timeout is not None else None
            group = dist.new_group(
                ranks=ranks, backend="gloo", timeout=wait, use_local_synchronization=ranks is not None
            )
            self._groups[purpose] = group
            self.bound = timeout if purpose == "join" else self.bound
        return group

    kept = staticmethod(group_kept)

    def named(self, purpose: str) -> Any:
        """The group made for ``purpose``, if it was (``None``: not yet)."""
        return self._groups.get(purpose)

    def stale(self) -> bool:
        """Whether its groups died with a process group destroyed since (``destroy_process_group()``)."""
        return any(not group_alive(group) for group in self._groups.values())

    def refuse_stale(self, ctx: DistContext) -> None:
        """Refuse, by name, to use groups of a process group destroyed since: torch said only "Group ... is not
        registered", and an in-process restart's every save failed so (hunt69b F3)."""
        if ctx.active and self.stale():
            raise CheckpointError(
                f"rank {ctx.rank} of {ctx.world_size}: this Checkpointer's background gloo groups belong to a "
                "process group destroyed since it was built (destroy_process_group()): build a new Checkpointer "
                "after init_process_group(). Nothing was written; what was committed before is intact"
            )

    def join(self, ctx: DistContext, timeout: float | None, action: str) -> None:
        """(all ranks, a save's first step) Every rank enters within ``timeout`` seconds (``None``: unchecked),
        met on a gloo barrier of its own that tells rank 0 who is missing: met on the caller's group, a save
        made by some ranks only (a SIGTERM handler's) met the others inside their training collectives and
        every rank hung until the group's timeout (hunt66d P2). The group is made after a call's agreement
        (every rank in step, :meth:`Checkpointer._agreed`), so the first call has none: it meets there."""
        if self.out_of_step:
            raise CheckpointError(f"rank {ctx.rank} of {ctx.world_size}: {action}: refused: {self.out_of_step}")
        self.refuse_stale(ctx)
        group = self._groups.get("join")
        if timeout is None or group is None:
            return
        try:
            dist.monitored_barrier(group, datetime.timedelta(seconds=timeout), wait_all_ranks=True)
            return
        except RuntimeError as exc:
            error, text = exc, str(exc)
        # its peers may never come: no barrier on it at close; later saves would pair with stale messages
        self._groups.pop("join", None)
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
        # the others closed the meeting: they gave up after join_timeout (this rank came late), or one died
        closed = any(m in text.lower() for m in ("connection closed", "connection reset", "broken pipe"))
        if closed:  # who is not known: naming the others as not having entered was wrong (rev67d F3)
            who = "the other ranks left the save's meeting: a rank died or was killed, or they gave up after "
            who += f"join_timeout ({timeout:g}s; this rank entered late)"
        elif found:
            missing = [r.strip() for r in found.group(1).split(",") if r.strip()]
            who = f"rank{'s' * (len(missing) > 1)} {', '.join(missing)} did not enter the save"
        elif ctx.world_size == 2:
            who = f"rank {1 - ctx.rank} did not enter the save"
        elif "from rank 0" in text:
            who = "rank 0 did not confirm that every rank entered the save (its own error names those missing)"
        else:
            who = "some of the other ranks did not enter the save (gloo cannot tell which)"
        self.out_of_step = f"an earlier save's ranks did not meet ({who}): end the job"
        if closed:
            raise CheckpointError(
                f"rank {ctx.rank} of {ctx.world_size}: {action}: {who}. Nothing was written, what was committed "
                "before is intact, and this Checkpointer refuses further saves (its ranks are out of step)"
            ) from error
        raise CheckpointError(
            f"rank {ctx.rank} of {ctx.world_size}: {action}: {who} within {timeout:g}s (Sharding.join_timeout): "
            "most likely they are still in a training collective, as when only some ranks save (from a SIGTERM "
            "handler, or on a flag only they check). Nothing was written, what was committed before is intact, "
            "and this Checkpointer refuses further saves (its ranks are out of step). Set a flag in the handler, "
            'agree on it at a step boundary and save there on every rank (README, "Preemption")'
        ) from error

    def streams(self, ctx: DistContext) -> tuple[Any, ...]:
        """(all ranks, collectively the first time) The groups the fast tier moves files over: the
        ``"save"`` group and ``STREAMS - 1`` more (``()`` without a process group)."""
        from smpckpt.storage.tier import STREAMS

        if not ctx.active or ctx.world_size == 1:
            return ()
        return (self.get(ctx), *(self.get(ctx, f"stream{i}") for i in range(1, STREAMS)))

    def destroy(self) -> None:
        """(all ranks, collectively) Each group once every rank is past its last collective there; with a join
        bound, none: the process keeps them (a rank out of step since a save only some ranks entered never
        comes to a barrier, and a gloo barrier's send waits the group's whole timeout: rev67d F2, rev67f F1)."""
        groups, self._groups = list(self._groups.values()), {}
        if self.out_of_step or self.bound is not None:
            return
        met = True
        for group in groups:
            if not (dist.is_available() and dist.is_initialized()):
                return
            if met:
                try:  # bounded by the group's timeout (a peer whose with block raised comes when its process ends)
                    dist.barrier(group=group)
                except Exception as exc:  # noqa: BLE001 - a group torn down with the job's, or a peer not coming
                    met = False  # no more barriers: each would wait the whole timeout again (hunt69b F1b)
                    log.warning(
                        "close(): not every rank came to tear down this Checkpointer's background groups "
                        "(one whose with block raised, or that died): left them without waiting (%s)",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    )
            with contextlib.suppress(Exception):  # a group torn down with the job's already
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


def register_exit_wait(lanes: tuple[Lane, Lane], exit_status: int | None, leader: bool = True) -> None:
    """Finish ``lanes``' work when the interpreter exits (the hook holds the lanes, never the
    Checkpointer), and wrap ``sys.exit`` once (:class:`ExitRecorder`). Not ``atexit``: it runs after
    ``threading``'s exit hooks, when concurrent.futures takes no more work, so a background save opening
    its writer pools failed and the checkpoint was lost while the process exited 0. Registered after
    concurrent.futures' (imported above), ours runs before it (those hooks run newest first). ``leader``:
    this rank is its Checkpointer's rank 0, the one that says the exit waits (every rank waits)."""
    # not CPython >= 3.9 (no threading._register_atexit): the plain hook is the best left
    hook = functools.partial(_wait_at_exit, lanes, exit_status, leader)
    (getattr(threading, "_register_atexit", None) or atexit.register)(hook)
    if not isinstance(sys.exit, ExitRecorder):
        sys.exit = ExitRecorder(sys.exit)


def _unseen_failure(lane: Lane) -> CheckpointError | None:
    """(interpreter exit) ``lane``'s kept failure unless the program saw it from its future (then it is the
    program's: logged at INFO, and no exit status of ours: hunt69b F6); taken either way."""
    fut = lane.failed_fut
    if fut is None or not fut.seen:
        try:
            raise_failed((lane,), "")
        except CheckpointError as exc:
            return exc
        return None
    if (taken := lane.take_failed()) is not None:
        log.info("%s of %r failed, as its future told the program (not reported again at exit): %s", lane.what, *taken)
    return None


def _wait_at_exit(lanes: tuple[Lane, Lane], exit_status: int | None, leader: bool = True) -> None:
    """(interpreter exit) Wait for the work in flight, then end the lanes' threads; a failure the program was
    not told (by its future, ``wait()``, ``wait_for_saves()`` or the next save) is logged at ERROR naming the
    tag, and the process exits with :attr:`AsyncOptions.exit_status` (1 by default)."""
    save, drain = lanes
    for lane in lanes:
        if lane.running:  # at hundreds of ranks, one line per job: rank 0's (hunt69b F5); a failure is every rank's
            log.log(
                logging.WARNING if leader else logging.DEBUG, "waiting for %s of %r before exiting", lane.what, lane.tag
            )
    wait_lanes(save, drain, raise_errors=False)
    failures = [exc for lane in lanes if (exc := _unseen_failure(lane)) is not None]
    if failures:
        status = exit_status
        program = sys.exit.status if isinstance(sys.exit, ExitRecorder) else 0
        if status and program:
            status = program  # the program's own failure status stays what it asked for
        suffix = f"; exiting with status {status}" if status else ""
        for exc in failures:
            log.error("%s (at interpreter exit; `smpckpt ls` shows what committed)%s", exc, suffix)
        if status:
            # every other Checkpointer's work in flight finishes first (its hook would run after this one,
            # and os._exit ends the process before it): its final save is not lost to this one's failure
            for other in sorted(live_lanes(), key=lambda lane: lane.kind != "save"):
                if other is save or other is drain:
                    continue
                other.wait()
                if (exc := _unseen_failure(other)) is not None:
                    log.error("%s (at interpreter exit)", exc)
            atexit._run_exitfuncs()  # what a normal exit still runs (logging's flush among them)
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):  # a closed stream must not hide the status
                    stream.flush()
            os._exit(status)
    for lane in lanes:
        lane.stop(join=True)
