"""Liveness of a Checkpointer's ranks while its background work waits on them (README, "a hung peer").

A gloo collective whose peer stopped answering without closing its connections (a SIGSTOPped process, a
spot reclaim, a network partition) waits for its group's whole timeout, and the background groups keep
torch's 30 minutes: their collectives rightly wait for other ranks' I/O, minutes at real sizes (the job's
own timeout failed healthy slow saves: rev69g). Nor can the wait be cut: in torch 2.13 ``abort()``,
``shutdown()`` and ``destroy_process_group`` of a gloo group leave a collective blocked in it blocked
(fix70c). So liveness is watched, not duration: every process running background work beats a heartbeat
into the job's c10d store (:class:`Heartbeat`, a thread of its own, beating while its rank does I/O too, and
the process's one store connection for liveness); while a lane's work runs, a :class:`Watch` follows its
peers' beats, read by that thread for every watch of the process, and a peer silent for longer than the
job's own process-group timeout fails that work at once, naming the rank (:func:`abandon`); the
thread stuck in the collective is left behind (a daemon) and the Checkpointer refuses later saves.

Only multi-rank background work starts these threads: a one-process save never calls into this module.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from smpckpt.errors import CheckpointError

if TYPE_CHECKING:
    from smpckpt.api._async import Lane

__all__ = ["job_timeout", "Heartbeat", "Watch", "watch", "beat", "busy_now", "veto", "vetoed"]
__all__ += ["abandon", "veto_key", "claim_commit", "refuse_broken_group"]

log = logging.getLogger("smpckpt.api")

_KEY = "smpckpt/alive/{}"  # + the global rank: the process's beat, changed every period
#: the beat of a process with no background work running (between saves, or ended): it waits on no one and no one
#: waits on it in a background collective, so it is never called hung (and the store is not written while idle)
IDLE = b"idle"


def job_timeout() -> float | None:
    """The default process group's timeout in seconds, the shortest of its backends' (``None`` where torch
    does not tell: its backends' options are private API)."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        found = [pg._get_backend(device).options._timeout for device in pg._device_types]
    except Exception:  # noqa: BLE001 - another torch, or a backend without options
        return None
    found = [t for t in found if isinstance(t, datetime.timedelta) and t > datetime.timedelta(0)]
    return min(found).total_seconds() if found else None


def _period(bound: float) -> float:
    """How often a beat is written: many within the bound, never more than 5 s apart."""
    return min(5.0, max(0.05, bound / 10))


#: the store host's CPU per key a read returns (a multi-get of 4,096 keys took 10.5 ms on loopback, fix71f)
_KEY_COST = 2.6e-6


def _read_period(bound: float, world: int = 2) -> float:
    """How often a process with a watch running reads its peers' beats (one multi-get of their keys, to the
    store every rank shares): a few times within the bound, at least every 30 s -- stretched in a large world
    so that ``world`` ranks reading ``world`` keys each keep the store host's one thread under a fifth busy
    (``world**2 * _KEY_COST * 5``: 13 s at 1,000 ranks, 218 s at 4,096), never past half the bound."""
    base = min(30.0, max(_period(bound), bound / 5))
    return max(base, min(bound / 2, world * world * _KEY_COST * 5))


class Heartbeat(threading.Thread):
    """This process's one store connection for liveness (one thread per store: found in the interpreter's
    thread list, no registry), used by this thread alone: it beats while ``busy()`` (a lane's work runs),
    writes :data:`IDLE` once otherwise, and reads the peers of the :class:`Watch` es running in the process
    for them; it ends with the store (a process group destroyed since)."""

    def __init__(self, store: Any, rank: int, period: float, busy: Callable[[], bool]) -> None:
        super().__init__(name="smpckpt-heartbeat", daemon=True)
        self.store, self.rank, self.period, self.busy = store, rank, period, busy
        #: its own connection, made on this thread (a clone waits past the store's timeout on a stopped host:
        #: never on a caller's or a lane's thread, rev70g), used by this thread only: a store ``wait`` on
        #: another thread does not hold beats (rev70c M2), and a read stuck on a stopped host holds no lane
        #: (one TCPStore client serves one request at a time: a set behind a stuck get waited past 40 s)
        self.conn: Any = None
        self.said = b""  #: what the store holds for this rank (written by this thread alone)
        self.cond = threading.Condition()  # what the other threads ask (below) and what this one read
        self.stopped = threading.Event()
        self.asked = self.served = 0  #: fresh beats asked for by busy_now(), and written
        self.watches: list[Watch] = []  #: the watches whose peers this thread reads
        self.read: tuple[float, dict[int, bytes | None]] | None = None  #: when (monotonic), the beats read
        self._known: set[str] = set()  #: keys read before: there for good (one multi-get, no check first)

    def run(self) -> None:
        self.conn = _own(self.store)
        beat_due, read_due = 0.0, None
        while not self.stopped.is_set() and dist.is_initialized() and _store() is self.store:
            with self.cond:
                self.watches = [w for w in self.watches if not w.done.is_set()]
                watches, asked = list(self.watches), self.asked
            now = time.monotonic()
            if asked != self.served or now >= beat_due:
                self._beat(asked)
                beat_due = now + self.period
            if not watches:
                read_due = None
            elif read_due is None:
                read_due = now + min(_read_period(w.bound, w.world) for w in watches)
            elif now >= read_due:
                self._read(sorted({r for w in watches for r in w.peers}))
                read_due = time.monotonic() + min(_read_period(w.bound, w.world) for w in watches)
            with self.cond:  # woken early by busy_now() or a new watch
                if self.asked == asked and len(self.watches) == len(watches):
                    self.cond.wait(max(0.0, min(beat_due, read_due or beat_due) - time.monotonic()))

    def _beat(self, asked: int) -> None:
        value = self.next_beat() if self.busy() else IDLE
        if value != self.said:
            try:  # a stopped store host holds this thread only (busy_now waits for it with a bound)
                self.conn.set(_KEY.format(self.rank), value)
                self.said = value
            except Exception as exc:  # noqa: BLE001 - beats on: a passing error is no hang to a peer
                log.debug("heartbeat: the store refused a beat: %s", exc)
                return
        with self.cond:
            self.served = asked
            self.cond.notify_all()

    def _read(self, peers: list[int]) -> None:
        keys = [_KEY.format(r) for r in peers]
        try:
            if self._known.issuperset(keys) or self.conn.check(keys):
                found: list[bytes | None] = list(self.conn.multi_get(keys))
                self._known.update(keys)
            else:  # a peer that has not beaten yet (get would wait for its key): read the others one by one
                found = [self.conn.get(k) if self.conn.check([k]) else None for k in keys]
        except Exception as exc:  # noqa: BLE001 - no answer (the store's own timeout): the watches count silence
            self._known.clear()
            log.debug("liveness: the store did not answer: %s", exc)
            return
        with self.cond:
            self.read = (time.monotonic(), dict(zip(peers, found)))
            self.cond.notify_all()

    def next_beat(self) -> bytes:
        return f"{os.getpid()}:{time.monotonic_ns()}".encode()

    def read_after(
        self, since: float, wait: float, done: threading.Event
    ) -> tuple[float, dict[int, bytes | None]] | None:
        """The newest read, waited for up to ``wait`` seconds while none was made after ``since`` and ``done``
        (the watch's) is not set."""
        with self.cond:
            self.cond.wait_for(lambda: done.is_set() or (self.read is not None and self.read[0] > since), wait)
            return self.read

    def add(self, found: Watch) -> None:
        with self.cond:
            self.watches.append(found)
            self.cond.notify_all()

    def remove(self, found: Watch) -> None:
        """``found`` ended (its work ended, or it gave up): no longer read for, and woken now."""
        with self.cond:
            found.done.set()
            if found in self.watches:
                self.watches.remove(found)
            self.cond.notify_all()

    def beat_now(self) -> None:
        """(a lane's thread) A fresh beat written by this thread, waited for a bounded time: the store's host
        may be the stopped one, and a lane's thread never waits on it past that."""
        with self.cond:
            self.asked += 1
            asked = self.asked
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.served >= asked, timeout=max(1.0, self.period))

    @classmethod
    def ensure(cls, store: Any, rank: int, period: float, busy: Callable[[], bool]) -> Heartbeat:
        for thread in threading.enumerate():
            if isinstance(thread, cls) and thread.store is store and not thread.stopped.is_set():
                if thread.period <= period:
                    return thread
        found = cls(store, rank, period, busy)
        found.start()
        return found


