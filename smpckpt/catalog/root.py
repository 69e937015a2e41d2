"""A root's catalog: tags, folder names and ``newest``; sequence numbers; the listing; retention.

Layout under a checkpoint root ``path`` (smp's structure)::

    {path}/newest                  # text: the tag of the newest committed checkpoint (rank 0 writes it)
    {path}/{tag}_partial/          # one partial (per-rank shards) checkpoint: a committed DCP folder
    {path}/{tag}/                  # a full artifact (``storage/full``)

Nothing read is trusted: ``newest`` is validated like a tag, a hostile or broken sibling folder listed as
such, never fatal. The listing (:func:`scan_root`, rank 0) is a LIST plus a manifest GET per folder.

Order: sequence number (``extra["sequence"]``), save time, save id (:func:`record_order`); ``newest``
is a hint for stock tools. A :class:`SequenceCounter` lists the root once, then counts on without I/O.
A save after a resume of an older tag records the numbers above it as abandoned (``extra["abandoned"]``
and a copy beside ``newest``); :func:`_abandoned.split_lineage` with ``read_abandoned`` gives the history
retention, ``prune``, ``ls`` and fallbacks use. Retention counts only committed checkpoints of that history,
never removes an abandoned one (an inference), ``unsafe``/``corrupt`` folders nor the tag ``newest`` names,
finishes ``removing`` ones, never fails the save (README, "The Checkpointer")."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import importlib
import logging
import os
import threading
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from smpckpt._checks import PARTIAL_SUFFIX, is_valid_tag, validate_keep, validate_tag
from smpckpt.errors import CheckpointCorrupt, CheckpointError, UnsafeCheckpoint
from smpckpt.storage import (
    MANIFEST_NAME,
    Manifest,
    open_fs,
    probe_checkpoint,
    removal_marked,
    remove_checkpoint,
    write_bytes_atomic,
)
from smpckpt.storage.backends._fs import StampedCache, is_local, ls_fresh, translate_errors

__all__ = ["apply_retention", "RetentionResult", "validate_keep", "CheckpointRecord", "RecordState"]
__all__ += ["scan_root", "record_order", "newest_tag", "Mark", "mark_of"]
__all__ += ["NEWEST_NAME", "PARTIAL_SUFFIX", "validate_tag", "is_valid_tag", "partial_dirname"]
__all__ += ["tag_of_partial_dirname", "join_url", "partial_url", "read_newest", "write_newest", "list_partial_tags"]
__all__ += ["open_root", "SEQUENCE_KEY", "sequence_of", "SequenceCounter", "newest_record"]
__all__ += ["ManifestCache", "ABANDONED_KEY", "ABANDONED_NAME", "abandoned_of", "JOB_KEY"]
#: 0.1.0's names of this module (``smpckpt.retention``) that moved on -> their module (:func:`__getattr__`)
_MOVED_OUT = MappingProxyType(
    {
        "highest_sequence": "smpckpt.catalog",
        **dict.fromkeys(
            ("KeepLatestN", "select_for_removal", "split_lineage", "write_abandoned", "read_abandoned"),
            "smpckpt.catalog._abandoned",
        ),
    }
)
__all__ += list(_MOVED_OUT)  # (a star import of the old path gets them too: rev69j L4)


# the name it had before the module's rename: logging configured for it keeps applying
log = logging.getLogger("smpckpt.catalog.retention")

NEWEST_NAME = "newest"
#: ``newest`` is a one-line text file; anything larger is not ours and is not read whole.
_NEWEST_MAX_BYTES = 4096


def partial_dirname(tag: str) -> str:
    """``{tag}_partial``; ``tag`` was validated at the caller's edge (:func:`validate_tag`)."""
    return f"{tag}{PARTIAL_SUFFIX}"


def tag_of_partial_dirname(name: str) -> str | None:
    """``"step10_partial"`` -> ``"step10"``; ``None`` for names that are not a valid partial folder."""
    tag = name.removesuffix(PARTIAL_SUFFIX)
    return tag if tag != name and is_valid_tag(tag) else None


