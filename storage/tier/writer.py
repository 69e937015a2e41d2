"""A fast-tier copy written into this node's folder (``FastTierWriter``: the coordinator's ``finish`` only
keeps the manifest and metadata bytes), committed per node only after every node holds its share
(:func:`commit_node_copy`); and its replicas, sent to other nodes while each file is written
(:class:`Replicator`). README, "Tiered checkpoints", describes the protocol.

Replicas: each data file goes, chunk by chunk as its sink receives it, to the same local rank of the
next ``replicas - 1`` nodes (ring order), over one sender and one receiver thread per (group, hop); a
file uses group ``file number % len(groups)``. Messages: an int64 header ``[kind, file, n, extra]``,
then the name (``OPEN``) or ``n`` bytes (``DATA``); ``END`` closes a file (``extra`` 1: committed, 0:
discard), ``EOS`` the channel.

Why it cannot hang: a receiver stops only at ``EOS`` or when its connection fails, and receives a file
it cannot write to the end (reporting the error); every rank sends ``EOS`` in :meth:`Replicator.close`;
a failed sender drops the rest and wakes writers waiting on it, which raise naming the peer.

Threads: senders and receivers are tasks on :class:`Workers`, threads their owner (a Checkpointer's fast
tier) keeps for all its saves; a data write past :data:`CHUNK` goes out in messages of at most ``CHUNK``
bytes, so a pool thread that ran a receiver holds one ``CHUNK`` buffer (senders share the pool: up to one
per thread), kept for every save (README, "Tiered checkpoints", Memory).

Memory: the queue holds views of the writer's buffers (a sink's ``commit`` returns only once its last
message went out, so ``borrow=True`` holds), at most ``max_queued`` bytes of data (:class:`_Budget`, by
default ``staging_bytes``: a second cap beside the staging pool's); a write past it waits for the
senders, so a slow peer slows this rank's writers instead of growing its memory. Each receiver holds one
message at a time. Received files appear under their final name only when complete (a create-only temp
name linked into place, ``storage/backends/_folder.py``); sizes are checked before the node commits.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import open_fs, resolve
from smpckpt.storage.backends._sinks import Sink, byte_view
from smpckpt.storage.format._staging import STAGING_BYTES
from smpckpt.storage.format.commit import commit
from smpckpt.storage.format.manifest import MANIFEST_NAME, FileRecord, Manifest, new_save_id
from smpckpt.storage.tier.reader import Incoming, Transfer, TransferOutcome
from smpckpt.storage.write.writer import FsspecStorageWriter, RankPlanData, Workers

__all__ = ["FastTierWriter", "PreparedCommit", "commit_node_copy", "parts_of"]
__all__ += ["Replicator", "TeeSink", "Workers", "CHUNK"]


@dataclasses.dataclass(frozen=True)
class PreparedCommit:
    """What the coordinator's ``finish`` built and every node commits: the manifest and metadata bytes."""

    manifest: bytes
    metadata_name: str
    metadata: bytes

    def parsed(self) -> Manifest:
        return Manifest.from_bytes(self.manifest)

    def commit(self, folder: Folder, url: str, *, sync: bool, **kwargs: Any) -> None:
        """Commit it in ``folder`` (the one commit protocol: ``storage/format/commit.py``), metadata too."""
        commit(
            folder,
            url,
            self.parsed(),
            self.manifest,
            sync=sync,
            metadata=self.metadata,
            stock_metadata=self.metadata,
            **kwargs,
        )


class FastTierWriter(FsspecStorageWriter):
    """:class:`FsspecStorageWriter` into this node's fast-tier folder ``path`` (a local path): the
    coordinator's ``prepare_global_plan`` does not probe the folder (the API checked every node's) and its
    ``finish`` only builds :attr:`prepared`; a ``replicator`` sends each data file to the replica ranks
    while it is written. ``prefix_strategy`` is the durable root's and, with ``durable_is_local=False``,
    files are sized as for an object store: a drain uploads them as a direct save would have written them."""

    def __init__(self, path: str, *, durable_is_local: bool = True, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        # the files a drain uploads as they are: for an object store, one-request objects
        self._split_as_local = durable_is_local
        self.prepared: PreparedCommit | None = None
        #: sends every data file to the replica ranks while it is written (``None``: no replicas)
        self.replicator: Replicator | None = None

    def _open_sink(self, name: str) -> Sink:
        """The local file's sink; with a :attr:`replicator`, also sent to the replica ranks."""
        sink = super()._open_sink(name)
        return self.replicator.sink(sink, name) if self.replicator is not None else sink

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) A fresh save id for every rank; the folders were settled by the API."""
        self._save_id = new_save_id()
        prefixes = resolve(self.prefix_strategy, local=True)
        return [
            dataclasses.replace(p, storage_data=RankPlanData(self._save_id, i, len(plans), prefixes, False))
            for i, p in enumerate(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Build the manifest and metadata bytes; write nothing (see the module docstring)."""
        save_id, files = self._committed_files(metadata, results)
        files = sorted(files, key=lambda f: (f.rank, f.name))
        manifest, md_bytes = self._manifest(save_id, metadata, files, len(results), self.format)
        self._used_save_ids.add(save_id)
        self.prepared = PreparedCommit(manifest.to_bytes(), manifest.metadata.name, md_bytes)

    def _write_metadata(self, gen_name: str, md_bytes: bytes) -> None:
        pass  # every node writes it at its own commit, from :attr:`prepared`


