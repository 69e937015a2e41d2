"""What the fast tier's save and resume share (README, "Tiered checkpoints"; no collectives but in
:func:`gather_views`): nodes from ``LOCAL_WORLD_SIZE``, this job's folder in every node's fast tier
(``{local_path}/smpckpt-job-<hash of the root>/``, :func:`job_folder`; a copy is this job's only when both
the folder and its manifest's ``extra["tier"]`` say so), what one node's folder holds (its copies, judged
once by the node's first rank, :func:`scan_job`, so every rank decides alike), what the nodes hold
together (:func:`candidates`: a tag is *complete* when the folders' files cover its parts) and the save
numbers ``durable_every`` divides. :func:`gather_views` first checks (three collectives) that
``local_path`` is a writable folder apart from ``path`` and that no two nodes share one (tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch.distributed as dist

from smpckpt.api._dist import DistContext
from smpckpt.catalog.root import (
    JOB_KEY,
    abandoned_of,
    list_partial_tags,
    open_root,
    partial_dirname,
    record_order,
    scan_root,
)
from smpckpt.errors import CheckpointError, UnsafeCheckpoint
from smpckpt.storage import Manifest
from smpckpt.storage.backends._folder import create_bytes_exclusive
from smpckpt.storage.backends._fs import file_sizes, is_local, join, location_key, open_fs, read_bytes_or_none
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format.manifest import MANIFEST_NAME
from smpckpt.storage.tier import PreparedCommit, Workers

__all__ = ["TIER_KEY", "JOB_PREFIX", "JOB_RECORD", "TierState", "Nodes", "node_layout", "durable_key"]
__all__ += ["job_dirname", "job_folder", "read_job_record", "gather_views"]
__all__ += ["CopyState", "LocalCopy", "FastCandidate", "scan_job", "read_copy", "seq_of", "part_sizes"]
__all__ += ["SKIPPED", "PATH_MARK", "LINEAGE"]
__all__ += ["candidates", "tier_seq", "fetch_copy"]

log = logging.getLogger("smpckpt.api")


# -- the nodes, this job's folder in each node's fast tier, what the tier remembers ------------------------
#: a job's folder in a node's fast tier: this prefix, then 16 hex digits of a hash of its durable root
JOB_PREFIX = "smpckpt-job-"
#: in a job folder: ``{"root": <durable root>}`` (for people and ``smpckpt ls --local``)
JOB_RECORD = "smpckpt.job.json"
#: the token a node's first rank leaves in its folder while the nodes compare folders
_TOKEN_PREFIX = ".smpckpt-node-"
_STALE_TOKEN_S = 3600.0


@dataclasses.dataclass
class TierState:
    """What one Checkpointer's fast tier remembers between its saves (one durable root, one job folder)."""

    #: orders the save thread's and the drain thread's fast-tier retention, and guards ``held``
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: the tags its drains are copying from the job folder (retention keeps them)
    held: set[str] = dataclasses.field(default_factory=set)
    #: the highest save number committed under ``path`` (read once, then kept current by the drains)
    durable: int | None = None
    #: (folder, problem) named already: a crafted folder is named once, not at every save
    warned: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    #: the highest root sequence number this job knows in ``path`` (read there, or drained): each tiered save
    #: records it (``path_seen``): a resume tells a checkpoint of ``path`` saved without it; and its saves due
    #: there, not known drained: root sequence number -> save id (``due``: ``_drain.due_record``)
    path_seq: int = 0
    due: dict[int, str] = dataclasses.field(default_factory=dict)
    continues: int | None = None  #: the save this job goes on from: its digest, PATH_MARK, None (unknown)
    #: (rank 0) the segments of the history it goes on from (``None``: unknown, the newest it sees) and the
    #: saves that history passed over (:data:`RUNS`); ``fresh``: its next save starts a segment (a resume)
    runs: tuple[tuple[int, int], ...] | None = None
    passed: tuple[tuple[int, int], ...] = ()
    fresh: bool = True
    back_to: tuple[str, int] = ("", 0)  #: the tag and root number it resumed (a roll-back's, in warnings)
    #: the threads of every save's replica channels and of every drain's copies, ended by :meth:`close`
    #: (threads new at each save grew the process's memory: README, "Tiered checkpoints"; the file writes'
    #: are the Checkpointer's, ``PlannerCache.workers``)
    replica_workers: Workers = dataclasses.field(default_factory=lambda: Workers("smpckpt-replica"))
    drain_workers: Workers = dataclasses.field(default_factory=lambda: Workers("smpckpt-drain-copy"))

    def close(self) -> None:
        """(the Checkpointer's close, its saves and drains done) End the threads."""
        for workers in (self.replica_workers, self.drain_workers):
            workers.close()

    def durable_seq(self, root: str, storage_options: Any) -> int:
        """(rank 0) The highest save number committed under ``root`` (one scan, the first time)."""
        if self.durable is None:
            records = scan_root(root, storage_options=storage_options)
            self.durable = max((seq_of(r.manifest) for r in records if r.committed), default=0)
            self.saw_path(max((r.order[0] for r in records if r.committed), default=0))
        return self.durable

    def adopt(self, other: TierState) -> None:
        """What ``other`` (the fast tier of the Checkpointer this one's replaces) knew of the job's history."""
        self.continues, self.runs, self.passed = other.continues, other.runs, other.passed
        self.fresh, self.back_to = other.fresh, other.back_to
        # what it knew in path: a resume's Checkpointer (its FastTier without the save's options) hands the job
        # to the save's, and a save made while path is down records it (path_seen); 0 there refused the restart
        # as "diverged histories" (rev68i F4)
        self.saw_path(other.path_seq)
        self.due.update(other.due)

    def saw_path(self, seq: int) -> None:
        """A checkpoint with root sequence number ``seq`` is in ``path`` (not only due there: ``due``)."""
        self.path_seq = max(self.path_seq, seq)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """This job's nodes: global rank ``r`` is on node ``r // local_world_size``."""

    local_world_size: int
    world_size: int
    rank: int

    @property
    def count(self) -> int:
        return self.world_size // self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def ranks_of(self, node: int) -> range:
        return range(node * self.local_world_size, (node + 1) * self.local_world_size)

    @property
    def is_leader(self) -> bool:
        """This rank commits, heals and prunes its node's folder."""
        return self.rank % self.local_world_size == 0

    def replica_nodes(self, node: int, replicas: int) -> list[int]:
        """The nodes whose ranks' files ``node`` holds: itself and the ``replicas - 1`` before it (ring)."""
        return [(node - hop) % self.count for hop in range(replicas)]