def join_url(root: str, name: str) -> str:
    """``root`` + ``/`` + ``name`` for local paths and URLs alike (``str`` concatenation keeps the scheme)."""
    root = os.fspath(root)
    return f"{root.rstrip('/')}/{name}" if root.rstrip("/") else f"/{name}"


def partial_url(root: str, tag: str) -> str:
    return join_url(root, partial_dirname(tag))


def read_newest(fs: Any, root_path: str, said: set[str] | None = None) -> str | None:
    """(rank 0) The tag ``newest`` names, or ``None`` when it is missing, unreadable or not a valid tag: logged
    (once per ``said``: a retention pass reads it per removal), never raised; the caller falls back to listing."""
    path = join_url(root_path, NEWEST_NAME)
    try:
        # a backend's own errors (botocore's EndpointConnectionError when S3 is down) as OSError naming
        # the object, like every storage call: the caller falls back to listing, whose failure is raised
        with translate_errors(path):
            data = fs.cat_file(path, start=0, end=_NEWEST_MAX_BYTES + 1)
        tag = bytes(data).decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = f"could not read {path}: {exc}"
    except UnicodeDecodeError:
        why = f"{path} is not UTF-8 text; ignoring it"
    else:
        if (big := len(data) > _NEWEST_MAX_BYTES) or not is_valid_tag(tag):
            what = (
                f"is larger than {_NEWEST_MAX_BYTES} bytes" if big else f"holds {tag[:80]!r}, which is not a valid tag"
            )
            why = f"{path} {what}; ignoring it"
        else:
            return tag
    if said is None or why not in said:
        (said if said is not None else set()).add(why)  # before the log: retention's threads ask at once (rev66d F2)
        log.warning("%s", why)
    return None


def write_newest(fs: Any, root_path: str, tag: str, *, sync: bool = True) -> None:
    """(rank 0, after the checkpoint committed) Point ``newest`` at ``tag``: tmp + rename on POSIX,
    one PUT on object stores, so readers see the old or the new content, never a torn one. ``tag`` was
    validated at the caller's edge."""
    write_bytes_atomic(fs, join_url(root_path, NEWEST_NAME), f"{tag}\n".encode(), sync=sync)


def list_partial_tags(fs: Any, root_path: str) -> dict[str, str]:
    """``{tag: folder name}`` of every ``{tag}_partial`` entry under the root (committed or not).

    One LIST of the root (rank 0 only). A missing root gives ``{}``.
    """
    try:
        with translate_errors(root_path):
            entries = ls_fresh(fs, root_path, detail=True)
    except FileNotFoundError:
        return {}
    found: dict[str, str] = {}
    for entry in entries:
        # a tag folder moved to another disk and linked back is still a tag (fsspec types the link "other")
        if entry.get("type") != "directory" and not (entry.get("islink") and _is_dir(fs, entry["name"])):
            continue
        name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
        tag = tag_of_partial_dirname(name)
        if tag is not None:
            found[tag] = name
    return found


def _is_dir(fs: Any, path: str) -> bool:
    with translate_errors(path):
        return bool(fs.isdir(path))


def open_root(url: str, storage_options: Any = None) -> tuple[Any, str]:
    """``(fs, path)`` of a checkpoint root (a thin alias, so callers need one import)."""
    try:
        return open_fs(url, storage_options)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


#: the manifest ``extra`` entry holding a checkpoint's sequence number
SEQUENCE_KEY = "sequence"
_MAX = 2**62  # a damaged manifest's number must not push every later one out of range


#: the manifest ``extra`` entry of the sequence ranges a save's history abandoned; the root's copy; at
#: most this many ranges are recorded (roll-backs further back are told apart no more)
ABANDONED_KEY, ABANDONED_NAME, _RANGES = "abandoned", "smpckpt.abandoned", 16
Ranges = Sequence[tuple[int, int]]  #: inclusive sequence ranges, newest first


