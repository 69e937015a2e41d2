"""The drain (README, "Tiered checkpoints"): a tiered save copied from the fast tiers to ``path`` on the
Checkpointer's drain lane (every rank, a gloo group of its own), committed there as any partial
checkpoint (same files, same manifest bytes), then ``newest`` and retention (rank 0).

Each round assigns every file still to copy to one holder (:func:`copiers`: its writer while its node's
copy has not failed, else the least loaded rank of a node not yet tried); the copier checks each run of
blocks against the manifest's checksums before writing it (a mismatch aborts that file there), and one
gather of the round's outcome tells every rank which files failed where. A file no holder has intact
fails the drain, naming the file, the tag and every node tried. A failed drain removes its copies; the
fast tier keeps the save, and the next save drains it again
(:class:`~smpckpt.api._fast_save.PendingDrain`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from smpckpt.api._async import commit_point
from smpckpt.api._dist import DistContext
from smpckpt.api._save import SaveRequest, publish_newest, retain
from smpckpt.api._tiers import FastCandidate, LocalCopy, Nodes, TierState, candidates
from smpckpt.catalog.root import partial_url, sequence_of
from smpckpt.errors import CheckpointCorrupt, CheckpointError, CheckpointExists, CheckpointNotFound
from smpckpt.storage import probe_checkpoint, tools
from smpckpt.storage.backends._folder import Folder, flocked
from smpckpt.storage.backends._fs import folder_key, is_local, join, open_fs, read_bytes_or_none
from smpckpt.storage.backends._sinks import DEFAULT_PART_SIZE, open_sink
from smpckpt.storage.format.commit import settle_uncommitted_folder
from smpckpt.storage.format.manifest import MANIFEST_NAME, FileRecord, probe
from smpckpt.storage.tier import PreparedCommit, Workers
from smpckpt.storage.tools import check_blocks

if TYPE_CHECKING:
    from smpckpt.api._fast_save import PendingDrain, TierPlan
    from smpckpt.api._resume import Target
    from smpckpt.catalog.root import ManifestCache

__all__ = ["drain", "copiers", "holders_of", "JOB_DRAINED", "read_drained", "is_drained", "path_down", "note_drained"]
__all__ += ["pending_drains", "due_record", "same_history", "refuse_emptied", "by_ids", "note_seen"]

log = logging.getLogger("smpckpt.api")

_PART = DEFAULT_PART_SIZE  # bytes per S3 part of a durable copy (the writers' default part size)
# files copied at once: local and shared filesystems gain little beyond a few streams; object stores
# want many requests in flight (the fast tier sized these files to about one request each)
_FILES_AT_ONCE = MappingProxyType({True: 4, False: 16})
_PARTS_IN_FLIGHT = 2  # per file, on object stores
#: in a node's job folder: ``{"drained": [tag, ...], "ids": {tag: save id}}``, the newest tags its drains
#: committed to ``path`` (newest first) and each one's save: a resume finding none of those saves there refuses
#: the fast copies (an emptied path: tiers68 F2; a new run's save of a recorded tag name is another save: rev68b F1)
JOB_DRAINED = "smpckpt.drained.json"
_DRAINED_KEPT = 8  # more than path's retention ever removes at once from a job's newest drains


def read_drained(job: str) -> dict[str, str]:
    """The tags a job folder records as drained to ``path``, newest first, each with its save id (``""``: an
    older version's record, tags only; none: no record)."""
    try:
        with open(os.path.join(job, JOB_DRAINED), "rb") as f:
            found = json.loads(f.read(65536).decode("utf-8"))
        tags, ids = found.get("drained"), found.get("ids") or {}
        return {t: str(ids.get(t, "")) for t in tags if isinstance(t, str)} if isinstance(tags, list) else {}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def pending_drains(views: Sequence[Mapping[str, LocalCopy]], durable_seq: int) -> list[FastCandidate]:
    """Saves due for the durable tier newer than all it holds of this job (never drained), newest first."""
    return [c for c in candidates(views) if c.durable and c.seq > durable_seq]


_DUE_KEPT = 64  # a longer outage's older due saves are dropped: a resume refuses (names both), never loads wrong


def due_record(memory: TierState) -> tuple[tuple[int, str], ...]:
    """(rank 0, planning a save) Its ``extra["tier"]["due"]``: the job's saves due for ``path`` numbered above
    what it knows there (``path_seq``), newest first, each with its save id. A checkpoint of ``path`` at such a
    number is the job's only when it is that save (drained); another writer's there never saw the job's save,
    which a number alone (``path_seen``, counting due numbers as known until fix70f) did not tell (rev70d)."""
    kept = sorted(((n, i) for n, i in list(memory.due.items()) if n > memory.path_seq), reverse=True)[:_DUE_KEPT]
    memory.due = dict(kept)
    return tuple(kept)


def same_history(
    usable: list[FastCandidate], durable: Target, copies: set[tuple[int, int, str]], ties: Sequence[FastCandidate] = ()
) -> list[FastCandidate]:
    """(every rank alike) The fast-tier saves that may supersede ``path``'s newest checkpoint ``durable``:
    those whose job knew it (``path_seen``). A higher ``durable`` that is no drained copy of this tier's
    saves was saved by a job that never saw them: the histories diverged. The newest such save refuses the
    resume, naming both; an older one is only dropped from the fallbacks. Copies without ``path_seen``
    (older versions) keep the order alone. A number its job had only due there (``due``) is known when
    ``durable`` is that very save, drained (rev70d: another writer's save of that number loaded over).
    ``ties``: the complete saves due for ``path`` at ``durable``'s number, none usable: one that is not
    ``durable`` (another save id) and whose job never knew it is a diverged history too (another writer took
    the number it was to have in ``path``), refused alike when nothing newer is loaded (fix70g: an equal
    number went to the later save time, and ``path``'s loaded over the job's due save silently). A save not
    due is not one: ``path``'s later save of its number is newer, as a higher-numbered one is."""
    drained = durable.order in copies  # path's newest is this fast tier's own save, drained
    mine = (durable.order[0], durable.order[2])

    def knew(c: FastCandidate) -> bool:
        if drained or c.path_seen is None or c.order == durable.order or mine in (c.due or ()):
            return True
        return durable.order[0] <= c.path_seen

    first = usable[0] if usable else next((c for c in ties if not knew(c)), None)
    if first is not None and not knew(first):
        c = first
        raise CheckpointError(
            f"ambiguous resume: the fast tier's newest checkpoint {c.tag!r} (sequence number {c.order[0]}) and "
            f"path's newest, {durable.url} (tag {durable.tag!r}, sequence number {durable.order[0]}), belong to "
            f"diverged histories: {durable.tag!r} was saved by a writer that never saw {c.tag!r} (a job without this "
            f"fast tier resumed from an older checkpoint, or another writer of this root without the fast tier, "
            f"such as a second Checkpointer, numbering from path alone), and the job that saved {c.tag!r} knew nothing "
            f"in path numbered above {c.path_seen}. "
            + (
                f"Pass resume(tag={durable.tag!r}) to continue path's history, or resume(tag={c.tag!r}) to continue "
                "the fast tier's"
                if c.tag != durable.tag
                # a tag in both tiers loads its later save, path's here: the fast tier's copy is not chosen by tag
                else f"Both are tag {c.tag!r}: resume(tag={c.tag!r}) continues path's, the later save of the tag (the "
                f"fast tier's save of it, in the nodes' local_path {c.tag}_partial folders, is not chosen by tag)"
            )
        )
    return [c for c in usable if knew(c)]


def is_drained(drained: Mapping[str, str], tag: str, save_id: str) -> bool:
    """Save ``save_id`` of ``tag`` is the one ``drained`` (:func:`read_drained`) records (a record of tags
    only: the tag's name alone, as before)."""
    return tag in drained and drained[tag] in ("", save_id)


def note_drained(job: str, tag: str, save_id: str, *, unless_held: bool = False) -> None:
    """(a node's first rank, once ``tag`` is committed in ``path``: drained, or seen there by the job, rev68i F3)
    ``tag`` first in the record, replaced whole (a reader sees the old record or the new one); ``unless_held``:
    nothing when the record holds that save already. Read, changed and replaced under ``flock`` of the job folder,
    through a temp file of its own: the drain thread's and a save's (:func:`note_seen`) read the same record, and
    the later replace dropped the other's tag, or both wrote one temp file named by the pid (rev72e LOW-1). A
    failure is logged: the resume then knows less, as before."""
    tmp = None
    try:
        with _record_locked(job):
            held = read_drained(job)
            if unless_held and is_drained(held, tag, save_id):
                return
            ids = dict([(tag, save_id), *((t, i) for t, i in held.items() if t != tag)][:_DRAINED_KEPT])
            fd, tmp = tempfile.mkstemp(prefix=f".{JOB_DRAINED}.", dir=job)
            os.fchmod(fd, 0o644)  # as the record was written before (mkstemp's 0600)
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps({"drained": list(ids), "ids": ids}).encode())
            os.replace(tmp, os.path.join(job, JOB_DRAINED))
            tmp = None
    except OSError as exc:
        log.warning("could not record %r (drained or seen in path) in %s: %s", tag, job, exc)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def _record_locked(job: str) -> Iterator[None]:
    """``flock`` of the job folder, held by one open of it at a time (a thread's, or another process's on the
    node); nothing where the filesystem refuses it."""
    fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with flocked(fd):
            yield
    finally:
        os.close(fd)


