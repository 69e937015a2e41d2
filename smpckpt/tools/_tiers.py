"""``smpckpt ls`` / ``smpckpt verify`` with ``--local DIR ...``: the fast tier of tiered checkpoints
(``save_checkpoint(..., local_path=...)``) as the given node folders hold it.

Only ``PATH``'s job folder in each (``{DIR}/smpckpt-job-<hash of PATH>``, ``smpckpt.api._tiers``) is
judged; other jobs' folders are listed as such (:func:`other_jobs`). One node's ``{tag}_partial``
folder usually holds only its share -- its ranks' files plus replicas of other nodes' -- so a tag is
judged across every folder given: committed in how many (a node writes the manifest only after every
node held its share), which parts the union holds at the manifest's sizes
(``smpckpt.api._tier_copies.judge``: what a resume uses), and, for ``verify``, every file any folder
holds checked against the manifest, block by block. A folder a resume skips (``unsafe``: a manifest
naming files outside its folder; ``foreign``: another job's checkpoint, or a link) is listed as such,
never read further. A *part* is a data file the manifest lists or the generation's metadata
(``.metadata.<save id>``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from smpckpt.api._resume import resolve_target
from smpckpt.api._tier_copies import TIER_KEY, judge, part_sizes, read_copy, seq_of
from smpckpt.api._tiers import JOB_PREFIX, job_dirname, job_folder, read_job_record
from smpckpt.catalog.retention import (
    PARTIAL_SUFFIX,
    CheckpointRecord,
    list_partial_tags,
    open_root,
    record_order,
    validate_tag,
)
from smpckpt.errors import CheckpointError
from smpckpt.storage import Manifest
from smpckpt.storage.format.manifest import MANIFEST_NAME
from smpckpt.tools._common import UsageError, human, layout_json

__all__ = [
    "FastRow",
    "ResumePick",
    "check_local_dirs",
    "split_tag_spec",
    "fast_rows",
    "other_jobs",
    "OtherJob",
    "resume_pick",
    "ranks_text",
    "write_table",
    "write_fast_table",
]


def check_local_dirs(dirs: Sequence[str]) -> list[str]:
    """The ``--local`` folders as given (trailing ``/`` dropped); a usage error names one that is not
    an existing folder or is given twice."""
    out: list[str] = []
    seen: dict[str, str] = {}
    for d in dirs:
        d = d.rstrip("/") or d
        if not os.path.isdir(d):
            raise UsageError(f"--local {d!r}: no such folder (a node's fast tier, the local_path it saved to)")
        real = os.path.realpath(d)
        if real in seen:
            raise UsageError(f"--local {d!r} is the same folder as --local {seen[real]!r}")
        seen[real] = d
        out.append(d)
    return out


def split_tag_spec(spec: str) -> tuple[str, str]:
    """``PATH/TAG`` or ``PATH/TAG_partial`` -> ``(PATH, TAG)``; a usage error for anything else."""
    spec = spec.rstrip("/") or spec
    root, _, name = spec.rpartition("/")
    tag = name[: -len(PARTIAL_SUFFIX)] if name.endswith(PARTIAL_SUFFIX) else name
    try:
        validate_tag(tag)
    except ValueError as exc:
        raise UsageError(f"{spec!r} is not PATH/TAG: {exc}") from exc
    return (root or "."), tag


# -- ls ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FastRow:
    """One committed save of a tag in the fast tier (or a tag no folder committed), across the folders.

    ``state``: ``complete`` (every part held by some folder at the manifest's size), ``incomplete``,
    ``uncommitted`` (no folder holds a manifest), or -- no folder holds a usable manifest -- ``unsafe``
    (one names files outside its folder), ``foreign`` (another job's checkpoint, or a link), ``corrupt``
    (it does not parse) or ``unreadable``.
    ``durable``: ``yes`` (``PATH`` holds this very save), ``pending`` (a ``durable_every`` save that
    ``PATH`` does not hold: a drain in flight or failed), ``other`` (``PATH`` holds another save of
    this tag) or ``no``. ``order`` sorts saves by sequence number (``record_order``).
    """

    tag: str
    state: str
    committed_in: tuple[str, ...]
    holds: Mapping[str, int]  #: folder -> parts it holds (files, for uncommitted or corrupt tags)
    parts_held: int
    parts_needed: int | None
    missing: tuple[str, ...] = ()
    save_id: str | None = None
    seq: int | None = None
    size: int | None = None
    saved_at: str | None = None
    layout: dict[str, Any] | None = None
    durable: str | None = None  #: ``None`` for uncommitted and corrupt tags
    order: tuple[int, int, str] = (0, 0, "")
    detail: str = ""

    def to_json(self, resume: bool) -> dict[str, Any]:
        """The ``fast`` rows of ``smpckpt ls --json`` (``resume``: the checkpoint a resume would load):
        every field but ``order``."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "order"} | {"resume": resume}


@dataclasses.dataclass(frozen=True)
class ResumePick:
    """What ``resume_from_checkpoint(PATH, local_path=...)`` would load, were the given folders its nodes'."""

    tier: str  #: "fast" or "durable"
    tag: str
    save_id: str | None


@dataclasses.dataclass(frozen=True)
class LocalCopy:
    """One tag's folder in one ``--local`` folder: where (``url``; ``fs`` and ``path`` to read it), its
    manifest's bytes (``None``: none there), every file in it (relative name -> size), and how a resume
    judges it (``state``: :data:`smpckpt.api._tier_copies.CopyState`, with ``detail``)."""

    url: str
    fs: Any
    path: str
    manifest: bytes | None
    files: Mapping[str, int]
    state: str = "committed"
    detail: str = ""

    @classmethod
    def read(cls, folder: str, tag: str, owner: str | None) -> LocalCopy:
        """``folder`` (a ``{tag}_partial``) judged as the job whose durable root is ``owner`` would."""
        copy, data = read_copy(folder, tag, owner)
        fs, path = open_root(folder)
        return cls(folder, fs, path, data, copy.files, copy.state, copy.detail)


def scan_local(folder: str, owner: str) -> dict[str, LocalCopy]:
    """Every ``{tag}_partial`` folder of the job ``owner`` in one node's fast tier ``folder``."""
    job = job_folder(folder, owner)
    if not os.path.isdir(job):
        return {}
    fs, root = open_root(job)
    return {tag: LocalCopy.read(f"{job}/{name}", tag, owner) for tag, name in list_partial_tags(fs, root).items()}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A save some folder committed, judged across the folders (as a resume judges it)."""

    tag: str
    manifest: bytes
    held_by: Mapping[str, tuple[int, ...]]  #: part -> indexes of the folders holding it
    missing: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return not self.missing

    def parsed(self) -> Manifest:
        return Manifest.from_bytes(self.manifest, where=f"fast-tier manifest of {self.tag!r}")

    @property
    def key(self) -> tuple[int, tuple[int, int, str]]:
        m = self.parsed()
        return (seq_of(m), record_order(m))


def fast_candidates(views: Sequence[Mapping[str, LocalCopy]]) -> list[Candidate]:
    """Every save of the job some folder committed, newest first (save number, then the manifest's order),
    with its completeness across the folders (as a resume judges it: :func:`smpckpt.api._tier_copies.judge`)."""
    out = []
    for tag in sorted({t for v in views for t in v}):
        for data in {v[tag].manifest for v in views if tag in v and v[tag].state == "committed"}:
            if data is None:
                continue
            holders = [i for i, v in enumerate(views) if tag in v and v[tag].manifest == data]
            files = [
                v[tag].files if tag in v and v[tag].state in ("committed", "uncommitted", "corrupt") else None
                for v in views
            ]
            manifest = Manifest.from_bytes(data)
            held, missing = judge(part_sizes(manifest), holders, files)
            out.append(Candidate(tag, data, held, missing))
    out.sort(key=lambda c: (c.key, c.tag), reverse=True)
    return out


@dataclasses.dataclass(frozen=True)
class OtherJob:
    """Another job's fast-tier checkpoints in a ``--local`` folder: left alone by this job."""

    folder: str
    root: str  #: the durable root it belongs to, as recorded
    tags: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def other_jobs(dirs: Sequence[str], owner: str) -> list[OtherJob]:
    """The other jobs' folders in ``dirs`` (and tag folders an smpckpt without job folders left directly
    in them), with the tags they hold."""
    out = []
    mine = job_dirname(owner)
    for d in dirs:
        fs, root = open_root(d)
        flat = sorted(list_partial_tags(fs, root))
        if flat:
            out.append(OtherJob(d, "none recorded (saved by an smpckpt without job folders)", tuple(flat)))
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if not name.startswith(JOB_PREFIX) or name == mine or os.path.islink(path) or not os.path.isdir(path):
                continue
            tags = tuple(sorted(list_partial_tags(*open_root(path))))
            out.append(OtherJob(path, read_job_record(path) or "unknown (no readable job record)", tags))
    return out


def fast_rows(dirs: Sequence[str], durable: Sequence[CheckpointRecord], owner: str) -> tuple[list[FastRow], list[str]]:
    """Every tag of the job ``owner`` (its durable root's key) in the folders, newest committed save first
    (then tags no folder committed, by tag), and warnings (a folder's manifest that does not parse;
    several saves of one tag)."""
    views = [scan_local(d, owner) for d in dirs]
    twins = {r.tag: r.manifest for r in durable if r.committed and r.manifest is not None}
    rows: list[FastRow] = []
    notes: list[str] = []
    valid: dict[str, set[bytes | None]] = {}
    for c in fast_candidates(views):
        valid.setdefault(c.tag, set()).add(c.manifest)
        m = c.parsed()
        parts = list(part_sizes(m))
        tier = m.extra.get(TIER_KEY)
        twin = twins.get(c.tag)
        if twin is not None:
            state = "yes" if twin.save_id == m.save_id else "other"
        else:
            state = "pending" if isinstance(tier, Mapping) and tier.get("durable") is True else "no"
        rows.append(
            FastRow(
                c.tag,
                "complete" if c.complete else "incomplete",
                tuple(dirs[i] for i in c.held_by[MANIFEST_NAME]),
                {d: sum(1 for n in parts if i in c.held_by[n]) for i, d in enumerate(dirs)},
                len(parts) - len(c.missing),
                len(parts),
                c.missing,
                m.save_id,
                seq_of(m) or None,
                m.total_bytes,
                m.extra.get("saved_at") or m.created,
                layout_json(m),
                state,
                record_order(m),
            )
        )
    for tag in sorted({t for v in views for t in v}):
        copies = [(d, v[tag]) for d, v in zip(dirs, views) if tag in v]
        bad = [c for _, c in copies if c.state in _UNUSABLE]
        # a manifest's own error names its path; a foreign or unreadable folder's does not
        notes += [
            f"{c.detail if c.state in ('corrupt', 'unsafe') else f'{c.url} is {c.state}: {c.detail}'}; that copy is not used"
            for c in bad
        ]
        if len(valid.get(tag, ())) > 1:
            notes.append(f"{tag}: the folders hold {len(valid[tag])} different committed saves of this tag")
        if tag in valid:
            continue
        files = {n for _, c in copies for n in c.files}
        state = next((s for s in _UNUSABLE if any(c.state == s for c in bad)), "uncommitted")
        detail = (
            "no folder holds a manifest (a save that did not finish, or one being written)"
            if not bad
            else "; ".join(f"{c.url}: {c.detail}" for c in bad[:3])
        )
        holds = {d: len(v[tag].files) if tag in v else 0 for d, v in zip(dirs, views)}
        rows.append(FastRow(tag, state, (), holds, len(files), None, detail=detail))
    return rows, notes


#: states of a folder a resume skips, most telling first (a tag's row shows the first any folder has)
_UNUSABLE = ("unsafe", "foreign", "corrupt", "unreadable")


def resume_pick(rows: Sequence[FastRow], root: str, storage_options: Any) -> tuple[ResumePick | None, str]:
    """The checkpoint a resume with these folders as its nodes' fast tiers would load (as
    ``resume_from_checkpoint``: the newest complete fast-tier save unless ``root``'s committed pick
    was saved strictly later), and a note when there is none."""
    best = next((r for r in rows if r.state == "complete"), None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the listing warns about 'newest' itself
            durable = resolve_target(root, None, storage_options)
    except CheckpointError as exc:
        return None, f"a resume would fail: {exc}"
    if best is not None and (durable is None or durable.order <= best.order):
        return ResumePick("fast", best.tag, best.save_id), ""
    if durable is not None:
        return ResumePick("durable", durable.tag, None), ""
    return None, "no complete checkpoint in either tier"


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and r - 1 == int(out[-1].rsplit("-", 1)[-1]):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ",".join(out) or "none"


def write_table(out: TextIO, header: tuple[str, ...], body: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell, two spaces apart (``smpckpt ls``'s tables)."""
    table = [header, *body]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    for line in table:
        out.write("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() + "\n")


def write_fast_table(
    out: TextIO, local: list[str], fast: list[FastRow], notes: list[str], pick: str | None, others: list[OtherJob]
) -> None:
    """``smpckpt ls --local``'s fast-tier section; ``pick``: the save id a resume would load (``>``)."""
    out.write(f"fast tier ({len(local)} folder(s): {', '.join(local)}), newest first:\n")
    if not fast:
        out.write("no partial checkpoints in the fast tier folders\n")
    else:
        write_table(
            out,
            ("", "TAG", "SEQ", "COMMITTED", "PARTS", "STATE", "DURABLE", "SIZE", "SAVED"),
            [
                (
                    ">" if f.save_id is not None and f.save_id == pick else "",
                    f.tag,
                    str(f.seq) if f.seq is not None else "-",
                    f"{len(f.committed_in)}/{len(local)}",
                    f"{f.parts_held}/{f.parts_needed if f.parts_needed is not None else '?'}",
                    f"missing {len(f.missing)}" if f.state == "incomplete" else f.state,
                    f.durable or "-",
                    human(f.size),
                    f.saved_at or "-",
                )
                for f in fast
            ],
        )
    for f in fast:
        if f.state in ("uncommitted", *_UNUSABLE):
            out.write(f"note: {f.tag} is {f.state}: {f.detail}\n")
    for note in notes:
        out.write(f"warning: {note}\n")
    for job in others:
        out.write(f"other job: {job.folder} (durable root {job.root}): {', '.join(job.tags) or 'no checkpoints'}\n")