def abandoned_of(extra: Mapping[str, Any] | None) -> tuple[tuple[int, int], ...]:
    """The inclusive sequence ranges ``extra`` records as abandoned; a damaged entry ends the list."""
    found, ranges = (extra or {}).get(ABANDONED_KEY), []
    for pair in found[:_RANGES] if isinstance(found, list) else ():
        ok = isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair)
        if not (ok and 0 < pair[0] <= pair[1] < _MAX):
            break
        ranges.append((pair[0], pair[1]))
    return tuple(ranges)


def sequence_of(extra: Mapping[str, Any] | None) -> int:
    """The sequence number a manifest's ``extra`` records; 0 when it has none (older checkpoints) or it
    is not a plausible one (a bool, negative, or beyond 2**62: damage, ignored)."""
    value = (extra or {}).get(SEQUENCE_KEY)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX:
        return 0
    return value


#: the manifest ``extra`` entry naming the job (its rank 0's process, ``api._save.job_token``) that saved it
JOB_KEY = "job"
T = TypeVar("T")
Mark = tuple[str, str, int, int]  #: a save as any folder holding it shows it: tag, job, number, save stamp (ns)


def mark_of(tag: str, extra: Mapping[str, Any] | None, ns: Any = None) -> Mark | None:
    """The identity of the save ``tag`` whose manifest's ``extra`` this is, wherever its folder is now (moved,
    copied, mounted twice); ``ns``: a record's save time (``order[1]``: older versions' ``created``), else extra's."""
    ns = (extra or {}).get("saved_at_ns") if ns is None else ns
    if not isinstance(ns, int) or isinstance(ns, bool) or ns <= 0:
        return None
    return (tag, str((extra or {}).get(JOB_KEY) or ""), sequence_of(extra), ns)