def _own(store: Any) -> Any:
    """A connection of its own to ``store``: the TCPStore client serves one request at a time, and a store
    ``wait`` on the main thread (a late rank at ``new_group``) held the beats behind it: a healthy peer was
    called silent (rev70c M2)."""
    try:
        return store.clone()
    except Exception:  # noqa: BLE001 - a store that cannot clone (an older torch, a custom store): shared
        return store


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def beat(busy: Callable[[], bool]) -> None:
    """(every rank, as a lane starts: inside a save's agreement) This process's heartbeat runs from now on,
    beating while ``busy()``, so a peer's watch sees it before any of its own background work waits on it."""
    bound = job_timeout()
    if bound is not None and dist.is_initialized() and dist.get_world_size() > 1:
        Heartbeat.ensure(_store(), dist.get_rank(), _period(bound), busy)


def busy_now() -> None:
    """(a lane's thread, before its work) The beat leaves :data:`IDLE` now, not at the heartbeat's next turn:
    a process stopped right after would otherwise stay idle, never hung, to its peers."""
    for thread in threading.enumerate():
        if isinstance(thread, Heartbeat) and not thread.stopped.is_set() and thread.store is _store():
            thread.beat_now()
            return


class Watch(threading.Thread):
    """Follows ``peers``' beats, as ``heartbeat`` reads them, while one piece of a lane's work runs; calls
    ``fail(message)`` once a peer is silent for ``bound`` seconds (or the store itself does not answer for that
    long), then ends."""

    def __init__(
        self, heartbeat: Heartbeat, peers: list[int], bound: float, fail: Callable[[str], bool], world: int = 0
    ) -> None:
        super().__init__(name="smpckpt-liveness", daemon=True)
        self.heartbeat, self.peers, self.bound, self.fail = heartbeat, peers, bound, fail
        self.world = world or len(peers) + 1  #: the job's ranks, all reading the store host (its load)
        self.done = threading.Event()

    def stop(self) -> None:
        """(the lane's thread, its work ended) This watch ends now, not at the heartbeat's next read."""
        self.heartbeat.remove(self)

    def run(self) -> None:
        try:
            self._follow()
        finally:  # ended or gave up: the heartbeat stops reading for it
            self.heartbeat.remove(self)

    def _follow(self) -> None:
        period, heartbeat = _read_period(self.bound, self.world), self.heartbeat
        started = answered = time.monotonic()
        seen: dict[int, tuple[bytes | None, float]] = {r: (None, started) for r in self.peers}
        heartbeat.add(self)
        late = False  # no read for ``bound``: one more period is waited, timed from now (a process stopped and
        # let go, or starved of CPU, sees its heartbeat read at once; a stopped store host answers no read)
        while not self.done.is_set():
            read = heartbeat.read_after(answered, period, self.done)
            if self.done.is_set() or not heartbeat.is_alive():
                return  # the work ended, or its store is no longer the job's (a group destroyed: its calls say so)
            if read is None or read[0] <= answered:
                if time.monotonic() - answered > self.bound:
                    if late:
                        self.fail(
                            f"the job's c10d store did not answer for {self.bound:g}s (its host, rank 0 under "
                            "init_method tcp:// or env://, is stopped or its node is gone)"
                        )
                        return
                    late = True
                continue
            late = False
            answered, beats = read
            for rank in self.peers:
                beat = beats.get(rank)
                if beat is not None and (beat != seen[rank][0] or beat == IDLE):
                    seen[rank] = (beat, answered)
            silent = [r for r in self.peers if answered - seen[r][1] > self.bound]
            if silent:
                who = f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}"
                self.fail(
                    f"{who} gave no sign of life for {self.bound:g}s (the job's process-group timeout) while this "
                    "rank waited on it: its process is stopped or its node is gone (a spot reclaim, a network "
                    "partition)"
                )
                return


