"""``smpckpt ls`` / ``smpckpt verify`` with ``--local DIR ...``: the fast tier of tiered checkpoints
(``save_checkpoint(..., local_path=...)``) as the given node folders hold it.

One node's ``{tag}_partial`` folder usually holds only its share -- its ranks' files plus replicas of
other nodes' -- so a tag is judged across every folder given: committed in how many (a node writes the
manifest only after every node held its share), which parts the union holds at the manifest's sizes
(``smpckpt.api._tiers.assess``: what a resume uses), and, for ``verify``, every file any
folder holds checked against the manifest, block by block. A *part* is a data file the manifest lists
or the generation's metadata (``.metadata.<save id>``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from smpckpt.api._resume import resolve_target
from smpckpt.api._tiers import TIER_KEY, FastCandidate, assess, part_sizes, seq_of
from smpckpt.catalog.listing import CheckpointRecord
from smpckpt.catalog.tags import PARTIAL_SUFFIX, list_partial_tags, open_root, validate_tag
from smpckpt.errors import CheckpointCorrupt, CheckpointError
from smpckpt.storage import Manifest
from smpckpt.storage.backends._fs import file_sizes, join, read_bytes_or_none
from smpckpt.storage.format._names import MANIFEST_NAME
from smpckpt.tools._common import UsageError, human, layout_json

__all__ = [
    "FastRow",
    "ResumePick",
    "check_local_dirs",
    "split_tag_spec",
    "fast_rows",
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
    ``uncommitted`` (no folder holds a manifest) or ``corrupt`` (no manifest a folder holds parses).
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
    manifest's bytes (``None``: not committed there) and every file in it (relative name -> size)."""

    url: str
    fs: Any
    path: str
    manifest: bytes | None
    files: Mapping[str, int]

    @classmethod
    def read(cls, fs: Any, path: str, url: str) -> LocalCopy:
        return cls(url, fs, path, read_bytes_or_none(fs, join(path, MANIFEST_NAME)), file_sizes(fs, path))


def scan_local(folder: str) -> dict[str, LocalCopy]:
    """Every ``{tag}_partial`` folder of one node's fast tier, with its manifest."""
    fs, root = open_root(folder)
    return {
        tag: LocalCopy.read(fs, join(root, name), f"{folder}/{name}")
        for tag, name in list_partial_tags(fs, root).items()
    }


def fast_candidates(views: Sequence[Mapping[str, LocalCopy]]) -> list[FastCandidate]:
    """Every save some folder committed, newest first, with its completeness across the folders (as a
    resume judges it: :func:`smpckpt.api._tiers.assess`). Manifests that do not parse are left out."""
    out = []
    for tag in sorted({t for v in views for t in v}):
        for data in {v[tag].manifest for v in views if tag in v and v[tag].manifest is not None}:
            if data is None:
                continue
            holders = [i for i, v in enumerate(views) if tag in v and v[tag].manifest == data]
            try:
                out.append(assess(tag, data, holders, [v[tag].files if tag in v else None for v in views]))
            except CheckpointCorrupt:
                continue
    out.sort(key=lambda c: (c.order, c.tag), reverse=True)
    return out


def fast_rows(dirs: Sequence[str], durable: Sequence[CheckpointRecord]) -> tuple[list[FastRow], list[str]]:
    """Every tag in the folders, newest committed save first (then uncommitted and corrupt tags, by
    tag), and warnings (a folder's manifest that does not parse; several saves of one tag)."""
    views = [scan_local(d) for d in dirs]
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
                c.order,
            )
        )
    for tag in sorted({t for v in views for t in v}):
        copies = [(d, v[tag]) for d, v in zip(dirs, views) if tag in v]
        bad = [
            _manifest_problem(c)
            for _, c in copies
            if c.manifest is not None and c.manifest not in valid.get(tag, set())
        ]
        notes += [f"{problem}; that copy is not used" for problem in bad]
        if len(valid.get(tag, ())) > 1:
            notes.append(f"{tag}: the folders hold {len(valid[tag])} different committed saves of this tag")
        if tag in valid:
            continue
        files = {n for _, c in copies for n in c.files}
        detail = (
            "no folder holds a manifest (a save that did not finish, or one being written)"
            if not bad
            else f"no manifest a folder holds can be read ({len(bad)} damaged)"
        )
        holds = {d: len(v[tag].files) if tag in v else 0 for d, v in zip(dirs, views)}
        rows.append(FastRow(tag, "corrupt" if bad else "uncommitted", (), holds, len(files), None, detail=detail))
    return rows, notes


def _manifest_problem(copy: LocalCopy) -> str:
    where = f"{copy.url}/{MANIFEST_NAME}"
    try:
        Manifest.from_bytes(copy.manifest or b"", where=where)
    except CheckpointCorrupt as exc:
        return str(exc)
    return f"{where}: not used"  # pragma: no cover - fast_candidates uses every manifest that parses


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


def write_fast_table(out: TextIO, local: list[str], fast: list[FastRow], notes: list[str], pick: str | None) -> None:
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
        if f.state in ("uncommitted", "corrupt"):
            out.write(f"note: {f.tag} is {f.state}: {f.detail}\n")
    for note in notes:
        out.write(f"warning: {note}\n")