class SequenceCounter:
    """The highest sequence number one root holds, as this job has seen or drawn it."""

    def __init__(self, root: str, storage_options: Any = None) -> None:
        self.root, self.storage_options = root, storage_options
        self._lock = threading.Lock()  # the save thread and the drain thread draw and note numbers
        self._highest = 0
        self._listed = False  #: every committed checkpoint of the root has been seen (a listing)
        self.read = 0  #: the highest number ``newest`` named when a draw read it (a writer beside this job's)
        self._parent: int | None = None  #: the number of the checkpoint resumed, until the next draw
        self._drawn, self._tag, self.job = 0, "", ""  #: this job's last save's number (a guarded draw), tag, identity
        self._first = self._last = self._accepted = 0  #: its first save's number; its last draw's (exports too);
        # the highest number of a checkpoint this job saved or resumed: another job's above it is not its history
        self._saves = 0  #: the highest number of a checkpoint seen or saved (an export's not: a roll-back's range)
        self.abandoned: tuple[tuple[int, int], ...] = ()  #: what this job's history abandoned (roll-backs)
        self.manifests = ManifestCache()  #: the root's committed records this job read (its listings reuse them)
        self.offline = False  #: (a tiered save, the root unreachable) numbered from what it saw, listed later
        self._from = ("", "", 0)  #: the job, tag and number resumed (for good)
        self._unseen: tuple[CheckpointRecord, str, int] | None = None  #: another's unseen (an export saw it), our last
        self.newest_read: CheckpointRecord | None = None  #: path's newest committed, as the last draw read it
        #: this job's last checkpoint in the root (committed there, or resumed): the run wherever its folder goes
        self.mark: Mark | None = None
        self.hinted: tuple[Mark | None, int] = (None, 0)  #: this thread's resume (``hint``) and when (ns)

    def resumed(self, seq: int, abandoned: Ranges, extra: Mapping[str, Any] | None = None, tag: str = "") -> None:
        """(once its state is applied) The job goes on from checkpoint ``seq`` (recording ``abandoned``; 0:
        unnumbered, older versions or stock DCP), ``tag`` saved with ``extra``; the next draw abandons those
        numbered above (its saver's late commits too: a replacement overlapping the last save of its predecessor)."""
        job = (extra or {}).get(JOB_KEY)
        with self._lock:
            self._parent, self.abandoned = seq, tuple(abandoned)
            if not (job and job == self.job):  # (a roll-back to its own keeps the job it replaced: rev69i 3)
                self._from = (str(job or ""), tag, seq)
            self._accepted = max(self._accepted, seq) if 0 <= seq < _MAX else self._accepted

    def resuming(self, target: T, tag: str | None) -> T:
        """(rank 0) ``target`` (``api._resume.Target``, or a fast-tier copy naming its ``job``:
        ``api._tiers.FastCandidate``), which a resume of ``tag`` chose; refused when tag-less, this job saved and it is
        another's above all this job saved or resumed: rolling back, it would take that job's state silently (rev69c
        1); reading that job's number (an export's draw, a refused save) accepts nothing (rev69i 1)."""
        manifest, seq = getattr(target, "manifest", None), getattr(target, "order", (0,))[0]
        job = getattr(manifest, "extra", {}).get(JOB_KEY, getattr(target, "job", None))
        theirs = job not in (None, self.job)
        # at this job's own number too (a failed save's, a predecessor's drawn alike: rev69j), but the one resumed
        resumed = (getattr(target, "tag", None), seq) == self._from[1:]
        if tag is None and self._drawn and self.job and theirs and seq >= self._accepted and not resumed:
            found = CheckpointRecord(getattr(target, "tag", ""), True, (seq, 0, ""))
            late = job == self._from[0] and self._from[1]  # the replaced job's: two histories
            from smpckpt.catalog._in_use import refused  # the error path's alone

            raise refused(self.root, found, self._tag, self._drawn, "resume", late or "")
        return target

    @property
    def drawn(self) -> int:
        """This job's last save's number (a guarded draw: an export's draw sets none); 0 before its first save."""
        return self._drawn

    def saw(self, seq: int, *, listed: bool = False) -> None:
        """A checkpoint numbered ``seq`` exists under the root; ``listed``: the highest of a whole listing."""
        with self._lock:
            if 0 <= seq < _MAX:
                self._highest, self._saves = max(self._highest, seq), max(self._saves, seq)
            self._listed = self._listed or listed

    def next(self, job: str = "", guard: bool = True) -> int:
        """(rank 0) The sequence number of a new save; the first time, the root is listed first (outside the lock).
        ``guard`` (a save into the root): :class:`RootInUse` when another job's checkpoint this job has not seen
        is the newest (README, "The Checkpointer": a second job saving into the root); ``job``: this job's identity
        (``""``: unknown, nothing refused)."""
        self.job, self.newest_read = job, None
        if not self._listed and not self.offline:
            self._first_listing(scan_root(self.root, storage_options=self.storage_options, cache=self.manifests), guard)
        elif not self.offline:  # (offline: not read, its timeouts paid again by each save: rev68b F3)
            # another writer of this root in this process (a second model's Checkpointer, one beside smp's face)
            # has its own counter: ``newest`` names the last commit of any, so a new save is numbered after it
            found = newest_record(self.root, self.storage_options, self.manifests)
            seq = found.order[0] if found is not None and found.committed else 0
            self.newest_read = found if seq else None
            theirs = found.extra.get(JOB_KEY) if found is not None and seq and job else None  # None: older
            mine = seq > self._highest or seq in (self._drawn, self._last)  # committed since, or the number it drew
            if theirs not in (None, job) and mine and found is not None:
                # the job resumed from committed late (a replacement overlapping its last save: rev69c 4), numbered
                # before this job's first save was (rev69i 3): abandoned, never refused
                late = theirs == self._from[0] and (self._parent is not None or seq <= self._first)
                if not late:  # not seen: committed since this job's last draw
                    self._unseen = self._unseen or (found, self._tag, self._drawn)  # an export: at the next save
                else:
                    log.warning(
                        "%s: %r (sequence %d) committed by the job this one replaced after it resumed %r (sequence "
                        "%d): abandoned by this job's history (kept, never counted nor resumed tag-less)",
                        *(self.root, found.tag, seq, *self._from[1:]),
                    )
            self.read = max(self.read, seq)
            self.saw(self.read)
        if guard and self._unseen is not None:
            from smpckpt.catalog._in_use import refused  # the error path's alone

            raise refused(self.root, *self._unseen)
        with self._lock:
            self._highest = self._last = self._highest + 1
            if not guard:  # an export: the history (roll-back, a late predecessor) is its next save's (rev69i 2)
                return self._last
            if self._parent is not None and self._saves > self._parent:  # a roll-back: numbered past others
                self.abandoned = ((self._parent + 1, self._saves), *self.abandoned)[:_RANGES]
            self._parent, self._drawn, self._accepted = None, self._highest, self._highest
            self._saves = self._highest
            self._first = self._first or self._highest
            return self._highest

    def _first_listing(self, records: Sequence[CheckpointRecord], guard: bool) -> None:
        """A job that resumed nothing (a Checkpointer built per save; a fresh start): another job's checkpoint above
        all of its own is refused as by :meth:`next`; holding none of its own, it is a roll-back to 0 (warned)."""
        committed = [r for r in records if r.committed]  # oldest first
        self.newest_read = committed[-1] if committed else None
        self.saw(max((r.order[0] for r in committed), default=0), listed=True)
        mine = [r for r in committed if r.extra.get(JOB_KEY) == self.job]
        # this thread resumed it (a per-save Checkpointer; matched by the save, not the folder: a run moved under
        # its link is the same run, another run's tag alike is not), and this job saved nothing since: its history
        # goes on from there, a roll-back past the job's own newer saves too (rev72j M2)
        hint, at = self.hinted if not self._drawn else (None, 0)
        fresh = hint is not None and not any(r.order[1] > at for r in mine)
        hinted = [r for r in committed if fresh and hint == mark_of(r.tag, r.extra, r.order[1])]
        if self._parent is not None or not (committed and self.job) or (committed[-1] in mine[-1:] and not hinted):
            return
        if mine and committed[-1] not in mine[-1:] and committed[-1].extra.get(JOB_KEY) is not None:
            last = (self._tag, self._drawn) if self._drawn else (mine[-1].tag, mine[-1].order[0])
            self._unseen = self._unseen or (committed[-1], *last)  # refused now, or at the next save after an export
        if (mine and not hinted) or self._drawn:  # (drawn offline: its history is its own, rev69c 7)
            return
        if hinted:  # its history goes on from there: not another run's (rev69c 5)
            with self._lock:
                self._parent = self._accepted = hinted[0].order[0]
                self.abandoned = tuple(p for p in abandoned_of(hinted[0].extra) if p[1] < self._parent)
        else:  # kept, never removed nor counted: a job may still be saving there
            from smpckpt.catalog._abandoned import warn_kept  # (it imports this module)

            warn_kept(self.root, committed)
            with self._lock:
                self._parent = 0

    def adopt(self, other: SequenceCounter) -> None:
        """What ``other`` (the counter of the Checkpointer this one's replaces, of the same root) knew."""
        with other._lock:
            state = other._highest, other._listed, other.read, other._parent, other.abandoned, other._drawn, other._tag
            more = other._from, other._unseen, other._first, other._last, other._accepted, other._saves, other.mark
        with self._lock:
            self._highest, self._listed, self.read, self._parent, self.abandoned, self._drawn, self._tag = state
            self._from, self._unseen, self._first, self._last, self._accepted, self._saves, self.mark = more
        self.manifests = other.manifests

    def landed(self, tag: str, extra: Mapping[str, Any] | None) -> None:
        """(rank 0) The save of ``tag`` (its manifest's ``extra``) is committed in the root (a drain's too)."""
        self.mark = mark_of(tag, extra) or self.mark

    def record(self, tag: str) -> dict[str, Any]:
        """The manifest ``extra`` entries of the save of ``tag`` just drawn: the job, the history's abandoned ranges."""
        self._tag = tag
        return {JOB_KEY: self.job, **({ABANDONED_KEY: [list(r) for r in self.abandoned]} if self.abandoned else {})}