def node_layout(ctx: DistContext, process_group: Any, replicas: int = 1) -> Nodes:
    """(all ranks) The nodes from torchrun's ``LOCAL_WORLD_SIZE``; refuses what cannot be tiered."""
    if not ctx.active or ctx.world_size == 1:
        lws = 1
    else:
        if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
            raise ValueError(
                "local_path needs a process group of every rank (tiered checkpoints place replicas by node); "
                "pass process_group=None"
            )
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        if raw is None or not raw.isdigit() or int(raw) < 1:
            raise ValueError(
                f"local_path needs LOCAL_WORLD_SIZE (ranks per node; torchrun sets it), got {raw!r}: ranks "
                "r with equal r // LOCAL_WORLD_SIZE share a node and its fast tier"
            )
        lws = int(raw)
        if ctx.world_size % lws:
            raise ValueError(f"world size {ctx.world_size} is not a multiple of LOCAL_WORLD_SIZE={lws}")
    nodes = Nodes(lws, ctx.world_size, dist.get_rank() if ctx.active else 0)
    if replicas > nodes.count:
        raise ValueError(
            f"replicas={replicas} needs {replicas} nodes, this job has {nodes.count} (world size {ctx.world_size}, "
            f"LOCAL_WORLD_SIZE={lws}): pass replicas={nodes.count} or fewer"
        )
    return nodes


# -- whose copies ------------------------------------------------------------------------------------------
def durable_key(root: str, storage_options: Any) -> str:
    """The durable root as a copy records it: scheme and path, lexical (every rank alike, no I/O)."""
    return location_key(root, storage_options)


def job_dirname(key: str) -> str:
    return JOB_PREFIX + hashlib.blake2b(key.encode("utf-8"), digest_size=8).hexdigest()


def job_folder(local_path: str, key: str) -> str:
    return os.path.join(local_path, job_dirname(key))