def note_seen(job: str, seen: tuple[str, str] | None) -> None:
    """(each node's first rank: every node's record counts, node 0's may be gone, rev72b H1) ``path``'s newest
    committed checkpoint (tag, save id) the job saw (a save's draw read it, not read again: rev69e L4; or a resume
    loaded it), recorded in the job folder as held there (:func:`note_drained`) unless it is: the job saw it
    (another writer's of the root, its own plain ``overwrite=True`` save of a drained tag among them), so a
    resume finding only it in ``path`` is no emptied path (rev68i F3: refused as one, naming ``tag=``)."""
    if seen is not None:
        note_drained(job, *seen, unless_held=True)


def by_ids(records: Sequence[Mapping[str, str]]) -> list[Mapping[str, str]]:
    """``records`` (each node's :func:`read_drained`) less what matches by tag name alone where a save id is known:
    once a node records ids, a record without any (an older version's) is dropped, and a
    tags-only entry of a tag another record names with its id (rev72b M1: node 1's older record matched a new
    run's save of a drained tag name by name, and the old run's fast copy loaded over it silently)."""
    known = {t for r in records for t, i in r.items() if i}
    if not known:
        return list(records)
    return [{t: i for t, i in r.items() if i or t not in known} for r in records if any(r.values())]


def refuse_emptied(
    root: str,
    storage_options: Any,
    job: str,
    durable: tuple[str, str] | None,
    newest: str,
    records: Sequence[Mapping[str, str]],
) -> None:
    """(rank 0, a tiered resume) Refuse the fast tier's ``newest`` when ``path`` (``root``) holds none of the drains
    the nodes' job folders recorded (``records``: each node's :func:`read_drained`; ``job``: node 0's folder), each
    the save recorded, not a new run's of the tag's name (``durable``: path's newest, tag and save id; tiers68 F2,
    rev68b F1: an emptied path, a new run's, resumed the old run's copies silently). Every node's record counts:
    node 0 back with its old disk records only drains path's retention removed since (hunt72b: node 0's record
    alone refused a path holding the job's newest drain as emptied). A tags-only record or entry (an older
    version's) counts only where no record knows a save id (:func:`by_ids`)."""
    records = by_ids(records)
    if not any(records) or (durable is not None and any(is_drained(r, *durable) for r in records)):
        return
    tags = list(dict.fromkeys(t for r in records for t in r))
    for t in tags:
        found = probe_checkpoint(partial_url(root, t), storage_options)
        if (
            found.state == "committed"
            and found.manifest
            and any(is_drained(r, t, found.manifest.save_id) for r in records)
        ):
            return
    raise CheckpointNotFound(
        f"path {root} holds none of the saves this fast tier's job drained there (tags "
        f"{', '.join(map(repr, tags[:3]))}; emptied, or a new run on the same path?), while its fast-tier "
        f"folder ({job} on node 0, {os.path.basename(job)} in every node's local_path) holds {newest!r}: remove "
        f"that folder on every node to start fresh, or pass tag={newest!r} to resume the fast copy knowingly"
    )