#: States a folder under a root can be in. ``unsafe``: its ``.metadata`` or manifest must not be
#: trusted (a pickle payload, names escaping the folder); ``unreadable``: probing failed (I/O error).
#: ``removing``: an interrupted removal (retention, prune) left it: garbage, finished by the next retention.
RecordState = Literal["committed", "uncommitted", "removing", "legacy", "missing", "corrupt", "unsafe", "unreadable"]


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """One partial checkpoint folder under a root. ``order`` sorts records oldest first (:func:`record_order`);
    ``committed``: a valid manifest (the commit marker) only; ``detail`` says why a folder is not usable."""

    tag: str
    committed: bool
    order: tuple[int, int, str] = (0, 0, "")
    url: str = ""
    state: RecordState = "committed"
    manifest: Manifest | None = None
    detail: str = ""

    @property
    def extra(self) -> Mapping[str, Any]:
        return self.manifest.extra if self.manifest is not None else {}

    @property
    def files(self) -> list[str]:
        """The committed generation's files (what a cached record checks for links again)."""
        return [f.name for f in self.manifest.files] + [self.manifest.metadata.name] if self.manifest else []

    @property
    def size(self) -> int | None:
        """Bytes of the committed generation (metadata + data files), from the manifest."""
        return self.manifest.total_bytes if self.manifest is not None else None