def read_job_record(folder: str) -> str | None:
    """The durable root a job folder's record names (``None``: none or unreadable)."""
    try:
        with open(os.path.join(folder, JOB_RECORD), "rb") as f:
            root = json.loads(f.read(65536).decode("utf-8")).get("root")
    except (OSError, ValueError, AttributeError):
        return None
    return root if isinstance(root, str) else None


# -- the nodes' folders ------------------------------------------------------------------------------------
def _check_apart(local: str, root: str, storage_options: Any) -> None:
    """``local_path`` must not be ``path``, inside it or contain it (a drain would copy a folder onto itself)."""
    fs, path = open_fs(root, storage_options)
    if not is_local(fs):
        return
    lp, rp = os.path.realpath(local), os.path.realpath(path)
    common = os.path.commonpath([lp, rp])
    how = "is the same folder as" if lp == rp else "is inside" if common == rp else "contains" if common == lp else ""
    if how:
        raise ValueError(
            f"local_path {local!r} {how} path {root!r}: the fast tier must be a folder of its own (node-local "
            "NVMe or /dev/shm), apart from the durable checkpoints"
        )


def _token(local: str) -> str:
    """(a node's first rank, several nodes) This node's token written into ``local_path``: its name."""
    name = f"{_TOKEN_PREFIX}{os.urandom(8).hex()}"
    try:
        os.makedirs(local, exist_ok=True)
        create_bytes_exclusive(open_fs(local)[0], os.path.join(local, name), b"", sync=False)
    except OSError as exc:
        raise ValueError(f"local_path {local!r} is not writable: {exc}") from exc
    with contextlib.suppress(OSError):  # tokens of jobs killed while comparing folders: not left to pile up
        for stale in [n for n in os.listdir(local) if n.startswith(_TOKEN_PREFIX)]:
            if time.time() - os.lstat(os.path.join(local, stale)).st_mtime > _STALE_TOKEN_S:
                os.unlink(os.path.join(local, stale))
    return name


def _job_folder_ready(local: str, job: str, key: str) -> None:
    """(a node's first rank) This job's folder in ``local_path``, with (once) its record."""
    try:
        os.makedirs(job, exist_ok=True)
        if not os.path.exists(os.path.join(job, JOB_RECORD)):
            with contextlib.suppress(FileExistsError):
                record = json.dumps({"root": key}).encode()
                create_bytes_exclusive(open_fs(job)[0], os.path.join(job, JOB_RECORD), record, sync=False)
    except OSError as exc:
        raise ValueError(
            f"local_path {local!r} is not writable: cannot create this job's folder in it ({exc})"
        ) from exc