def watch(lane: Lane, fut: concurrent.futures.Future[None], tag: str) -> Watch | None:
    """(the lane's thread, before its work) Start watching the peers of ``lane``'s Checkpointer while ``fut``'s
    work runs (``None``: one rank, no process group, or no store or timeout torch tells)."""
    owner = lane.owner()
    if owner is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = owner._groups.process_group
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
        store = _store()
    except Exception:  # noqa: BLE001 - a group torn down: the work's own collectives say so
        return None
    bound, me = job_timeout(), dist.get_rank()
    if len(ranks) < 2 or bound is None:
        return None
    heartbeat = Heartbeat.ensure(store, me, _period(bound), lane.busy)
    peers = [r for r in ranks if r != me]
    fail = lambda why: abandon(lane, fut, tag, f"rank {me}: {why}")  # noqa: E731
    found = Watch(heartbeat, peers, bound, fail, dist.get_world_size())
    found.start()
    return found


def veto(key: str) -> None:
    """(a rank giving up a work) Set ``key`` in the job's store, on a thread of its own: the store's host may be
    the silent one."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    store = _store()

    def put() -> None:
        for _ in range(100):  # a stopped store host that comes back takes it then (README: its race)
            try:
                store.set(key, b"1")
                return
            except Exception as exc:  # noqa: BLE001 - no answer (the store's timeout): tried again
                log.debug("liveness: could not record %s yet: %s", key, exc)
            time.sleep(1.0)

    threading.Thread(target=put, name="smpckpt-liveness-veto", daemon=True).start()


def vetoed(key: str) -> bool:
    """(a committing rank) Whether a rank gave this work up (:func:`veto`); a store that does not answer (its
    own timeout) fails the commit."""
    return bool(dist.is_available() and dist.is_initialized() and _store().check([key]))


def abandon(lane: Lane, fut: concurrent.futures.Future[None], tag: str, why: str) -> bool:
    """(the watch) Fail ``fut``'s work on ``lane`` now, a peer silent (``why``), unless it is done; its thread
    may stay stuck in a collective (gloo's cannot be interrupted), so the Checkpointer refuses later saves,
    and the ranks that commit refuse it (:func:`veto`). True: given up."""
    owner = lane.owner()
    with lane._cond:
        if fut.done() or fut is not lane._current:
            return False
        if fut is lane._committed:  # this rank committed it (rank 0), a peer fell silent after
            outcome = " after this rank committed it (a restart may resume it; `smpckpt ls` shows it)"
        elif lane.kind == "save":
            outcome = ": it commits nothing from now on"
        else:
            outcome = ": it commits nothing to `path` from now on"
        exc = CheckpointError(
            f"{why}. {lane.what.capitalize()} of checkpoint {tag!r} was given up{outcome}; what was committed "
            "before is intact. Restart the job (its ranks are out of step: this Checkpointer refuses further "
            "saves, and its thread waiting on that rank is left behind)"
        )
        lane.abandoned, lane.failed, lane.failed_fut = fut, (tag, exc), fut  # type: ignore[assignment]
        key = veto_key(lane)
    veto(key)  # the ranks that commit (rank 0, node leaders) refuse it too if its silent rank comes back
    if owner is not None:
        owner._groups.out_of_step = f"an earlier background save or drain was given up ({why}): end the job"
    log.error("%s of checkpoint %r failed: %s", lane.what, tag, exc)
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # finished meanwhile: its outcome stands
        fut.set_exception(exc)
    return True


def veto_key(lane: Lane) -> str:
    """The store key a rank giving up ``lane``'s work running sets: the same on every rank (the Checkpointer's
    background group's name, the lane, the work's number)."""
    owner = lane.owner()
    group = owner._groups.named("save") if owner is not None else None
    return f"smpckpt/given-up/{getattr(group, 'group_name', '')}/{lane.kind}/{lane._number}"


def claim_commit(lane: Lane) -> None:
    """(``lane``'s thread, before its work commits a checkpoint or moves ``newest``) Refuse work given up on,
    by this rank or any other (its future failed already); else no watch here gives it up as uncommitted."""
    with lane._cond:
        given_up = lane._current is not None and lane._current is lane.abandoned
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        key = veto_key(lane) if lane._current is not None and multi else ""
    if given_up or (key and vetoed(key)):
        raise CheckpointError(
            "this work was given up while a peer was silent (its future failed then, on the rank that gave it "
            "up): nothing more is committed for it"
        )
    with lane._cond:
        lane._committed = lane._current


def refuse_broken_group(lane: Lane, tag: str, error: BaseException) -> None:
    """(``lane``'s work failed with ``error``) A gloo transport failure (a timeout, a peer gone) leaves the group
    unusable: every later save failed with "Application timeout caused pair closure", naming no rank. Later
    saves are refused by name instead."""
    owner, found = lane.owner(), ""
    seen: BaseException | None = error
    for _ in range(8):  # the raw gloo error is the deepest of the chain
        if seen is None:
            break
        text = str(seen)
        if "gloo/transport" in text or "pair closure" in text:
            found = text[max(text.find("gloo/transport"), 0) :].split("]", 1)[-1].strip()
            found = found.splitlines()[0].split(". ")[0][:200]
        seen = seen.__cause__ or seen.__context__
    if found and owner is not None:
        owner._groups.out_of_step = (
            f"{lane.what} of {tag!r} failed in a collective of this Checkpointer's gloo group ({found}), which "
            "leaves that group broken: end the job"
        )