#: a root's committed records this job read, by manifest (:func:`_record`)
ManifestCache = StampedCache[CheckpointRecord]


def record_order(manifest: Manifest | Mapping[str, Any] | None) -> tuple[int, int, str]:
    """Sort key of a committed checkpoint, oldest first: its sequence number (``smpckpt.catalog.root``;
    0 for checkpoints written before sequence numbers), then -- only among equal numbers, so only among
    those older checkpoints or two jobs racing in one root -- the save time (our nanosecond stamp, else the
    manifest's ``created``), then the save id."""
    if manifest is None:
        return (0, 0, "")
    created: Any
    if isinstance(manifest, Manifest):
        extra, created, save_id = manifest.extra, manifest.created, manifest.save_id
    else:
        if not manifest:
            return (0, 0, "")
        extra, created, save_id = manifest.get("extra") or {}, manifest.get("created"), str(manifest.get("save_id", ""))
    ns = extra.get("saved_at_ns")
    if not isinstance(ns, int) or isinstance(ns, bool):
        ns = 0
        if isinstance(created, str):
            with contextlib.suppress(ValueError, OverflowError):  # not a date: 0
                ns = int(datetime.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() * 1e9)
    return (sequence_of(extra), ns, str(save_id))


def _record(tag: str, url: str, storage_options: Any, cache: ManifestCache | None = None) -> CheckpointRecord:
    """Probe one folder; never raises for what the folder holds (one bad sibling must not break a root).
    ``cache`` (local roots): the record read before while its manifest is the same file (an overwrite or a
    removal of the tag, by any process, makes another) and its files are still confined."""
    if cache is not None:
        fs, path = open_root(url, storage_options)
        return cache.get(fs, path, MANIFEST_NAME, lambda: (r := _record(tag, url, storage_options), r.committed))
    try:
        found = probe_checkpoint(url, storage_options)
        if found.manifest is not None and found.manifest.kind != "partial":  # an export into `<x>_partial`
            raise UnsafeCheckpoint(f"a {found.manifest.kind} checkpoint (an export), never resumed or removed here")
    except UnsafeCheckpoint as exc:
        log.warning("%s: refusing an unsafe checkpoint folder: %s", url, exc)
        return CheckpointRecord(tag, False, url=url, state="unsafe", detail=str(exc))
    except CheckpointCorrupt as exc:
        log.warning("%s: unreadable manifest, treating the checkpoint as uncommitted: %s", url, exc)
        return CheckpointRecord(tag, False, url=url, state="corrupt", detail=str(exc))
    except (CheckpointError, OSError) as exc:
        log.warning("%s: could not probe the checkpoint folder: %s", url, exc)
        return CheckpointRecord(tag, False, url=url, state="unreadable", detail=str(exc))
    if found.manifest is None:  # the probe's listing shows a mark (no HEAD + LIST more per folder: hunt66b r4)
        if found.state == "uncommitted" and (
            found.marked or found.marked is None and removal_marked(url, storage_options)
        ):
            return CheckpointRecord(tag, False, url=url, state="removing", detail="an interrupted removal left it")
        return CheckpointRecord(tag, False, url=url, state=found.state, detail=found.detail)
    return CheckpointRecord(tag, True, record_order(found.manifest), url, "committed", found.manifest)