def gather_views(
    ctx: DistContext,
    process_group: Any,
    replicas: int,
    local: str,
    root: str,
    storage_options: Any,
    warned: set[tuple[str, str]],
    record: Callable[[str], Any] | None = None,
) -> tuple[Nodes, str, list[dict[str, LocalCopy]], list[Any]]:
    """(all ranks, three collectives; two on one node) The nodes (:func:`node_layout`), every node's folder
    checked, this job's listing of each gathered (by global rank: that rank's node's), and every node's
    ``record(job)``, node 0's first (rev72b L1: no collective more). Refused on every rank before anything is
    written, naming the argument: ``local_path`` not a folder, not apart from ``path``, different on ranks of
    one node, unwritable, or shared by two nodes; ``LOCAL_WORLD_SIZE`` differing between ranks."""
    key = durable_key(root, storage_options)
    job = job_folder(local, key)
    found: list[Nodes] = []

    def check() -> tuple[str, int]:
        found.append(node_layout(ctx, process_group, replicas))  # one rank's environment fails all
        _check_apart(local, root, storage_options)
        if os.path.lexists(local) and not os.path.isdir(local):
            raise ValueError(f"local_path {local!r} is not a folder (a file or a broken link is in the way)")
        return local, found[0].local_world_size

    got = ctx.all_ok_values(check)
    nodes = found[0]
    sizes = sorted({lws for _, lws in got})
    if len(sizes) > 1:
        raise ValueError(f"LOCAL_WORLD_SIZE differs between ranks ({sizes}); every rank must see the same")
    for rank, (path, _) in enumerate(got):
        leader = nodes.ranks_of(nodes.node_of(rank))[0]
        if path != got[leader][0]:
            raise ValueError(
                f"local_path differs between ranks of node {nodes.node_of(rank)}: rank {leader} passes "
                f"{got[leader][0]!r}, rank {rank} {path!r}; every rank of a node passes its node's folder"
            )
    several = nodes.count > 1
    tokens = ctx.all_ok_values(lambda: _token(local) if nodes.is_leader and several else "") if several else [""]
    try:

        def scan() -> tuple[dict[str, LocalCopy], Any] | None:
            if not nodes.is_leader:
                return None
            mine = nodes.node_of(nodes.rank)
            for node in range(nodes.count if several else 0):
                leader = nodes.ranks_of(node)[0]
                if node != mine and os.path.exists(os.path.join(local, tokens[leader])):
                    raise ValueError(
                        f"local_path {local!r} of node {mine} is the folder node {node} passes too "
                        f"({got[leader][0]!r}): every node needs a fast tier of its own (replicas on one folder "
                        "are one copy)"
                    )
            _job_folder_ready(local, job, key)
            return scan_job(job, key), record(job) if record is not None else None

        listed = ctx.all_ok_values(scan)
    finally:
        if several and tokens[ctx.rank]:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(local, tokens[ctx.rank]))
    views = [(listed[nodes.ranks_of(nodes.node_of(rank))[0]] or ({}, None))[0] for rank in range(nodes.world_size)]
    for node in range(nodes.count):  # every rank alike: each skipped folder named once (``warned``)
        for tag, copy in sorted(views[nodes.ranks_of(node)[0]].items()):
            where = f"node {node}'s fast tier {got[nodes.ranks_of(node)[0]][0]}, folder {tag}_partial"
            if copy.state not in ("unsafe", "foreign", "unreadable", "corrupt") or (where, copy.detail) in warned:
                continue
            warned.add((where, copy.detail))
            what = "its manifest is not used" if copy.state == "corrupt" else "it is skipped (not loaded, not removed)"
            message = f"{where} is {copy.state} ({copy.detail}); {what}"
            log.warning(message)
            warnings.warn(message, stacklevel=1)
    return nodes, job, views, [x[1] for x in listed if x is not None]


# -- what one node's folder holds of the job (its copies, judged), and what the nodes hold together --------

#: the manifest ``extra`` entry a tiered save adds: {"seq", "durable", "replicas", "nodes", "local_world_size", "root",
#: "path_seen", "due", "lineage"} -- ``path_seen`` (absent in older copies): the highest root sequence number
#: its job knew in ``path`` (committed; in older copies without ``due``, or due there from itself too) when it
#: planned the save; ``due``: ``[[number, save id], ...]``, its job's saves due there above it; ``lineage`` (absent in
#: older copies): the hex digests of the fast-tier saves numbered 1, 2, ... below it, in its history;
#: ``runs`` and ``passed`` (absent in older copies): :data:`RUNS`
TIER_KEY = "tier"

#: committed: this job's manifest parses; uncommitted: files, no manifest; corrupt: the manifest does not parse
#: (its files may serve); unsafe: it names files outside the folder; foreign: another job's, or a link
#: (never read, never removed); unreadable: listing or reading it failed
CopyState = Literal["committed", "uncommitted", "corrupt", "unsafe", "foreign", "unreadable"]


@dataclasses.dataclass(frozen=True)
class LocalCopy:
    """One tag's folder in one node's job folder, as its first rank judged it (:data:`CopyState`).
    ``parts`` (committed copies): every part the manifest lists, with its size, so any rank judges
    completeness from the gathered listings alone."""

    state: CopyState
    files: Mapping[str, int] = dataclasses.field(default_factory=dict)
    digest: int | None = None  #: the manifest's digest (committed copies only)
    seq: int = 0
    order: tuple[int, int, str] = (0, 0, "")
    parts: Mapping[str, int] | None = None
    durable: bool = False  #: the save was due for the durable tier
    detail: str = ""
    path_seen: int | None = None  #: ``extra["tier"]["path_seen"]`` (``None``: not recorded, an older copy)
    due: tuple[tuple[int, str], ...] | None = None  #: ``extra["tier"]["due"]`` (``None``: an older copy)
    #: the digests of the saves its job numbered it after, newest first (``extra["tier"]["lineage"]``;
    #: :data:`SKIPPED` entries; empty: after a checkpoint of ``path``, or not recorded)
    lineage: tuple[int, ...] = ()
    abandoned: tuple[tuple[int, int], ...] = ()  #: what its history abandoned (``catalog.root.abandoned_of``)
    runs: tuple[tuple[int, int], ...] = ()  #: ``extra["tier"]["runs"]`` (:data:`RUNS`; empty: not recorded)
    passed: tuple[tuple[int, int], ...] = ()  #: ``extra["tier"]["passed"]`` (:data:`RUNS`)
    job: str | None = None  #: ``extra["job"]``, the job that saved it (two jobs may share one fast-tier folder)

    @property
    def committed(self) -> bool:
        return self.state == "committed"

    @property
    def key(self) -> tuple[int, tuple[int, int, str]]:
        return (self.seq, self.order)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def seq_of(manifest: Manifest | None) -> int:
    """A tiered save's number in its job (0: none recorded)."""
    tier = manifest.extra.get(TIER_KEY) if manifest is not None else None
    return (_count(tier.get("seq")) if isinstance(tier, Mapping) else None) or 0


