"""``smpckpt ls`` / ``smpckpt verify`` with ``--local DIR ...``: the fast tier's node folders of ``PATH``'s
job, judged across every folder given, with what a resume uses (``smpckpt.api._tiers.candidates``), in one
process (what each reports: the README's "CLI"). A *part* is a data file the manifest lists or the
generation's metadata. Also what every command shares: ``PATH/TAG``, sizes, layouts."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from smpckpt.api._fast_resume import usable_saves
from smpckpt.api._resume import resolve_target
from smpckpt.api._tiers import (
    JOB_PREFIX,
    TIER_KEY,
    FastCandidate,
    LocalCopy,
    candidates,
    job_dirname,
    job_folder,
    part_sizes,
    read_copy,
    read_job_record,
    scan_job,
    seq_of,
)
from smpckpt.catalog.root import (
    PARTIAL_SUFFIX,
    CheckpointRecord,
    list_partial_tags,
    open_root,
    partial_dirname,
    record_order,
    validate_tag,
)
from smpckpt.errors import CheckpointError, UnsafeCheckpoint
from smpckpt.model.layout import LayoutRecord
from smpckpt.storage import Manifest, checkpoint_state
from smpckpt.storage.backends._fs import join, read_bytes_or_none
from smpckpt.storage.format.manifest import MANIFEST_NAME, METADATA_NAME
from smpckpt.storage.tools import check_blocks, load_problems

__all__ = ["UsageError", "AmbiguousCheckpoint", "human", "layout_json", "resolve_checkpoint_url"]
__all__ += ["check_local_dirs", "split_tag_spec", "ranks_text", "write_table"]
__all__ += ["FastRow", "ResumePick", "OtherJob", "fast_rows", "other_jobs", "resume_pick", "write_fast_table"]
__all__ += ["FolderReport", "FastVerifyReport", "verify_fast", "write_fast_report", "write_verdict"]


class UsageError(Exception):
    pass


def human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def layout_json(manifest: Any) -> dict[str, Any] | None:
    try:
        record = LayoutRecord.from_manifest(manifest)
    except CheckpointError:
        return None
    return record.layout.to_dict() if record is not None else None


class AmbiguousCheckpoint(UsageError, ValueError):
    """``PATH/TAG`` where both the partial and the full checkpoint of ``TAG`` exist (exit 2 on the command line)."""


def resolve_checkpoint_url(spec: str, storage_options: Mapping[str, Any]) -> str:
    """``PATH/TAG`` -> ``PATH/TAG_partial`` when that exists; else ``spec`` itself (a checkpoint folder). A tag's
    partial and full checkpoints may both exist (smp's layout, side by side) holding other weights: then
    ``PATH/TAG`` is refused, naming both, and ``PATH/TAG/`` (as a shell completes a folder) names the full one;
    a full folder neither committed nor legacy (a save that did not finish, a plain HF folder) leaves the partial."""
    folder = spec.endswith("/")
    spec = spec.rstrip("/") or spec
    if spec.endswith(PARTIAL_SUFFIX):
        return spec
    candidate = spec + PARTIAL_SUFFIX
    if checkpoint_state(candidate, storage_options) == "missing":
        return spec
    full = checkpoint_state(spec, storage_options)
    if folder and full != "missing":  # named as a folder: that one, whatever its state (verify reports it)
        return spec
    if full not in ("committed", "legacy"):  # none, or a save that did not finish (a plain HF folder alike)
        return candidate
    raise AmbiguousCheckpoint(
        f"{spec} names two checkpoints: {candidate} (partial) and {spec} (full), which may hold different "
        f"weights: name {candidate} for the partial one or {spec}/ (as a str ending in '/') for the full one"
    )


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


# -- ls --local --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FastRow:
    """One committed save of a tag in the fast tier (or a tag no folder committed), across the folders.

    ``state``: ``complete`` (every part held by some folder at the manifest's size), ``incomplete``,
    ``uncommitted`` (no folder holds a manifest), or -- no folder holds a usable manifest -- ``unsafe``
    (one names files outside its folder), ``foreign`` (another job's checkpoint, or a link), ``corrupt``
    (it does not parse) or ``unreadable``.
    ``durable``: ``yes`` (``PATH`` holds this very save), ``pending`` (a ``durable_every`` save that
    ``PATH`` does not hold: a drain in flight or failed), ``other`` (``PATH`` holds another save of
    this tag) or ``no``.
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
    detail: str = ""

    def to_json(self, resume: bool) -> dict[str, Any]:
        """The ``fast`` rows of ``smpckpt ls --json`` (``resume``: the checkpoint a resume would load)."""
        return dataclasses.asdict(self) | {"resume": resume}


@dataclasses.dataclass(frozen=True)
class ResumePick:
    """What ``resume_from_checkpoint(PATH, local_path=...)`` would load, were the given folders its nodes'."""

    tier: str  #: "fast" or "durable"
    tag: str
    save_id: str | None


@dataclasses.dataclass(frozen=True)
class OtherJob:
    """Another job's fast-tier checkpoints in a ``--local`` folder: left alone by this job."""

    folder: str
    root: str  #: the durable root it belongs to, as recorded
    tags: tuple[str, ...]


def other_jobs(dirs: Sequence[str], owner: str) -> list[OtherJob]:
    """The other jobs' folders in ``dirs`` (and tag folders an smpckpt without job folders left directly
    in them), with the tags they hold."""
    out = []
    mine = job_dirname(owner)
    for d in dirs:
        flat = sorted(list_partial_tags(*open_root(d)))
        if flat:
            out.append(OtherJob(d, "none recorded (saved by an smpckpt without job folders)", tuple(flat)))
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if not name.startswith(JOB_PREFIX) or name == mine or os.path.islink(path) or not os.path.isdir(path):
                continue
            tags = tuple(sorted(list_partial_tags(*open_root(path))))
            out.append(OtherJob(path, read_job_record(path) or "unknown (no readable job record)", tags))
    return out


def fast_rows(
    dirs: Sequence[str], durable: Sequence[CheckpointRecord], owner: str
) -> tuple[list[FastRow], list[str], list[FastCandidate]]:
    """Every tag of the job ``owner`` (its durable root's key) in the folders, newest committed save first
    (then tags no folder committed, by tag), warnings (a folder's manifest that does not parse; several
    saves of one tag), and the saves as a resume sees them over these folders (for :func:`resume_pick`)."""
    manifests: dict[int, bytes] = {}  # kept from the scan: a live job's retention may remove a tag since
    views = [scan_job(job_folder(d, owner), owner, manifests) for d in dirs]
    twins = {r.tag: r.manifest for r in durable if r.committed and r.manifest is not None}
    rows: list[FastRow] = []
    notes: list[str] = []
    valid: dict[str, set[int]] = {}
    found = candidates(views)
    for c in found:  # judged as a resume judges them, over the folders instead of the nodes
        valid.setdefault(c.tag, set()).add(c.digest)
        m = Manifest.from_bytes(manifests[c.digest], where=f"fast-tier manifest of {c.tag!r}")
        parts = list(part_sizes(m))
        twin = twins.get(c.tag)
        if twin is not None:
            state = "yes" if twin.save_id == m.save_id else "other"
        else:
            state = "pending" if c.durable else "no"
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
                c.seq or None,
                m.total_bytes,
                m.extra.get("saved_at") or m.created,
                layout_json(m),
                state,
            )
        )
    for tag in sorted({t for v in views for t in v}):
        copies = [(f"{job_folder(d, owner)}/{partial_dirname(tag)}", v[tag]) for d, v in zip(dirs, views) if tag in v]
        bad = [(url, c) for url, c in copies if c.state in _UNUSABLE]
        # a manifest's own error names its path; a foreign or unreadable folder's does not
        notes += [
            f"{c.detail if c.state in ('corrupt', 'unsafe') else f'{url} is {c.state}: {c.detail}'}; that copy is not used"
            for url, c in bad
        ]
        if len(valid.get(tag, ())) > 1:
            notes.append(f"{tag}: the folders hold {len(valid[tag])} different committed saves of this tag")
        if tag in valid:
            continue
        files = {n for _, c in copies for n in c.files}
        state = next((s for s in _UNUSABLE if any(c.state == s for _, c in bad)), "uncommitted")
        detail = (
            "no folder holds a manifest (a save that did not finish, or one being written)"
            if not bad
            else "; ".join(f"{url}: {c.detail}" for url, c in bad[:3])
        )
        holds = {d: len(v[tag].files) if tag in v else 0 for d, v in zip(dirs, views)}
        rows.append(FastRow(tag, state, (), holds, len(files), None, detail=detail))
    return rows, notes, found


#: states of a folder a resume skips, most telling first (a tag's row shows the first any folder has)
_UNUSABLE = ("unsafe", "foreign", "corrupt", "unreadable")


def resume_pick(root: str, storage_options: Any, found: list[FastCandidate]) -> tuple[ResumePick | None, str]:
    """The checkpoint a resume (``tag=None``) with these folders as its nodes' fast tiers would load, judged
    as it judges (:func:`~smpckpt.api._fast_resume.usable_saves` over :func:`fast_rows`' ``found``), and why
    there is none when a resume would fail."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the listing warns about 'newest' itself
            durable = resolve_target(root, None, storage_options)
        usable = usable_saves(found, durable, None)
    except CheckpointError as exc:
        return None, f"a resume would fail: {exc}"
    if usable:
        return ResumePick("fast", usable[0].tag, usable[0].order[2]), ""  # record_order's last: the save id
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


# -- verify --local ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class FolderReport:
    """What one ``--local`` folder holds of the tag. ``state``: ``absent``, ``uncommitted`` (files, no
    manifest), ``committed``, ``other save`` (a manifest of another save) or ``corrupt manifest``."""

    folder: str
    state: str = "absent"
    data_files: int = 0  #: data files of the checked save held whole and intact
    ranks: tuple[int, ...] = ()  #: ranks all of whose data files it holds intact
    metadata: bool = False  #: holds the generation's metadata intact
    problems: int = 0


@dataclasses.dataclass
class FastVerifyReport:
    tag: str
    folders: list[FolderReport]
    manifest: Manifest | None = None  #: the save checked (newest of the folders' manifests)
    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)  #: parts no folder holds intact
    files_checked: int = 0
    bytes_checked: int = 0


def verify_fast(
    dirs: Sequence[str], owner: str, tag: str, progress: Callable[[int, int], None] | None = None
) -> FastVerifyReport | None:
    """Check ``tag``'s fast-tier copy of the job ``owner`` (its durable root's key) across ``dirs``, as the
    README's "CLI" says of ``verify --local`` (a folder without a manifest is checked against the others');
    ``None`` when no folder has the tag."""
    urls = [os.path.join(job_folder(d, owner), partial_dirname(tag)) for d in dirs]
    copies = [read_copy(url, tag, owner) if os.path.lexists(url) else None for url in urls]
    if all(c is None for c in copies):
        return None
    report = FastVerifyReport(tag, [FolderReport(d) for d in dirs])
    own = [_parse_manifest(report, rep, url, copy) for rep, url, copy in zip(report.folders, urls, copies)]
    found = [m for m in own if m is not None]
    if not found:
        return report
    ref = report.manifest = max(found, key=record_order)
    # what vouches for each folder's files: its own manifest, else (uncommitted there) the newest one
    checks: list[tuple[int, str, Mapping[str, int], Manifest, dict[str, int]]] = []
    for i, (rep, url, copy, m) in enumerate(zip(report.folders, urls, copies, own)):
        if copy is None or copy[0].state in ("foreign", "unreadable") or (copy[1] is not None and m is None):
            continue  # absent, another job's, or its manifest is unusable: nothing vouches for its files
        if m is not None and m != ref:
            rep.state = "other save"
            rep.problems += 1
            report.problems.append(
                f"{rep.folder}: its manifest of {tag!r} (save {m.save_id}) differs from the newest one the folders "
                f"hold (save {ref.save_id})"
            )
        checks.append((i, url, copy[0].files, m or ref, part_sizes(m or ref)))
    total = sum(size for _, _, files, _, sizes in checks for n, size in files.items() if size == sizes.get(n))
    good: dict[str, set[int]] = {}
    for i, url, files, m, sizes in checks:
        rep = report.folders[i]
        held = _check_folder(report, rep, url, files, m, sizes, total, progress)
        if rep.state != "other save":
            for n in held:
                good.setdefault(n, set()).add(i)
    report.missing = [n for n in part_sizes(ref) if n not in good]
    rank_of = {f.name: f.rank for f in ref.files}
    for n in report.missing:
        whose = f"rank {rank_of[n]}'s data file" if n in rank_of else "the save's metadata"
        report.problems.append(f"{tag}: no folder holds {n} ({whose}) intact: the fast-tier copy is incomplete")
    _check_replicas(report, ref, good, len(dirs))
    if not report.problems:
        first = next(url for url, m in zip(urls, own) if m == ref)
        report.problems += load_problems(first, *open_root(first), ref, None)
    return report


def _check_replicas(report: FastVerifyReport, ref: Manifest, good: Mapping[str, set[int]], folders: int) -> None:
    """Every data file held intact by ``replicas`` folders, when every node's folder was given (the ring
    puts each copy on another node); with fewer folders, a warning that this was not checked."""
    tier = ref.extra.get(TIER_KEY)
    replicas, nodes = (tier.get("replicas"), tier.get("nodes")) if isinstance(tier, Mapping) else (None, None)
    if not isinstance(replicas, int) or not isinstance(nodes, int) or replicas < 2:
        return
    if folders < nodes:
        report.warnings.append(
            f"{report.tag}: saved on {nodes} nodes with replicas={replicas}; only {folders} folder(s) given, so "
            "the replica count was not checked"
        )
        return
    for f in ref.files:
        held = len(good.get(f.name, ()))
        if 0 < held < replicas:
            report.problems.append(
                f"{report.tag}: {f.name} (rank {f.rank}'s data file) is held intact by {held} of the {replicas} "
                f"folders replicas={replicas} puts it in: a replica is missing"
            )


def _parse_manifest(
    report: FastVerifyReport, rep: FolderReport, url: str, read: tuple[LocalCopy, bytes | None] | None
) -> Manifest | None:
    """One folder's manifest (``read``: :func:`read_copy`'s judgement and bytes; ``None``: absent, or
    unusable -- then a problem), its state set."""
    if read is None:
        return None
    copy, data = read
    rep.state = "uncommitted" if data is None else "committed"
    if copy.state in ("foreign", "unreadable") or data is None:
        if copy.state != "uncommitted":
            rep.state, rep.problems = copy.state, 1
            report.problems.append(f"{url}: {copy.state}: {copy.detail}")
        return None
    try:
        return Manifest.from_bytes(data, where=f"{url}/{MANIFEST_NAME}")
    except CheckpointError as exc:
        rep.state, rep.problems = ("unsafe manifest" if isinstance(exc, UnsafeCheckpoint) else "corrupt manifest"), 1
        report.problems.append(str(exc))
        return None


def _check_folder(
    report: FastVerifyReport,
    rep: FolderReport,
    url: str,
    files: Mapping[str, int],
    m: Manifest,
    sizes: Mapping[str, int],
    total: int,
    progress: Callable[[int, int], None] | None,
) -> set[str]:
    """Check every file of one folder against ``m`` (``sizes``: its parts'); the parts it holds intact."""
    fs, path = open_root(url)
    records = {f.name: f for f in m.files}
    held: set[str] = set()
    before = len(report.problems)

    def tick(n: int) -> None:
        report.bytes_checked += n
        if progress:
            progress(report.bytes_checked, total)

    for name, size in sorted(files.items()):
        where = f"{url}/{name}"
        listed = sizes.get(name)
        if name == MANIFEST_NAME:
            continue
        if name == METADATA_NAME:
            stock = read_bytes_or_none(fs, join(path, name))
            if stock is not None and not m.metadata.matches(stock):
                report.warnings.append(f"{where}: differs from the committed {m.metadata.name} (stock DCP readers)")
            continue
        if listed is None:
            report.warnings.append(f"{where}: not listed in the manifest (ignored)")
            continue
        report.files_checked += 1
        if size != listed:
            report.problems.append(f"{where}: size {size}, manifest says {listed}")
            continue
        if name == m.metadata.name:
            ok = m.metadata.matches(read_bytes_or_none(fs, join(path, name)) or b"")
            if not ok:
                report.problems.append(f"{where}: checksum differs from the manifest")
            tick(size)
        else:
            ok = check_blocks(fs, join(path, name), records[name], where, report.problems, tick)
        if ok:
            held.add(name)
    rep.problems += len(report.problems) - before
    rep.data_files = len(held & set(records))
    rep.metadata = m.metadata.name in held
    by_rank: dict[int, set[str]] = {}
    for f in m.files:
        by_rank.setdefault(f.rank, set()).add(f.name)
    rep.ranks = tuple(r for r, names in sorted(by_rank.items()) if names <= held)
    return held


def write_fast_report(fast: FastVerifyReport, out: TextIO, err: TextIO) -> int:
    """``smpckpt verify --local``'s fast-tier part: a line per folder (stdout), warnings and problems
    (stderr); the exit status (0: complete and intact)."""
    m = fast.manifest
    about = f" (save {m.save_id}, seq {seq_of(m) or '-'})" if m is not None else ""
    out.write(f"fast tier: {fast.tag}{about} in {len(fast.folders)} folder(s):\n")
    for rep in fast.folders:
        text = f"  {rep.folder}: {rep.state}"
        if rep.state in ("committed", "uncommitted") and m is not None:
            ranks = f"rank{'s' if len(rep.ranks) > 1 else ''} {ranks_text(rep.ranks)}"
            text += f"; {rep.data_files}/{len(m.files)} data files" + (f" (all of {ranks})" if rep.ranks else "")
            text += ", metadata" if rep.metadata else ", no metadata"
        out.write(text + (f"; {rep.problems} problem(s)" if rep.problems else "") + "\n")
    ok = f"complete; {fast.files_checked} file copies, {human(fast.bytes_checked)} (checksums verified)"
    return write_verdict(out, err, f"fast tier {fast.tag}", ok if m is not None else None, fast.problems, fast.warnings)


def write_verdict(
    out: TextIO, err: TextIO, what: str, ok: str | None, problems: Sequence[str], warnings: Sequence[str]
) -> int:
    """``smpckpt verify``'s verdict on ``what``: warnings, then ``OK`` with ``ok`` (stdout) when there are
    no problems (and ``ok`` is given), else ``FAILED`` and every problem (stderr); the exit status."""
    err.writelines(f"warning: {warning}\n" for warning in warnings)
    if ok is not None and not problems:
        out.write(f"OK {what}: {ok}\n")
        return 0
    err.write(f"FAILED {what}: {len(problems)} problem(s)\n")
    err.writelines(f"  {problem}\n" for problem in problems)
    return 1