def newest_record(
    root_url: str, storage_options: Any = None, cache: ManifestCache | None = None
) -> CheckpointRecord | None:
    """The record of the folder ``newest`` names (``None``: ``newest`` missing or unreadable)."""
    try:
        fs, root_path = open_root(root_url, storage_options)
        tag = read_newest(fs, root_path)
    except (CheckpointError, OSError):
        return None
    return None if tag is None else _record(tag, partial_url(root_url, tag), storage_options, cache)


def scan_root(
    root_url: str, *, storage_options: Any = None, cache: ManifestCache | None = None
) -> list[CheckpointRecord]:
    """Every ``{tag}_partial`` folder under ``root_url``, oldest first (uncommitted ones first of all);
    ``cache``: the records of a :class:`ManifestCache` where they are still what is there.

    A folder that cannot be trusted or read is listed with its state (``unsafe``, ``corrupt``,
    ``unreadable``) and a warning; the scan carries on with the others.
    """
    fs, root_path = open_root(root_url, storage_options)
    tags = sorted(list_partial_tags(fs, root_path).items())
    jobs = [(tag, join_url(root_url, name)) for tag, name in tags]
    if cache is not None:  # gone from the listing: forgotten
        cache.keep_only({join_url(join_url(root_path, name), MANIFEST_NAME) for _, name in tags})
    if len(jobs) > 1 and not is_local(fs):
        # one GET per folder: a few in flight on object stores
        with concurrent.futures.ThreadPoolExecutor(min(8, len(jobs)), thread_name_prefix="smpckpt-scan") as pool:
            records = list(pool.map(lambda job: _record(job[0], job[1], storage_options, cache), jobs))
    else:
        records = [_record(tag, url, storage_options, cache) for tag, url in jobs]
    records.sort(key=lambda r: (r.committed, r.order, r.tag))
    return records


def newest_tag(root_url: str, *, storage_options: Any = None) -> str | None:
    """The validated content of ``{root}/newest``, or ``None``."""
    return read_newest(*open_root(root_url, storage_options))


@dataclasses.dataclass(frozen=True)
class RetentionResult:
    removed: tuple[str, ...]
    failed: tuple[str, ...]  #: tags whose removal raised (logged); retried by the next save
    removed_uncommitted: tuple[str, ...] = ()  #: stale uncommitted folders removed (their tags)
    aborted_uploads: tuple[str, ...] = ()  #: stale S3 multipart uploads aborted (their keys)
    removed_debris: tuple[str, ...] = ()  #: other stale debris removed (paths; see smpckpt.catalog._debris)