SKIPPED = -1  #: a lineage entry: a number its job saw and did not go on from (a rewind by tag, two saves)
PATH_MARK = -2  #: ``TierState.continues`` after a resume from ``path``
LINEAGE = 16  #: saves of its history a tiered save names (further back: :data:`RUNS`)
#: a tiered save's ``runs``: its history's segments, oldest first, ``[id, first]`` (a random 64-bit id in
#: hex, drawn at every resume, and the number of the segment's first save: it holds the saves numbered up
#: to the next one's first), its own last; ``passed``: ``[id, seq]``, saves up to ``seq`` of a segment its
#: history saw at a save and did not go on from (a fork so settled). The newest RUNS of each.
RUNS = 256


def runs_of(value: Any) -> tuple[tuple[int, int], ...]:
    """``runs`` or ``passed`` as recorded (:data:`RUNS`); damaged: none (no fork is told by them)."""
    try:
        pairs = tuple((int(i, 16), n) for i, n in value) if isinstance(value, list) else ()
        return pairs[-RUNS:] if all(type(n) is int for _, n in pairs) else ()
    except (TypeError, ValueError):
        return ()


def due_of(value: Any) -> tuple[tuple[int, str], ...] | None:
    """``due`` as recorded (``None``: absent, an older copy); a damaged entry is no save of the job's (fewer
    known in ``path``: a resume refuses, never loads over another writer's checkpoint)."""
    ok = [e for e in (value if isinstance(value, list) else []) if isinstance(e, list) and len(e) == 2]
    return None if value is None else tuple((n, i) for n, i in ok if type(n) is int and isinstance(i, str))


