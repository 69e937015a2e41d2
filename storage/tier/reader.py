"""Reading a fast-tier copy (``PeerFetchingReader``), and the parts it fetches from peers over a gloo group
(:func:`run_transfers`; a save's replicas: ``storage/tier/writer.py``; both received by :class:`Incoming`).

``PeerFetchingReader`` follows :class:`~smpckpt.storage.FsspecStorageReader`'s call order, plus what its
``prepare_global_plan`` and ``read_data`` say (README, "Tiered checkpoints": the parts a node lacks,
fetched whole, stay). Every rank's folder must already hold the manifest and metadata (the API writes them first).

Transfers: every rank walks the same list of :class:`Transfer` in order, sends on one thread and
receives on another, so the earliest unfinished transfer always has both ends waiting for it: no
deadlock. A transfer is a status word, the file in chunks and a closing status word, so a sender that
cannot read its file sends zeros and says so, and a receiver that cannot write still receives every
chunk. Received files appear under their final name only when complete (a create-only temp name, then
a link that replaces nothing); their bytes are checked against the manifest when read.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import io
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from smpckpt.errors import CheckpointError, NodeFull
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import open_fs
from smpckpt.storage.format.manifest import check_member_name
from smpckpt.storage.read.reader import FsspecStorageReader

__all__ = ["PeerFetchingReader", "Transfer", "TransferOutcome", "run_transfers", "fetch_transfers", "Incoming"]
__all__ += ["CHUNK_BYTES", "STREAMS", "NodeFull", "disk_full"]

#: said of a part a node could not store: no damaged copy (rev64b R3: a file-size limit too)
FULL = "this node's disk is full, over quota or past a file-size limit"


def disk_full(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class PeerFetchingReader(FsspecStorageReader):
    """A fast-tier copy at ``path`` (this node's folder), completed from peers while loading.

    Args (besides :class:`~smpckpt.storage.FsspecStorageReader`'s):
        group: a gloo group over the ranks ``dcp.load`` runs on; ``streams``: gloo groups over the same
            ranks that move the files (default: ``group``).
        ranks: the global rank of each rank of the group, in group order; ``rank``: this process's.
        local_world_size: ranks per node (``r // local_world_size`` is rank ``r``'s node).
        held_by: file name -> global ranks whose node folder holds it (the API's scan of every node)."""

    def __init__(
        self,
        path: str,
        *,
        group: Any,
        ranks: Sequence[int],
        rank: int,
        local_world_size: int,
        held_by: Mapping[str, Sequence[int]],
        streams: Sequence[Any] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        self._group, self._ranks, self._rank = group, list(ranks), rank
        self._streams = tuple(streams) or (group,)
        self._lws, self._held_by = local_world_size, held_by
        self._schedule: list[Transfer] = []
        #: every transfer of the load (all ranks'): file, from rank, to rank
        self.fetched: tuple[Transfer, ...] = ()

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(coordinator) The files each node lacks for its ranks' reads, and who sends them."""
        plans = super().prepare_global_plan(plans)
        needs: dict[int, set[str]] = {}
        for i, plan in enumerate(plans):
            names = needs.setdefault(self._ranks[i], set())
            for item in plan.items:
                name = getattr(self.storage_data.get(item.storage_index), "relative_path", None)
                if isinstance(name, str):
                    names.add(name)
        sizes = {name: rec.size for name, rec in self._records.items()}
        unknown = sorted({n for names in needs.values() for n in names} - set(sizes))
        if unknown:
            raise CheckpointError(f"{self.url}: the metadata names files the manifest does not list: {unknown[:5]}")
        self._schedule = fetch_transfers(needs, self._held_by, sizes, local_world_size=self._lws)
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(all ranks) Fetch what this node lacks (nothing may raise before the broadcast: every rank
        is in it), agree on the transfers' errors, then read as the partial reader does."""
        if self._group is not None and len(self._ranks) > 1:
            box: list[Any] = [self._schedule]
            dist.broadcast_object_list(box, src=self._ranks[0], group=self._group)
            schedule: list[Transfer] = box[0]
            outcome = run_transfers(
                schedule,
                rank=self._rank,
                group=self._streams,
                read_folder=self.path,
                write_folder=self.path,
                sync=False,
            )
            errors: list[Any] = [None] * len(self._ranks)
            dist.all_gather_object(errors, outcome.errors, group=self._group)
            failed = [f"rank {r}: {e}" for r, errs in zip(self._ranks, errors, strict=True) for e in errs]
            if failed:
                full = [e for e in failed if FULL in e]  # no damaged copy: the API raises it, never falls back
                said = "; ".join((full or failed)[:5])
                raise (NodeFull if full else CheckpointError)(
                    f"fetching fast-tier parts from peers failed ({len(failed)} file(s)): {said}"
                    + (
                        "; the copy is intact on its peers: free space on that node and resume again (or pass tag=)"
                        if full
                        else ""
                    )
                )
            self.fetched = tuple(schedule)
        return super().read_data(plan, planner)


# -- files moved between ranks (module docstring) ----------------------------------------------------------
#: bytes per send: large enough for full speed over gloo, small enough to bound the memory in flight
CHUNK_BYTES = 32 << 20
_OK, _FAILED = 1, 0
#: gloo groups the API opens for transfers: one TCP connection per pair of ranks each, so a link
#: carries several files at once (one connection fell well short of a loopback's or a NIC's speed)
STREAMS = 4


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One file, ``src`` (global rank) -> ``dst`` (global rank): relative ``name``, ``size`` bytes."""

    name: str
    size: int
    src: int
    dst: int


@dataclasses.dataclass
class TransferOutcome:
    """What this rank did: the files it received, and its errors (sending or receiving), by file."""

    received: list[Transfer] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)


def fetch_transfers(
    needs: Mapping[int, set[str]],
    held_by: Mapping[str, Sequence[int]],
    sizes: Mapping[str, int],
    *,
    local_world_size: int,
) -> list[Transfer]:
    """(coordinator) The files each node lacks for what its ranks will read: one copy per node, to the
    lowest rank of the node that reads it, from a rank holding it (the least loaded one so far)."""
    node_of = {rank: rank // local_world_size for rank in needs}
    on_node: dict[int, set[str]] = {}
    for name, ranks in held_by.items():
        for r in ranks:
            on_node.setdefault(r // local_world_size, set()).add(name)
    load: dict[int, int] = {}
    out: list[Transfer] = []
    wanted: dict[tuple[int, str], int] = {}  # (node, file) -> lowest rank of the node reading it
    for rank in sorted(needs):
        for name in needs[rank]:
            key = (node_of[rank], name)
            if name not in on_node.get(node_of[rank], set()) and key not in wanted:
                wanted[key] = rank
    for (_, name), dst in sorted(wanted.items(), key=lambda kv: (kv[0][1], kv[1])):
        holders = list(held_by.get(name, ()))
        if not holders:
            raise FileNotFoundError(f"{name}: no surviving fast tier holds this file")
        src = min(holders, key=lambda r: (load.get(r, 0), r))
        load[src] = load.get(src, 0) + sizes[name]
        out.append(Transfer(name, sizes[name], src, dst))
    return out


def run_transfers(
    transfers: Sequence[Transfer],
    *,
    rank: int,
    group: Any | Sequence[Any],
    read_folder: str,
    write_folder: str,
    sync: bool,
) -> TransferOutcome:
    """(every rank, the same ``transfers``) Send this rank's files from ``read_folder``, receive into
    ``write_folder``; transfer ``i`` goes over ``group[i % len]`` (or the one ``group``). Errors are
    collected, not raised: the caller agrees on them across ranks."""
    streams = list(group) if isinstance(group, (list, tuple)) else [group]
    outcome = TransferOutcome()
    jobs: list[tuple[Callable[..., list[str]], tuple[Any, ...]]] = []
    for i, g in enumerate(streams):
        mine = transfers[i :: len(streams)]  # the same sub-list on every rank: the order argument holds per group
        sends = [t for t in mine if t.src == rank and t.dst != rank]
        receives = [t for t in mine if t.dst == rank and t.src != rank]
        if sends:
            jobs.append((_send_all, (sends, read_folder, g)))
        if receives:
            jobs.append((_receive_all, (receives, write_folder, g, sync, outcome)))
    if not jobs:
        return outcome
    # Per group, sends on one thread and receives on another, each in list order: a rank sends and
    # receives at once (both directions of a link busy), and the earliest unfinished transfer of a
    # group still has its sender's and its receiver's thread waiting for it: the order argument holds.
    with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="smpckpt-transfer") as pool:
        running = [pool.submit(fn, *args) for fn, args in jobs]
        for job in running:
            outcome.errors.extend(job.result())
    return outcome


def _send_all(sends: list[Transfer], folder: str, group: Any) -> list[str]:
    return [e for e in (_send(t, folder, group) for t in sends) if e]


def _receive_all(receives: list[Transfer], folder: str, group: Any, sync: bool, outcome: TransferOutcome) -> list[str]:
    errors = [(t, _receive(t, folder, group, sync=sync)) for t in receives]
    outcome.received.extend([t for t, e in errors if not e])  # one extend of a list: the threads share it
    return [e for _, e in errors if e]


def _word(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def _chunks(size: int) -> list[int]:
    return [min(CHUNK_BYTES, size - done) for done in range(0, size, CHUNK_BYTES)]


def _buffers(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two chunk buffers: one on the wire while the other is read or written."""
    n = min(CHUNK_BYTES, max(size, 1))
    return torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)


def _failed(path: str, exc: Exception) -> str:
    """``path: why``, the path once: an OSError's text ends with its path again (fix63c); kept whole when it
    names another (a temp file, a link's source: rev64a F3)."""
    if isinstance(exc, OSError) and exc.filename == path and exc.filename2 is None:
        return f"{path}: [Errno {exc.errno}] {exc.strerror}"
    return f"{path}: {exc}"


def _send(t: Transfer, folder: str, group: Any) -> str:
    """Stream ``t`` to its receiver; an error (the receiver still gets every word and chunk) or ''."""
    path = os.path.join(folder, t.name)
    error = ""
    f: io.BufferedReader | None = None
    try:
        check_member_name(t.name, where=folder)
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the last chunk went out
        if os.fstat(f.fileno()).st_size != t.size:
            raise OSError(f"{os.fstat(f.fileno()).st_size} bytes, the manifest says {t.size}")
    except Exception as exc:  # noqa: BLE001 - reported; the receiver must not wait forever
        error = _failed(path, exc)
    dist.send(_word(_FAILED if error else _OK), dst=t.dst, group=group)
    if error:
        return error
    bufs = _buffers(t.size)
    in_flight: Any = None
    try:
        for i, n in enumerate(_chunks(t.size)):
            view = bufs[i % 2][:n]  # the send before the previous one used it: waited for below
            if not error:
                try:
                    got = f.readinto(view.numpy().data) if f is not None else 0
                    if got != n:
                        raise OSError(f"cut short while sending ({got} of {n} bytes read)")
                except Exception as exc:  # noqa: BLE001 - zeros go out instead, marked failed below
                    error = _failed(path, exc)
                    view.zero_()
            if in_flight is not None:
                in_flight.wait()
            in_flight = dist.isend(view, dst=t.dst, group=group)  # the next chunk is read meanwhile
        if in_flight is not None:
            in_flight.wait()
    finally:
        if f is not None:
            f.close()
    dist.send(_word(_FAILED if error else _OK), dst=t.dst, group=group)
    return error


class Incoming:
    """A file being received into ``place()``: a create-only temp name, linked into place (replacing
    nothing) only when complete; after a failure (:attr:`error`) its bytes are still taken, and dropped."""

    def __init__(self, place: Callable[[], Folder], folder: str, name: str, where: str) -> None:
        self.place, self.path, self.name = place, os.path.join(folder, name), name
        self.error, self.tmp, self.file = "", "", None
        try:
            check_member_name(name, where=where)
            fd, self.tmp = place().open_temp(name, tag="recv")
            self.file = open(fd, "wb", buffering=0)  # noqa: SIM115 - closed in :meth:`end`
        except Exception as exc:  # noqa: BLE001 - its bytes are still received (the sender must not block)
            self.error = self._said(exc)

    def _said(self, exc: Exception) -> str:
        return _failed(self.path, exc) + f" ({FULL})" * disk_full(exc)

    def write(self, data: memoryview) -> None:
        if self.file is not None and not self.error:
            try:
                while data:
                    data = data[self.file.write(data) :]
            except OSError as exc:
                self.error = self._said(exc)

    def end(self, why: str, *, sync: bool, link_sync: bool) -> str:
        """Closed; linked into place unless it failed (``why``: the sender's problem); its error, or ''."""
        self.error = self.error or why
        try:
            if self.file is not None:
                try:
                    if sync and not self.error:
                        os.fsync(self.file.fileno())
                finally:
                    self.file.close()
                if not self.error:
                    self.place().link_temp(self.tmp, self.name, sync=link_sync)
                    return ""
        except OSError as exc:
            self.error = self.error or self._said(exc)
        if self.file is not None:
            with contextlib.suppress(Exception):
                self.place().remove([self.tmp])
        return self.error


def _receive(t: Transfer, folder: str, group: Any, *, sync: bool) -> str:
    """Receive ``t`` into ``folder`` (:class:`Incoming`, no links); an error or ''."""
    status = _word(0)
    dist.recv(status, src=t.src, group=group)
    if int(status.item()) != _OK:
        return f"{t.name}: rank {t.src} could not send it"
    with contextlib.ExitStack() as cleanup:

        def place() -> Folder:
            if not opened:
                opened.append(cleanup.enter_context(Folder(open_fs(folder)[0], folder, create=True)))
            return opened[0]

        opened: list[Folder] = []
        incoming = Incoming(place, folder, t.name, folder)
        bufs = _buffers(t.size)
        sizes = _chunks(t.size)
        pending = dist.irecv(bufs[0][: sizes[0]], src=t.src, group=group) if sizes else None
        for i, n in enumerate(sizes):
            view = bufs[i % 2][:n]
            if pending is not None:
                pending.wait()
            # the next chunk arrives while this one is written
            pending = (
                dist.irecv(bufs[(i + 1) % 2][: sizes[i + 1]], src=t.src, group=group) if i + 1 < len(sizes) else None
            )
            incoming.write(view.numpy().data)
        dist.recv(status, src=t.src, group=group)
        failed = f"{t.name}: rank {t.src} failed while sending it" if int(status.item()) != _OK else ""
        return incoming.end(failed, sync=sync, link_sync=sync)