def apply_retention(
    root_url: str,
    keep: int | None,
    *,
    storage_options: Any = None,
    protected: Collection[str] = (),
    dry_run: bool = False,
    uncommitted_older_than: float | None = None,
    just_saved: str | None = None,
    cache: ManifestCache | None = None,
    said: set[str] | None = None,
) -> RetentionResult:
    """(rank 0 only) Delete the committed partial checkpoints beyond the ``keep`` newest of the history
    (``_abandoned.split_lineage``, ``read_abandoned``: what a roll-back abandoned stays, uncounted).

    Removals go through :func:`smpckpt.storage.remove_checkpoint` (manifest first); never the tag ``newest`` names.
    ``keep=None`` removes no committed checkpoint. ``uncommitted_older_than`` (seconds) also removes the debris of
    failed or killed saves nothing wrote to for that long (:func:`smpckpt.catalog._debris.sweep_stale`).
    ``just_saved`` (the tag a save just committed): when another committed checkpoint is numbered after it (another
    job saving into this root), no committed checkpoint is removed, with a warning. ``cache``: the Checkpointer's
    records of the root (:class:`ManifestCache`), reused while their manifests are unchanged. ``said``: what
    :func:`read_newest` logged already (``prune``'s own read): a damaged ``newest`` is named once per pass."""
    if uncommitted_older_than is not None and not uncommitted_older_than >= 0:
        raise ValueError(f"uncommitted_older_than must be >= 0 seconds or None, got {uncommitted_older_than!r}")
    from smpckpt.catalog._abandoned import read_abandoned, select_for_removal  # they import this module
    from smpckpt.catalog._debris import run_each, sweep_stale

    for trust in (cache, None):
        records = scan_root(root_url, storage_options=storage_options, cache=trust)
        abandoned = read_abandoned(root_url, storage_options, records) if keep is not None else ()
        doomed = select_for_removal(records, keep, protected, abandoned) if keep is not None else []
        by_tag = {r.tag: r for r in records}
        # a victim's own cached record never alone condemns it: its manifest is read again (records are
        # kept only where stat is authoritative, storage.backends._fs.coherent_device; belt and braces)
        if trust is None or all(_record(t, by_tag[t].url, storage_options).order == by_tag[t].order for t in doomed):
            break
    saved = next((r for r in records if r.tag == just_saved and r.committed), None)
    # the same number too: two jobs drew it, each would remove the other's (rev69c 3)
    later = [r.tag for r in records if saved and r.committed and r.order[0] >= saved.order[0] and r.tag != saved.tag]
    if doomed and later:
        log.warning(
            "retention: %s, numbered after (or as) the checkpoint just saved (%s): another job saves into this root at the "
            "same time; removing no committed checkpoint (prune by hand once that is settled)",
            later[:5],
            just_saved,
        )
        doomed = []
    failed: list[str] = []

    def remove(tag: str, what: str, *, uncommitted_only: bool = False) -> bool:
        if dry_run:
            return True
        try:
            if not remove_checkpoint(by_tag[tag].url, storage_options, uncommitted_only=uncommitted_only):
                log.info("retention: %s committed while it was being removed; left as it is", by_tag[tag].url)
                return False
            log.info("retention: removed %s %s", what, by_tag[tag].url)
            return True
        except Exception as exc:  # noqa: BLE001 - a failed delete must not fail the save
            failed.append(tag)
            log.warning("retention: could not remove %s (will retry on the next save): %s", by_tag[tag].url, exc)
            return False

    (fs, path), said = open_root(root_url, storage_options), set() if said is None else said
    # read before each removal (another job may point it back), first only to run several side by side
    many = len(doomed) > 1 and not is_local(fs) and read_newest(fs, path, said) is not None
    removed = run_each(fs, doomed, lambda t: t != read_newest(fs, path, said) and remove(t, "checkpoint"), many)
    # interrupted removals, finished (8 at once too); a manifest found once marked is a save that finished that
    # removal and committed since (rev65a F2)
    unfinished = [r.tag for r in records if r.state == "removing" and r.tag not in protected]
    removed += run_each(fs, unfinished, lambda t: remove(t, "the rest of", uncommitted_only=True))
    swept: tuple[list[str], list[str], list[str]] = ([], [], [])  # stale folders, aborted uploads, debris
    if uncommitted_older_than is not None:
        swept = sweep_stale(root_url, records, uncommitted_older_than, remove, storage_options, protected, dry_run)
    phase = {r.tag: (r.state != "committed", r.state != "removing", i) for i, r in enumerate(records)}
    failed.sort(key=phase.__getitem__)  # the pass's order (by phase, oldest first), as one by one (rev66d F1)
    return RetentionResult(tuple(removed), tuple(failed), *(tuple(found) for found in swept))


def __getattr__(name: str) -> Any:  # 0.1.0's names that moved out (``smpckpt.retention`` is this module: _moved)
    if name in _MOVED_OUT:  # (imported lazily: those modules import this one)
        return getattr(importlib.import_module(_MOVED_OUT[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_MOVED_OUT})