def ends_of(runs: Sequence[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """segment id -> the numbers ``[first, end)`` its saves have in the history ``runs`` tells."""
    return {s: (f, nxt[1] if nxt else 2**63) for (s, f), nxt in zip(runs, [*runs[1:], None])}


def apart(a: FastCandidate, b: FastCandidate) -> bool:
    """Whether saves ``a`` and ``b`` are of histories whose jobs never saw the other's save (:data:`RUNS`):
    one's segment is in the other's history, the save past where that history left it; or the two left
    one segment for two others (rev63g F1: at any numbers; a roll-back's job saw what it left, ``passed``).
    Unknown (no ``runs``), or settled (one's history passed over the other), is no evidence."""

    def past(x: FastCandidate, y: FastCandidate) -> bool:  # y past where x's history left y's segment
        span = ends_of(x.runs).get(y.runs[-1][0])
        return span is not None and not span[0] <= y.seq < span[1]

    def saw(x: FastCandidate, y: FastCandidate) -> bool:
        return any(s == y.runs[-1][0] and n >= y.seq for s, n in x.passed)

    if not (a.runs and b.runs) or saw(a, b) or saw(b, a):
        return False
    following = {s: nxt for (s, _), nxt in zip(a.runs, a.runs[1:])}
    return (
        past(a, b)
        or past(b, a)
        or any((t := following.get(s)) is not None and t != (n, f) for (s, _), (n, f) in zip(b.runs, b.runs[1:]))
    )


def part_sizes(manifest: Manifest) -> dict[str, int]:
    """A save's parts -- its data files, then the generation's metadata -- and their sizes."""
    return {f.name: f.size for f in manifest.files} | {manifest.metadata.name: manifest.metadata.size}


def read_copy(folder: str, tag: str, owner: str | None) -> tuple[LocalCopy, bytes | None]:
    """Judge one ``{tag}_partial`` folder for the job of ``owner`` (``None``: any job's); with its manifest."""
    if os.path.islink(folder):
        return LocalCopy("foreign", detail=f"a link to {os.path.realpath(folder)} (the fast tier writes none)"), None
    if os.path.lexists(folder) and not os.path.isdir(folder):  # (read as absent below: rev69a M1)
        return LocalCopy("unreadable", detail=f"{folder} is a file, not a folder"), None
    fs, path = open_root(folder)
    try:
        data = read_bytes_or_none(fs, join(path, MANIFEST_NAME))
        files = file_sizes(fs, path)
    except OSError as exc:  # a folder being removed, or damaged
        return LocalCopy("unreadable", detail=str(exc)), None
    if data is None:
        return LocalCopy("uncommitted", files), None
    try:
        manifest = Manifest.from_bytes(data, where=join(folder, MANIFEST_NAME))
    except UnsafeCheckpoint as exc:
        return LocalCopy("unsafe", files, detail=str(exc)), data
    except CheckpointError as exc:
        return LocalCopy("corrupt", files, detail=str(exc)), data
    tier = manifest.extra.get(TIER_KEY)
    tier = tier if isinstance(tier, Mapping) else {}
    root, saved_tag = tier.get("root") if isinstance(tier.get("root"), str) else None, manifest.extra.get("tag")
    if (owner is not None and root != owner) or saved_tag != tag:
        why = f"checkpoint {saved_tag!r} of {root or 'a job that recorded no durable root'}"
        return LocalCopy("foreign", files, seq=seq_of(manifest), detail=why), data
    seen, found = _count(tier.get("path_seen")), tier.get("lineage")
    try:  # a damaged entry ends the lineage's use: no fork is told by it
        lineage = tuple(SKIPPED if e == "skip" else int(e, 16) for e in found) if isinstance(found, list) else ()
    except (TypeError, ValueError):
        lineage = ()
    copy = LocalCopy(
        "committed",
        files,
        hash_bytes(data),
        seq_of(manifest),
        record_order(manifest),
        part_sizes(manifest),
        tier.get("durable") is True,
        path_seen=seen if seen is not None and seen >= 0 else None,
        due=due_of(tier.get("due")),
        lineage=lineage,
        abandoned=abandoned_of(manifest.extra),
        runs=runs_of(tier.get("runs")),
        passed=runs_of(tier.get("passed")),
        job=job if isinstance(job := manifest.extra.get(JOB_KEY), str) else None,
    )
    return copy, data


def scan_job(folder: str, owner: str | None, keep: dict[int, bytes] | None = None) -> dict[str, LocalCopy]:
    """(a node's first rank) Every ``{tag}_partial`` folder of one job folder (missing: none); ``keep``: each
    committed copy's manifest bytes added by digest (the folder may change after the scan: the CLI shows what
    it judged, not a later read). Paths joined to ``folder`` as given (warnings name the folder passed)."""
    if not os.path.isdir(folder):
        return {}
    out = {}
    for tag, name in list_partial_tags(*open_root(folder)).items():
        copy, data = read_copy(join(folder, name), tag, owner)
        out[tag] = copy
        if keep is not None and copy.digest is not None and data is not None:
            keep[copy.digest] = data
    return out


@dataclasses.dataclass(frozen=True)
class FastCandidate:
    """A tag committed in the fast tier (manifest ``digest``): who holds each part, what none holds."""

    tag: str
    digest: int
    seq: int
    order: tuple[int, int, str]
    held_by: Mapping[str, tuple[int, ...]]
    missing: tuple[str, ...]
    durable: bool = False
    path_seen: int | None = None  #: :attr:`LocalCopy.path_seen`
    due: tuple[tuple[int, str], ...] | None = None  #: :attr:`LocalCopy.due`
    lineage: tuple[int, ...] = ()  #: :attr:`LocalCopy.lineage`
    abandoned: tuple[tuple[int, int], ...] = ()  #: :attr:`LocalCopy.abandoned`
    runs: tuple[tuple[int, int], ...] = ()  #: :attr:`LocalCopy.runs`
    passed: tuple[tuple[int, int], ...] = ()  #: :attr:`LocalCopy.passed`
    job: str | None = None  #: :attr:`LocalCopy.job` (a tag-less resume refuses another job's: ``catalog.root``)

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def key(self) -> tuple[int, tuple[int, int, str]]:
        return (self.seq, self.order)


def candidates(views: Sequence[Mapping[str, LocalCopy]], tag: str | None = None) -> list[FastCandidate]:
    """Every save of this job some node committed (only ``tag``'s when given), newest first, with its
    completeness across ``views`` (index ``i``: what global rank ``i``'s node, or the ``i``-th folder, holds)."""
    seen: dict[tuple[str, int], LocalCopy] = {}
    for view in views:
        for t, copy in view.items():
            if copy.committed and copy.digest is not None and (tag is None or t == tag):
                seen.setdefault((t, copy.digest), copy)
    out = []
    for (t, digest), copy in seen.items():
        # folder i holds a part when its files have it at the manifest's size (its bytes are checked when
        # read); the manifest, when it committed this very save
        # (another job's files, or an unsafe folder's, never stand in for this job's parts)
        usable = ("committed", "uncommitted", "corrupt")
        files = [v[t].files if t in v and v[t].state in usable else None for v in views]
        held = {
            name: tuple(i for i, got in enumerate(files) if got is not None and got.get(name) == size)
            for name, size in (copy.parts or {}).items()
        }
        held[MANIFEST_NAME] = tuple(i for i, v in enumerate(views) if t in v and v[t].digest == digest)
        missing = tuple(sorted(n for n, where in held.items() if not where))
        more = (copy.durable, copy.path_seen, copy.due, copy.lineage, copy.abandoned, copy.runs, copy.passed)
        out.append(FastCandidate(t, digest, copy.seq, copy.order, held, missing, *more, job=copy.job))
    out.sort(key=lambda c: (c.key, c.tag), reverse=True)
    return out


def fetch_copy(ctx: DistContext, job: str, cand: FastCandidate, nodes: Nodes, metadata: bool = False) -> PreparedCommit:
    """(all ranks, a broadcast per copy tried) ``cand``'s manifest and, when ``metadata`` or a node lacks
    it, its metadata (else empty), each from the first node whose copy reads back as listed (the holder
    checks it before sending: the listed digest, the manifest's metadata record). A copy that does not
    is logged, naming node and path, and the next node's is tried; none: :class:`CheckpointError` on
    every rank alike (a rank raising alone would leave the others in the broadcast: rev62a F1)."""
    folder = os.path.join(job, partial_dirname(cand.tag))

    def first_intact(name: str, what: str, fits: Callable[[bytes], bool]) -> bytes:
        path, failed = os.path.join(folder, name), []  # the folder is this node's: the source names its own
        for node, src in sorted({nodes.node_of(r): r for r in reversed(cand.held_by[name])}.items()):
            got: tuple[bytes | None, str] = (None, "")
            if ctx.rank == src:
                try:
                    data = read_bytes_or_none(open_fs(path)[0], path)
                    ok = data is not None and fits(data)
                    got = (data, "") if ok else (None, f"{path}: {'gone' if data is None else what}")
                except Exception as exc:  # noqa: BLE001 - agreed below: the next node's copy is tried
                    # an OSError's text ends with its path, named here already (rev63c)
                    why = f"[Errno {exc.errno}] {exc.strerror}" if isinstance(exc, OSError) and exc.filename else exc
                    got = (None, f"{path}: {type(exc).__name__}: {why}")
            data, why = ctx.broadcast_object(got, src=src)
            if data is not None:
                return data
            failed.append(f"node {node}'s {why}")
            if ctx.is_coordinator:
                log.warning("fast tier: checkpoint %r: %s (copy skipped)", cand.tag, failed[-1])
        raise CheckpointError(
            f"no node holds an intact copy of {name} of checkpoint {cand.tag!r} ({'; '.join(failed)})"
        )

    data = first_intact(MANIFEST_NAME, "changed since it was listed", lambda b: hash_bytes(b) == cand.digest)
    record = Manifest.from_bytes(data, where=f"fast-tier manifest of {cand.tag!r}").metadata
    wanted = metadata or len({nodes.node_of(r) for r in cand.held_by[record.name]}) < nodes.count
    body = first_intact(record.name, "not the manifest's metadata", record.matches) if wanted else b""
    return PreparedCommit(data, record.name, body)


def tier_seq(views: Sequence[Mapping[str, LocalCopy]]) -> int:
    return max((c.seq for view in views for c in view.values() if c.committed), default=0)