def parts_of(manifest: Manifest, ranks: Iterable[int]) -> list[FileRecord]:
    """The data files ``ranks`` wrote."""
    wanted = set(ranks)
    return [f for f in manifest.files if f.rank in wanted]


def commit_node_copy(folder: str, prepared: PreparedCommit, expected: list[FileRecord], *, sync: bool) -> bool:
    """(one rank per node) Check that the ``expected`` files are there at their sizes, then commit this
    node's copy (metadata, manifest create-if-absent, stock ``.metadata``). ``False``: this generation
    was committed here already; :class:`CheckpointExists`: another one was."""
    fs, path = open_fs(folder)
    with Folder(fs, path) as f:
        existing = f.read(MANIFEST_NAME)
        if existing is not None:
            if existing == prepared.manifest:
                return False
            raise CheckpointExists(f"{folder}: holds another committed checkpoint of this tag")
        prepared.commit(f, folder, sync=sync, expected=expected, refused="another save committed here at the same time")
    return True


# -- replicas sent while they are written (module docstring) -----------------------------------------------
EOS, OPEN, DATA, END = 0, 1, 2, 3
#: writes below this many bytes are gathered into one message (a message costs a round trip)
_SMALL = 256 << 10
_COALESCE = 1 << 20
#: the largest data message: a receiving thread's buffer, allocated once (module docstring, "Threads")
CHUNK = 4 << 20
#: seconds a writer waiting for the senders' queue sleeps before it looks again (it is woken sooner)
_WAIT_S = 1.0


def _as_tensor(data: memoryview | bytes) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only buffer: gloo only reads it
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


@dataclasses.dataclass
class _File:
    """One file this rank writes: its number, name, channel, and when its last message went out."""

    number: int
    name: str
    group: int
    size: int = 0
    sent: threading.Event = dataclasses.field(default_factory=threading.Event)
    pending: int = 0  #: destinations still to send its END to


class _Budget:
    """The bytes a rank's senders hold queued (module docstring, "Memory"): a data message counts once,
    from :meth:`take` until every sender of its channel sent or dropped it (:meth:`give`). Thread-safe."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.queued = 0
        self.waiting = 0  #: writers waiting in :meth:`take` now
        self.broken = ""  #: the first failed sender's error
        self._cond = threading.Condition()

    def take(self, n: int) -> None:
        """(a writer) Wait until ``n`` more bytes fit (or nothing is queued), then count them; raises
        :class:`CheckpointError` when it had to wait and a sender of this rank failed."""
        with self._cond:
            waited = False
            while self.queued and self.queued + n > self.cap:
                if self.broken:
                    break
                waited = True
                self.waiting += 1
                try:
                    self._cond.wait(_WAIT_S)  # woken by give() or fail(); the timeout only looks again
                finally:
                    self.waiting -= 1
            if self.broken and (waited or (self.queued and self.queued + n > self.cap)):
                raise CheckpointError(f"{self.broken} (this rank's write waited for it to take its replicas)")
            self.queued += n

    def give(self, held: list[int]) -> None:
        """(a sender) One of the ``held[0]`` senders of a message of ``held[1]`` bytes is done with it."""
        with self._cond:
            held[0] -= 1
            if held[0] == 0:
                self.queued -= held[1]
                self._cond.notify_all()

    def fail(self, why: str) -> None:
        """(a sender) Its connection failed: waiting writers wake and raise."""
        with self._cond:
            self.broken = self.broken or why
            self._cond.notify_all()


class _Sender:
    """One channel's sending side: messages in order to ``dst`` over ``group`` (a task on :class:`Workers`)."""

    def __init__(self, dst: int, group: Any, errors: list[str], budget: _Budget) -> None:
        self.dst, self.group, self.errors, self.budget = dst, group, errors, budget
        self.queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.broken = ""

    def run(self) -> None:
        while True:
            kind, file, payload, n, extra, done = self.queue.get()
            if not self.broken:
                try:
                    self._send(kind, file, payload, n, extra)
                except Exception as exc:  # noqa: BLE001 - the connection failed: reported, the rest dropped
                    self.broken = f"sending replicas to rank {self.dst} failed: {exc}"
                    self.errors.append(self.broken)
                    self.budget.fail(self.broken)
            payload = None  # the budget counts it sent: let go of it now, not at the next message
            if done is not None:
                done()
            if kind == EOS:
                return

    def _send(self, kind: int, file: int, payload: Any, n: int, extra: int) -> None:
        works = [dist.isend(torch.tensor([kind, file, n, extra], dtype=torch.int64), dst=self.dst, group=self.group)]
        if payload is not None:
            works.append(dist.isend(_as_tensor(payload), dst=self.dst, group=self.group))
        for work in works:
            if work is not None:  # None only for ranks outside the group, which never send here
                work.wait()


