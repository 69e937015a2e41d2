"""What one node's fast tier holds of one job, and what the nodes hold together (no collectives here).

A job's copies live in ``{local_path}/smpckpt-job-<hash of its durable root>/{tag}_partial`` and every
manifest records that root (``extra["tier"]["root"]``) and the tag, so a copy is this job's only when
both the folder and the manifest say so. Each folder is judged once, by its node's first rank
(:func:`scan_job`); the judgement travels in the gathered listing, so every rank decides alike:

* ``committed``: a manifest of this job and this tag that parses -- a candidate;
* ``uncommitted``: files, no manifest (a save that did not finish, or one being written);
* ``corrupt``: a manifest that does not parse (its files may still serve a copy committed elsewhere);
* ``unsafe``: a manifest naming files outside the folder (``../x``, an absolute path): never read;
* ``foreign``: another job's checkpoint (its manifest names another root or tag, or the folder is a
  link: the fast tier never writes links): never read, never removed;
* ``unreadable``: listing or reading it failed.

A tag is *committed* when some node committed it; *complete* when the folders' files, at the manifest's
sizes, cover its parts (data files and the generation's metadata). Copies are ordered by the tier's own
save number (``extra["tier"]["seq"]``), then the manifest's order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Literal

from smpckpt.catalog.retention import list_partial_tags, open_root, partial_dirname, record_order
from smpckpt.errors import CheckpointError, UnsafeCheckpoint
from smpckpt.storage import Manifest
from smpckpt.storage.backends._fs import file_sizes, join, read_bytes_or_none
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format.commit import remove_folder
from smpckpt.storage.format.manifest import MANIFEST_NAME

__all__ = ["TIER_KEY", "CopyState", "LocalCopy", "FastCandidate", "scan_job", "read_copy", "seq_of", "owner_of"]
__all__ += ["part_sizes", "judge", "candidates", "tier_seq", "pending_drains", "retain_local"]

log = logging.getLogger("smpckpt.api")

#: the manifest ``extra`` entry a tiered save adds: {"seq", "durable", "replicas", "nodes", "local_world_size", "root"}
TIER_KEY = "tier"

CopyState = Literal["committed", "uncommitted", "corrupt", "unsafe", "foreign", "unreadable"]


@dataclasses.dataclass(frozen=True)
class LocalCopy:
    """One tag's folder in one node's job folder, as its first rank judged it (module docstring).
    ``parts`` (committed copies): every part the manifest lists, with its size -- so any rank can judge
    completeness from the gathered listings without the manifests (~20 MiB each at 1 TiB)."""

    state: CopyState
    files: Mapping[str, int] = dataclasses.field(default_factory=dict)
    digest: int | None = None  #: the manifest's digest (committed copies only)
    seq: int = 0
    order: tuple[int, int, str] = (0, 0, "")
    parts: Mapping[str, int] | None = None
    durable: bool = False  #: the save was due for the durable tier
    detail: str = ""

    @property
    def committed(self) -> bool:
        return self.state == "committed"

    @property
    def key(self) -> tuple[int, tuple[int, int, str]]:
        return (self.seq, self.order)


def seq_of(manifest: Manifest | None) -> int:
    """A tiered save's number in its job (0: none recorded)."""
    tier = manifest.extra.get(TIER_KEY) if manifest is not None else None
    seq = tier.get("seq") if isinstance(tier, Mapping) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else 0


def owner_of(manifest: Manifest) -> str | None:
    """The durable root (location key) a fast-tier copy belongs to; ``None`` when it records none."""
    tier = manifest.extra.get(TIER_KEY)
    root = tier.get("root") if isinstance(tier, Mapping) else None
    return root if isinstance(root, str) else None


def part_sizes(manifest: Manifest) -> dict[str, int]:
    """A save's parts -- its data files, then the generation's metadata -- and their sizes."""
    return {f.name: f.size for f in manifest.files} | {manifest.metadata.name: manifest.metadata.size}


def read_copy(folder: str, tag: str, owner: str | None) -> tuple[LocalCopy, bytes | None]:
    """Judge one ``{tag}_partial`` folder for the job whose durable root is ``owner`` (``None``: any
    job's copy counts as committed); also its manifest's bytes."""
    if os.path.islink(folder):
        return LocalCopy("foreign", detail=f"a link to {os.path.realpath(folder)} (the fast tier writes none)"), None
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
    root, saved_tag = owner_of(manifest), manifest.extra.get("tag")
    if (owner is not None and root != owner) or saved_tag != tag:
        why = f"checkpoint {saved_tag!r} of {root or 'a job that recorded no durable root'}"
        return LocalCopy("foreign", files, seq=seq_of(manifest), detail=why), data
    tier = manifest.extra.get(TIER_KEY)
    durable = isinstance(tier, Mapping) and tier.get("durable") is True
    copy = LocalCopy(
        "committed", files, hash_bytes(data), seq_of(manifest), record_order(manifest), part_sizes(manifest), durable
    )
    return copy, data


def scan_job(folder: str, owner: str | None) -> dict[str, LocalCopy]:
    """(a node's first rank) Every ``{tag}_partial`` folder of one job folder (missing: none)."""
    if not os.path.isdir(folder):
        return {}
    fs, root = open_root(folder)
    return {tag: read_copy(join(root, name), tag, owner)[0] for tag, name in list_partial_tags(fs, root).items()}