def path_down(exc: BaseException) -> bool:
    """``path``'s storage failed to answer (connection refused, timeout, 5xx, as ``storage`` translates them):
    no answer about a checkpoint, unlike "not found", a file where a folder goes, or a checkpoint's own error."""
    wrong = (FileNotFoundError, NotADirectoryError, IsADirectoryError, CheckpointError)
    return isinstance(exc, OSError) and not isinstance(exc, wrong)


class _Budget:
    """This rank's drain memory: the bytes of the fast-tier files it read and has not let go (a read is taken
    before it is made and given back once written; on an object store, once the part holding it was
    sent). A file waits while taking would pass ``cap`` with ``room`` (the most one file can hold) kept
    for the oldest file still copying, which never waits: one file always proceeds, and no file stuck
    with a part half filled waits on the others for ever. ``peak``: the high-water mark."""

    def __init__(self, cap: int, room: int) -> None:
        self.cap, self.room, self.held, self.peak = cap, room, 0, 0
        self.files: dict[str, int] = {}  # file -> bytes it holds, in the order the files started
        self.cond = threading.Condition()

    def take(self, name: str, n: int) -> None:
        with self.cond:
            self.files.setdefault(name, 0)
            while (head := next(iter(self.files))) != name and (
                self.held + n + max(0, self.room - self.files[head]) > self.cap
            ):
                self.cond.wait()
            self.files[name] += n
            self.held += n
            self.peak = max(self.peak, self.held)

    def give(self, name: str, n: int) -> None:
        """(any thread: S3 parts are sent on s3fs's loop) ``n`` bytes of ``name`` let go."""
        with self.cond:
            n = min(n, self.files.get(name, 0))
            if name in self.files:
                self.files[name] -= n
                self.held -= n
                self.cond.notify_all()

    def end(self, name: str) -> None:
        """``name``'s copy ended (committed or aborted): what it held is let go."""
        with self.cond:
            self.held -= self.files.pop(name, 0)
            self.cond.notify_all()