class _Place:
    """The node's folder, opened once (by the first receiver) without following links."""

    def __init__(self, folder: str) -> None:
        self.path = folder
        self._lock = threading.Lock()
        self._folder: Folder | None = None

    def get(self) -> Folder:
        with self._lock:
            if self._folder is None:
                self._folder = Folder(open_fs(self.path)[0], self.path, create=True)
            return self._folder

    def close(self, *, sync: bool) -> None:
        with self._lock:
            folder, self._folder = self._folder, None
        if folder is not None:
            try:
                if sync:
                    folder.fsync_dirs()  # once for every file received: new names survive a power loss
            finally:
                folder.close()


class _Receiver:
    """One channel's receiving side: the files from ``src`` over ``group`` into ``place``."""

    def __init__(self, src: int, group: Any, place: _Place, sync: bool, outcome: TransferOutcome) -> None:
        self.src, self.group, self.place, self.sync, self.outcome = src, group, place, sync, outcome
        self.open: dict[int, Incoming] = {}

    def _opened(self, file: int, name: str) -> None:
        where = f"the replica stream from rank {self.src}"
        self.open[file] = Incoming(self.place.get, self.place.path, name, where)

    def run(self, buffer: Callable[[int], torch.Tensor]) -> None:
        """(a task of :class:`Workers`) Receive until ``EOS``, each message into this thread's ``buffer``."""
        header, buf = torch.empty(4, dtype=torch.int64), buffer(CHUNK)
        try:
            while True:
                dist.recv(header, src=self.src, group=self.group)
                kind, file, n, extra = (int(x) for x in header.tolist())
                if kind == EOS:
                    return
                if kind in (OPEN, DATA):
                    # a message fills what it needs of the buffer (a failed save's leftovers are overwritten)
                    view = buf[:n] if n <= buf.numel() else torch.empty(n, dtype=torch.uint8)
                    if n:
                        dist.recv(view, src=self.src, group=self.group)
                    data = view.numpy().data
                    if kind == OPEN:
                        self._opened(file, bytes(data).decode("utf-8", "replace"))
                    else:
                        self.open[file].write(data)
                elif kind == END:
                    incoming = self.open.pop(file)
                    # linked into place only if nothing is there: a file under that name is not ours to replace;
                    # the folders are fsynced at close; a file the writer failed on is its own error, reported there
                    if not (error := incoming.end("" if extra == 1 else "discarded", sync=self.sync, link_sync=False)):
                        self.outcome.received.append(Transfer(incoming.name, n, self.src, -1))
                    elif extra == 1:
                        self.outcome.errors.append(error)
        except Exception as exc:  # noqa: BLE001 - the sender's process is gone: every later receive fails too
            self.outcome.errors.append(f"receiving replicas from rank {self.src} failed: {exc}")
        finally:
            for incoming in self.open.values():
                with contextlib.suppress(Exception):
                    incoming.end("never finished", sync=False, link_sync=False)
                self.outcome.errors.append(f"{incoming.name}: rank {self.src} never finished sending it")


