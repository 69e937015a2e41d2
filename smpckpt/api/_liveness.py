"""Liveness of a Checkpointer's ranks while its background work waits on them (README, "a hung peer").

A gloo collective whose peer stopped answering without closing its connections (a SIGSTOPped process, a
spot reclaim, a network partition) waits for its group's whole timeout, and the background groups keep
torch's 30 minutes: their collectives rightly wait for other ranks' I/O, minutes at real sizes (the job's
own timeout failed healthy slow saves: rev69g). Nor can the wait be cut: in torch 2.13 ``abort()``,
``shutdown()`` and ``destroy_process_group`` of a gloo group leave a collective blocked in it blocked
(fix70c). So liveness is watched, not duration: every process running background work beats a heartbeat
into the job's c10d store (:class:`Heartbeat`, a thread of its own, beating while its rank does I/O too);
while a lane's work runs, a :class:`Watch` reads its peers' beats, and a peer silent for longer than the
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


def _read_period(bound: float) -> float:
    """How often a watch reads its peers' beats (each read is a check and a multi-get of every peer's key, to the
    store every rank shares): a few times within the bound, at least every 30 s."""
    return min(30.0, max(_period(bound), bound / 5))


class Heartbeat(threading.Thread):
    """This process's beat in the job's store while ``busy()`` (a lane's work runs), :data:`IDLE` once
    otherwise (one thread per store: found in the interpreter's thread list, no registry); it ends with the
    store (a process group destroyed since)."""

    def __init__(self, store: Any, rank: int, period: float, busy: Callable[[], bool]) -> None:
        super().__init__(name="smpckpt-heartbeat", daemon=True)
        self.store, self.rank, self.period, self.busy = store, rank, period, busy
        #: its own connection, made on this thread (a clone waits past the store's timeout on a stopped host:
        #: never on a caller's thread, rev70g): a store wait on another thread must not hold beats (rev70c M2)
        self.conn: Any = None
        self.said = b""  #: what the store holds for this rank (busy_now() writes too, under ``lock``)
        self.lock = threading.Lock()  # the write and ``said`` together: else a stale beat stayed (rev70g M)
        self.stopped = threading.Event()

    def run(self) -> None:
        self.conn = _own(self.store)
        while not self.stopped.is_set() and dist.is_initialized() and _store() is self.store:
            with self.lock:  # a store host that is stopped holds this thread (and busy_now) only: watches are bounded
                value = self.next_beat() if self.busy() else IDLE
                if value != self.said:
                    try:
                        self.conn.set(_KEY.format(self.rank), value)
                        self.said = value
                    except Exception as exc:  # noqa: BLE001 - beats on: a passing error is no hang to a peer
                        log.debug("heartbeat: the store refused a beat: %s", exc)
            self.stopped.wait(self.period)

    def next_beat(self) -> bytes:
        return f"{os.getpid()}:{time.monotonic_ns()}".encode()

    @classmethod
    def ensure(cls, store: Any, rank: int, period: float, busy: Callable[[], bool]) -> None:
        for thread in threading.enumerate():
            if isinstance(thread, cls) and thread.store is store and not thread.stopped.is_set():
                if thread.period <= period:
                    return
        cls(store, rank, period, busy).start()


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
            with thread.lock:
                try:
                    value = thread.next_beat()
                    (thread.conn or thread.store).set(_KEY.format(thread.rank), value)
                    thread.said = value  # what the store holds now: the thread's next IDLE is written
                except Exception as exc:  # noqa: BLE001 - the heartbeat's next turn writes it
                    log.debug("heartbeat: the store refused a beat: %s", exc)
            return


class Watch(threading.Thread):
    """Reads ``peers``' beats while one piece of a lane's work runs; calls ``fail(message)`` once a peer is
    silent for ``bound`` seconds (or the store itself does not answer for that long), then ends."""

    def __init__(self, store: Any, peers: list[int], bound: float, fail: Callable[[str], bool]) -> None:
        super().__init__(name="smpckpt-liveness", daemon=True)
        self.store, self.peers, self.bound, self.fail = store, peers, bound, fail
        self.done = threading.Event()
        self._reader: threading.Thread | None = None
        self._read: list[bytes | None] | None = None
        self._conn: Any = None  # a store connection of its own, as the heartbeat's (never behind a store wait)

    def _read_beats(self) -> None:
        keys = [_KEY.format(r) for r in self.peers]
        try:
            if self._conn is None:  # made here, on the bounded reader: a clone waits on a stopped host (rev70g)
                self._conn = _own(self.store)
            store = self._conn
            if store.check(keys):
                self._read = list(store.multi_get(keys))
            else:  # a peer that has not beaten yet (get would wait for its key): read the others one by one
                self._read = [store.get(k) if store.check([k]) else None for k in keys]
        except Exception as exc:  # noqa: BLE001 - no answer (the store's own timeout): counted as silence
            log.debug("liveness: the store did not answer: %s", exc)

    def _beats(self, wait: float) -> list[bytes | None] | None:
        """The peers' beats, or ``None`` if the store did not answer within ``wait`` seconds (a read still
        pending from before is waited for, never doubled)."""
        if self._reader is None or not self._reader.is_alive():
            self._read = None
            self._reader = threading.Thread(target=self._read_beats, name="smpckpt-liveness-read", daemon=True)
            self._reader.start()
        self._reader.join(wait)
        return None if self._reader.is_alive() else self._read

    def run(self) -> None:
        period = _read_period(self.bound)
        started = answered = time.monotonic()
        seen: dict[int, tuple[bytes | None, float]] = {r: (None, started) for r in self.peers}
        while not self.done.wait(period):
            beats = self._beats(period)
            now = time.monotonic()
            if self.done.is_set():
                return
            if beats is None:
                if now - answered > self.bound:
                    self.fail(
                        f"the job's c10d store did not answer for {self.bound:g}s (its host, rank 0 under "
                        "init_method tcp:// or env://, is stopped or its node is gone)"
                    )
                    return
                continue
            answered = now
            for rank, beat in zip(self.peers, beats):
                if beat is not None and (beat != seen[rank][0] or beat == IDLE):
                    seen[rank] = (beat, now)
            silent = [r for r in self.peers if now - seen[r][1] > self.bound]
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
    Heartbeat.ensure(store, me, _period(bound), lane.busy)
    peers = [r for r in ranks if r != me]
    found = Watch(store, peers, bound, lambda why: abandon(lane, fut, tag, f"rank {me}: {why}"))
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