def holders_of(
    files: Sequence[FileRecord], nodes: Nodes, replicas: int, held_by: Mapping[str, Sequence[int]] | None
) -> dict[str, tuple[int, ...]]:
    """Each data file's holders (global ranks): right after the save (``held_by`` ``None``) the writer's
    node and its replica nodes, which the save agreed hold it; a retried drain: ``held_by``."""
    out = {}
    for f in files:
        if held_by is not None:
            out[f.name] = tuple(held_by.get(f.name, ()))
        else:
            writer = nodes.node_of(f.rank)
            on = [n for n in range(nodes.count) if writer in nodes.replica_nodes(n, replicas)]
            out[f.name] = tuple(r for n in on for r in nodes.ranks_of(n))
    return out


def copiers(
    files: Sequence[FileRecord],
    holders: Mapping[str, Sequence[int]],
    local_world_size: int,
    failed: Mapping[str, Collection[int]] = MappingProxyType({}),
) -> dict[str, int]:
    """Which rank copies each of ``files`` this round: its writer while its node's copy has not failed
    (``failed``), else the least loaded rank of an untried node holding it (none left: not in the answer)."""
    load: dict[int, int] = {}
    out = {}
    for f in files:
        tried = failed.get(f.name, ())
        ranks = [r for r in holders.get(f.name, ()) if r // local_world_size not in tried]
        if not ranks:
            continue
        rank = f.rank if f.rank in ranks else min(ranks, key=lambda r: (load.get(r, 0), r))
        load[rank] = load.get(rank, 0) + f.size
        out[f.name] = rank
    return out


@dataclasses.dataclass
class _Copies:
    """One drain's copying on this rank, from this node's folder of the tag (``source``) to ``path`` on
    ``fs``; ``attempted``: every name it was given (removed if the drain fails)."""

    fs: Any
    path: str
    source: str
    sync: bool
    nodes: Nodes
    holders: Mapping[str, tuple[int, ...]]
    budget: _Budget
    workers: Workers  #: the Checkpointer's copy threads (``TierState.drain_workers``)
    attempted: list[str] = dataclasses.field(default_factory=list)

    def copy_one(self, rec: FileRecord, folder: Folder) -> str | None:
        """This node's copy of ``rec`` copied as it is checked (one read); else its problem, the partial
        durable file aborted so the next holder's copy can take the name. Errors writing ``path`` raise."""
        src, problems = os.path.join(self.source, rec.name), list[str]()
        # create-only, in the folder opened without following links (storage/backends/_folder.py); borrow:
        # check_blocks hands on fresh bytes of each read, sent to S3 as they are (a part buffer's copy of
        # each was 32 MiB more per file in flight, 16 files at once: mem59)
        name, budget = rec.name, self.budget
        sink = open_sink(
            self.fs,
            join(self.path, name),
            sync=self.sync,
            part_size=_PART,
            max_parts_in_flight=_PARTS_IN_FLIGHT,
            folder=folder,
            borrow=True,
            sent=functools.partial(budget.give, name),
        )
        failed_writing: list[BaseException] = []  # path's storage failed: the drain fails, no fallback

        def write(data: memoryview) -> None:
            try:
                sink.write(data)
            except BaseException as exc:
                failed_writing.append(exc)
                raise
            if not getattr(sink, "borrows", True):
                budget.give(name, len(data))  # written: the read's bytes are let go

        problem, take = None, functools.partial(budget.take, name)  # before each read
        try:
            try:
                fs = open_fs(self.source)[0]
                if not check_blocks(fs, src, rec, src, problems, lambda _: None, copy_to=write, reserve=take):
                    problem = "; ".join(problems[:2]) or f"{src}: damaged"
            except (OSError, CheckpointError) as exc:
                if failed_writing:
                    raise
                problem = f"{src}: {type(exc).__name__}: {exc}"
            if problem is None:
                sink.commit()
                return None
            sink.abort()  # never commit a damaged copy as the durable one: a peer's replica may be intact
            return problem
        except BaseException:
            sink.abort()
            raise
        finally:
            budget.end(name)

    def copy_round(self, mine: list[FileRecord]) -> dict[str, str]:
        """This rank's files of one round, several at once; file -> problem, for the copies that failed."""
        bad: dict[str, str] = {}
        pool = self.workers.pool(_FILES_AT_ONCE[is_local(self.fs)])
        with Folder(self.fs, self.path, create=True) as folder:
            tasks = [(rec, pool.submit(self.copy_one, rec, folder)) for rec in mine]
            try:
                for rec, done in tasks:
                    if (problem := done.result()) is not None:
                        bad[rec.name] = problem
            finally:  # none still writes into the folder once it is closed
                for _, done in tasks:  # path failed: the files not started never start (each would pay its
                    done.cancel()  # timeouts on a hung endpoint, 16 at a time: rev68i F5)
                concurrent.futures.wait([done for _, done in tasks])
            if self.sync:
                folder.fsync_dirs()
        return bad

    def copy_all(self, dctx: DistContext, tag: str, files: Sequence[FileRecord]) -> dict[str, dict[int, str]]:
        """(all ranks) Rounds until every file is copied from an intact copy, each round's outcome gathered;
        file -> node -> problem, for the copies that failed."""
        failed: dict[str, dict[int, str]] = {}
        todo = list(files)
        while todo:
            assigned = copiers(todo, self.holders, self.nodes.local_world_size, failed)
            if lost := [f.name for f in todo if f.name not in assigned]:
                raise _no_intact_copy(tag, lost, failed, self.holders, self.nodes)
            mine = [rec for rec in todo if assigned[rec.name] == self.nodes.rank]
            self.attempted.extend(rec.name for rec in mine)
            again: set[str] = set()
            for outcome in dctx.all_ok_values(functools.partial(self.copy_round, mine)):
                for name, problem in outcome.items():
                    failed.setdefault(name, {})[self.nodes.node_of(assigned[name])] = problem
                    again.add(name)
            todo = [rec for rec in todo if rec.name in again]
        return failed


def drain(
    req: SaveRequest,
    tier: TierPlan,
    prepared: PreparedCommit,
    retry: PendingDrain | None = None,
    manifests: ManifestCache | None = None,
) -> None:
    """(all ranks, the drain thread, on ``tier.drain_group``) Copy, commit, point ``newest``, apply
    ``path``'s retention (``manifests``: the Checkpointer's records of the root); ``retry``: a save drained
    again (its number and holders; default: ``tier``'s)."""
    started, group = time.monotonic(), tier.drain_group
    dctx = DistContext(group)
    manifest = prepared.parsed()
    fs, path = open_fs(req.url, req.storage_options)
    holders = holders_of(
        manifest.files, tier.nodes, tier.options.replicas, retry.held_by if retry is not None else None
    )
    # the most one file holds: a read, and on object stores a part filling and those in flight
    room = tools._READ_CHUNK + (0 if is_local(fs) else (_PARTS_IN_FLIGHT + 1) * _PART)
    budget = _Budget(tier.options.drain_memory, room)
    copies = _Copies(
        fs, path, tier.folder_of(req.tag), req.opts.sync_files, tier.nodes, holders, budget, tier.memory.drain_workers
    )

    def commit() -> None:
        commit_point()  # a drain given up on while a peer was silent commits nothing if that peer comes back
        _refuse_committed(fs, path, req.url, req.tag)
        # a link re-pointed meanwhile: not this save's folder (rev72o L6: another run's got it, newest too). Refused,
        # not written to the old folder: the run may have moved (its new folder the same run's); the fast tier keeps
        # the save and the next save drains it again where path then names (nothing lost either way)
        if tier.root_folder and (now := folder_key(req.root, req.storage_options)) != tier.root_folder:
            raise CheckpointError(
                f"{req.root} was re-pointed at {now} while {req.tag!r} drained (planned for {tier.root_folder}): "
                "not committed there; the fast tier keeps the save and the next save drains it again"
            )
        with Folder(fs, path) as folder:
            prepared.commit(folder, req.url, sync=copies.sync)

    try:
        if retry is not None:
            dctx.on_coordinator(lambda: _clear_leftovers(fs, path, req.url, req.tag, prepared))
        damaged = copies.copy_all(dctx, req.tag, manifest.files)
        dctx.on_coordinator(commit)
    except BaseException:
        try:
            committed = read_bytes_or_none(fs, join(path, MANIFEST_NAME)) == prepared.manifest
        except Exception:  # noqa: BLE001 - unknown: nothing is removed blind
            committed = True
        if not committed:
            _remove_copies(fs, path, req.url, copies.attempted)
        raise
    if damaged and dctx.is_coordinator:
        # logged, not warned: a warnings filter that raises would take rank 0 out of the collectives below
        # (publish_newest) after the commit, and the other ranks would wait there (rev59b F1)
        shown = "; ".join(f"{name} on node {n}: {why}" for name, on in sorted(damaged.items()) for n, why in on.items())
        log.warning(
            "the drain of %r copied %d file(s) from a peer's intact replica, the other copies being damaged or "
            "unreadable (%s); a resume of %r from the fast tier heals them",
            req.tag,
            len(damaged),
            shown[:600],
            req.tag,
        )
    tier.memory.durable = max(tier.memory.durable or 0, tier.seq if retry is None else retry.seq)
    tier.memory.saw_path(sequence_of(manifest.extra))  # in path now: the job's later saves record it (path_seen)
    if tier.nodes.is_leader:
        note_drained(tier.job, req.tag, manifest.save_id)
    breq = dataclasses.replace(req, process_group=group)
    publish_newest(breq, dctx, manifest.extra)  # its roll-back record: the root's copy (catalog.root)
    log.info(
        "drained checkpoint %r to %s in %.2fs (at most %.0f MiB of its files held at once; drain_memory %.0f MiB)",
        req.tag,
        req.url,
        time.monotonic() - started,
        budget.peak / 2**20,
        budget.cap / 2**20,
    )
    retain(breq, dctx, manifests)


def _no_intact_copy(
    tag: str,
    lost: list[str],
    failed: Mapping[str, Mapping[int, str]],
    holders: Mapping[str, Sequence[int]],
    nodes: Nodes,
) -> CheckpointCorrupt:
    """(every rank alike) The drain's refusal: no node holds an intact copy of ``lost[0]`` (and more)."""
    name = lost[0]
    on = sorted({nodes.node_of(r) for r in holders.get(name, ())})
    tried = "; ".join(
        f"node {n} (ranks {nodes.ranks_of(n)[0]}..{nodes.ranks_of(n)[-1]}): {why}"
        for n, why in sorted(failed.get(name, {}).items())
    )
    more = f" (and {len(lost) - 1} more file(s): {', '.join(lost[1:4])})" if len(lost) > 1 else ""
    held = f"held by node(s) {', '.join(map(str, on))}; tried {tried}" if on else "no node's fast tier holds it"
    return CheckpointCorrupt(
        f"the drain of {tag!r} copies nothing damaged: no fast tier holds an intact copy of {name}{more}: {held} "
        "(the fast tier keeps the save; the next save drains it again, a resume heals what a peer holds intact)"
    )


def _remove_copies(fs: Any, path: str, url: str, names: list[str]) -> None:
    """(each rank, a failed drain) Its copies, then the folder once empty (whoever removes the last file);
    ``rmdir`` follows no link."""
    with contextlib.suppress(FileNotFoundError), Folder(fs, path) as folder:  # failed before making it
        if failed := folder.remove(names):
            log.warning("the failed drain of %s left %d file(s): %s", url, len(failed), failed[:5])
        elif is_local(fs):
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _clear_leftovers(fs: Any, path: str, url: str, tag: str, prepared: PreparedCommit) -> None:
    """(rank 0, a retried drain) The files of this very save a killed drain left in the uncommitted
    folder: they would refuse the copies (files are created exclusively). Only those names, nothing else."""
    _refuse_committed(fs, path, url, tag)
    settle_uncommitted_folder(fs, path, url)
    names = [rec.name for rec in prepared.parsed().files] + [prepared.metadata_name]
    try:
        folder = Folder(fs, path)  # removes by exact name, never following a link
    except FileNotFoundError:
        return  # the killed drain never created the folder: nothing to clear
    with folder:
        failed = folder.remove(names)
    if failed:
        raise CheckpointError(f"{url}: could not remove what an earlier drain of {tag!r} left: {failed[:5]}")


def _refuse_committed(fs: Any, path: str, url: str, tag: str) -> None:
    if probe(fs, path, list_when_empty=False).state in ("committed", "legacy"):
        raise CheckpointExists(f"{url} already holds a committed checkpoint; the drain of {tag!r} stops")