@dataclasses.dataclass(frozen=True)
class FastCandidate:
    """A tag committed in the fast tier (the save whose manifest has ``digest``), who holds each of its
    parts (global ranks whose node folder holds it; the manifest: the nodes that committed it), what none holds."""

    tag: str
    digest: int
    seq: int
    order: tuple[int, int, str]
    held_by: Mapping[str, tuple[int, ...]]
    missing: tuple[str, ...]
    durable: bool = False

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def key(self) -> tuple[int, tuple[int, int, str]]:
        return (self.seq, self.order)


def judge(
    parts: Mapping[str, int], holders: Sequence[int], files: Sequence[Mapping[str, int] | None]
) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """Who holds each part: folder ``i`` holds a part when ``files[i]`` (``None``: nothing usable) has it
    at its size (its bytes are checked when read); the manifest is held by ``holders``. And the parts
    none holds."""
    held = {
        name: tuple(i for i, got in enumerate(files) if got is not None and got.get(name) == size)
        for name, size in parts.items()
    }
    held[MANIFEST_NAME] = tuple(holders)
    return held, tuple(sorted(n for n, where in held.items() if not where))


def _usable_files(copy: LocalCopy | None) -> Mapping[str, int] | None:
    # another job's files, or an unsafe folder's, never stand in for this job's parts
    return copy.files if copy is not None and copy.state in ("committed", "uncommitted", "corrupt") else None


def candidates(views: Sequence[Mapping[str, LocalCopy]], tag: str | None = None) -> list[FastCandidate]:
    """Every save of this job some node committed (only ``tag``'s when given), newest first, with its
    completeness across ``views`` (index ``i``: what global rank ``i``'s node holds)."""
    seen: dict[tuple[str, int], LocalCopy] = {}
    for view in views:
        for t, copy in view.items():
            if copy.committed and copy.digest is not None and (tag is None or t == tag):
                seen.setdefault((t, copy.digest), copy)
    out = []
    for (t, digest), copy in seen.items():
        holders = [i for i, v in enumerate(views) if t in v and v[t].digest == digest]
        held, missing = judge(copy.parts or {}, holders, [_usable_files(v.get(t)) for v in views])
        out.append(FastCandidate(t, digest, copy.seq, copy.order, held, missing, copy.durable))
    out.sort(key=lambda c: (c.key, c.tag), reverse=True)
    return out


def tier_seq(views: Sequence[Mapping[str, LocalCopy]]) -> int:
    """The highest save number any node's committed copy of this job carries."""
    return max((c.seq for view in views for c in view.values() if c.committed), default=0)


def pending_drains(views: Sequence[Mapping[str, LocalCopy]], durable_seq: int) -> list[FastCandidate]:
    """Saves that were due for the durable tier and are newer than everything the durable tier holds of
    this job (their drain never committed), newest first."""
    return [c for c in candidates(views) if c.durable and c.seq > durable_seq]


def retain_local(
    folder: str,
    owner: str,
    views: Sequence[Mapping[str, LocalCopy]],
    keep: int | None,
    protected: set[str],
    durable_seq: int,
) -> list[str]:
    """(one rank per node) ``num_kept_local`` over this node's ``folder`` of the job ``owner``; ``views``: every node's
    listing (gathered), so every node decides alike. Kept: the ``keep`` newest *complete* saves, the
    ``protected`` tags, and every save due for the durable tier that is newer than what it holds
    (``durable_seq``): such a copy goes only once its drain (or a later one) committed. Removed: older
    saves, and folders no node committed that are older than the newest commit here. Unsafe and foreign
    folders, and committed saves newer than the kept ones (an incomplete one keeps no slot), stay.
    The removed tags."""
    found = candidates(views)
    if keep is None or not found:
        return []
    complete = [c for c in found if c.complete]
    kept = {c.tag for c in complete[:keep]} | protected | {c.tag for c in pending_drains(views, durable_seq)}
    oldest_kept = min((c.key for c in complete[:keep]), default=None)
    committed = {c.tag for c in found}
    removed = []
    fs, root = open_root(folder)
    mine = scan_job(folder, owner)
    newest = max(((c.key, t) for t, c in mine.items() if c.committed), default=None)
    newest_mtime = os.stat(os.path.join(folder, partial_dirname(newest[1]), MANIFEST_NAME)).st_mtime if newest else None
    for tag, copy in mine.items():
        if tag in kept or copy.state in ("unsafe", "foreign", "unreadable"):
            continue
        if tag in committed:
            key = next(c.key for c in found if c.tag == tag)
            if len(complete) < keep or oldest_kept is None or key >= oldest_kept:
                continue
        elif newest_mtime is None or os.stat(os.path.join(folder, partial_dirname(tag))).st_mtime >= newest_mtime:
            continue  # possibly a save still writing: only older debris goes
        # the protocol's removal: marked, manifest first (a kill half-way leaves no committed copy missing
        # parts), never through a link; an uncommitted folder only while it stays uncommitted
        path = join(root, partial_dirname(tag))
        failed = remove_folder(fs, path, path, uncommitted_only=not copy.committed)
        if failed:
            log.warning("fast tier %s: could not remove %d file(s) of %r", folder, len(failed), tag)
        else:
            removed.append(tag)
    return removed