class Replicator:
    """(every rank of a tiered save) The replica channels of this rank (module docstring): start before
    the save writes, :meth:`sink` for each data file, :meth:`close` after it, however it ended."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_world_size: int,
        replicas: int,
        groups: Sequence[Any],
        folder: str,
        sync: bool,
        max_queued: int = STAGING_BYTES,
        workers: Workers | None = None,
    ) -> None:
        # sent to its local rank on the next replicas - 1 nodes, received from the previous ones
        sends = [(rank + hop * local_world_size) % world_size for hop in range(1, replicas)]
        receives = [(rank - hop * local_world_size) % world_size for hop in range(1, replicas)]
        self.outcome = TransferOutcome()
        self._lock = threading.Lock()
        self._count = 0
        self._place, self._sync = _Place(folder), sync
        self._budget = _Budget(max_queued)
        self._senders = [[_Sender(dst, g, self.outcome.errors, self._budget) for dst in sends] for g in groups]
        self._receivers = [_Receiver(src, g, self._place, sync, self.outcome) for g in groups for src in receives]
        self._closed = False
        #: the owner's threads (module docstring, "Threads"); without one, its own, ended at :meth:`close`
        self._workers, self._own = workers or Workers("smpckpt-replica"), workers is None
        self._tasks: list[concurrent.futures.Future[None]] = []

    @property
    def waiting(self) -> int:
        """Writers waiting now for the senders to send what they queued (tests watch it)."""
        return self._budget.waiting

    def start(self) -> None:
        pool = self._workers.pool(len(self._receivers) + sum(map(len, self._senders)))
        self._tasks = [pool.submit(r.run, self._workers.buffer) for r in self._receivers]
        self._tasks += [pool.submit(s.run) for channel in self._senders for s in channel]

    def sink(self, inner: Sink, name: str) -> TeeSink:
        """``inner`` (the local file's sink), its bytes also sent to the replica ranks."""
        with self._lock:
            number, self._count = self._count, self._count + 1
        f = _File(number, name, number % len(self._senders))
        self._put(f, OPEN, name.encode("utf-8"))
        return TeeSink(inner, self, f)

    def _put(self, f: _File, kind: int, payload: Any = None, n: int = 0, extra: int = 0) -> None:
        senders = self._senders[f.group]
        if kind == END:
            f.pending = len(senders)
            lock = threading.Lock()

            def done() -> None:
                with lock:
                    f.pending -= 1
                    if f.pending == 0:
                        f.sent.set()

            if not senders:
                f.sent.set()
            for s in senders:
                s.queue.put((END, f.number, None, n, extra, done))
            return
        size = len(payload) if payload is not None else 0
        release = None
        if kind == DATA and senders:
            self._budget.take(size)  # may wait for the senders (module docstring, "Memory")
            held = [len(senders), size]
            release = lambda: self._budget.give(held)  # noqa: E731 - one per message, run by each sender
        for s in senders:
            s.queue.put((kind, f.number, payload, size, extra, release))

    def close(self) -> TransferOutcome:
        """(however the save ended) ``EOS`` on every channel, then wait for every thread; the outcome."""
        if not self._closed:
            self._closed = True
            for channel in self._senders:
                for s in channel:
                    s.queue.put((EOS, 0, None, 0, 0, None))
            concurrent.futures.wait(self._tasks)  # each reports its own failure in the outcome
            if self._own:
                self._workers.close()
            try:
                self._place.close(sync=self._sync and bool(self.outcome.received))
            except OSError as exc:
                self.outcome.errors.append(f"{self._place.path}: {exc}")
        return self.outcome


class TeeSink:
    """A data file's sink that also sends its bytes to the replica ranks (:class:`Replicator`)."""

    borrows = True  # what it sends is read by the sender threads until the file's end is sent

    def __init__(self, inner: Sink, replicator: Replicator, file: _File) -> None:
        self.inner, self.path = inner, inner.path
        self._rep, self._file = replicator, file
        self._small = bytearray()
        self._ended = False

    def write(self, data: memoryview) -> None:
        flat = byte_view(data)
        n = flat.nbytes
        if n < _SMALL:
            self._small += flat
            if len(self._small) >= _COALESCE:
                self._flush()
        else:
            self._flush()
            for at in range(0, n, CHUNK):  # sent while the local write below runs
                self._rep._put(self._file, DATA, flat[at : at + CHUNK])
        self.inner.write(data)
        self._file.size += n

    def _flush(self) -> None:
        if self._small:
            self._rep._put(self._file, DATA, bytes(self._small))
            self._small = bytearray()

    def commit(self) -> None:
        self._flush()  # before the local commit: a write refused here (a failed peer) fails the file whole
        self.inner.commit()
        self._ended = True
        self._rep._put(self._file, END, n=self._file.size, extra=1)
        self._file.sent.wait()  # the caller may reuse its buffers once this returns

    def abort(self) -> None:
        try:
            self.inner.abort()
        finally:
            if not self._ended:  # the receivers discard what they got of it
                self._ended = True
                self._small = bytearray()
                self._rep._put(self._file, END, n=self._file.size, extra=0)
                self._file.sent.wait()
