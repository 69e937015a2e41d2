"""``smpckpt verify PATH/TAG --local DIR ...``: a tag's fast-tier copy checked across node folders.

Each folder's ``{tag}_partial`` usually holds a share of the save (see :mod:`smpckpt.tools._tiers`):
every file any folder holds is checked against the manifest (size, every block checksum, as
``verify_checkpoint`` checks a durable copy), the folders' manifests must agree, and every part must be
held intact by at least one folder.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from smpckpt.api._tier_copies import TIER_KEY, part_sizes, seq_of
from smpckpt.api._tiers import job_folder
from smpckpt.catalog.retention import partial_dirname, record_order
from smpckpt.errors import CheckpointError, UnsafeCheckpoint
from smpckpt.storage import Manifest
from smpckpt.storage.backends._fs import join, read_bytes_or_none
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format.manifest import MANIFEST_NAME, METADATA_NAME
from smpckpt.storage.read._verify_plan import load_problems
from smpckpt.storage.tools import check_blocks
from smpckpt.tools._common import human
from smpckpt.tools._tiers import LocalCopy, ranks_text

__all__ = ["FolderReport", "FastVerifyReport", "verify_fast", "write_fast_report"]


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

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems


def verify_fast(
    dirs: Sequence[str], owner: str, tag: str, progress: Callable[[int, int], None] | None = None
) -> FastVerifyReport | None:
    """Check ``tag``'s fast-tier copy of the job ``owner`` (its durable root's key) across ``dirs``: each
    folder's manifest parses, is this job's, and all agree; every file a folder holds that its manifest
    lists (a folder without one: the others') has the listed size and every block checksum; every part
    is held intact by some folder agreeing with the newest manifest, and -- when every node's folder is
    given -- every data file by as many folders as the save's ``replicas``; and (once, on a folder with
    that manifest) what a load checks before reading. ``None`` when no folder has the tag."""
    urls = [os.path.join(job_folder(d, owner), partial_dirname(tag)) for d in dirs]
    copies = [LocalCopy.read(url, tag, owner) if os.path.lexists(url) else None for url in urls]
    if all(c is None for c in copies):
        return None
    report = FastVerifyReport(tag, [FolderReport(d) for d in dirs])
    own = [_parse_manifest(report, rep, copy) for rep, copy in zip(report.folders, copies)]
    found = [m for m in own if m is not None]
    if not found:
        return report
    ref = report.manifest = max(found, key=record_order)
    # what vouches for each folder's files: its own manifest, else (uncommitted there) the newest one
    checks: list[tuple[int, LocalCopy, Manifest, dict[str, int]]] = []
    for i, (rep, copy, m) in enumerate(zip(report.folders, copies, own)):
        if copy is None or copy.state in ("foreign", "unreadable") or (copy.manifest is not None and m is None):
            continue  # absent, another job's, or its manifest is unusable: nothing vouches for its files
        if m is not None and m != ref:
            rep.state = "other save"
            rep.problems += 1
            report.problems.append(
                f"{rep.folder}: its manifest of {tag!r} (save {m.save_id}) differs from the newest one the folders "
                f"hold (save {ref.save_id})"
            )
        checks.append((i, copy, m or ref, part_sizes(m or ref)))
    total = sum(size for _, c, _, sizes in checks for n, size in c.files.items() if size == sizes.get(n))
    good: dict[str, set[int]] = {}
    for i, copy, m, sizes in checks:
        rep = report.folders[i]
        held = _check_folder(report, rep, copy, m, sizes, total, progress)
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
        first = next(c for c, m in zip(copies, own) if c is not None and m == ref)
        report.problems += load_problems(first.url, first.fs, first.path, ref, None)
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


def _parse_manifest(report: FastVerifyReport, rep: FolderReport, copy: LocalCopy | None) -> Manifest | None:
    """One folder's manifest (``None``: absent, or unusable -- then a problem), its state set."""
    if copy is None:
        return None
    rep.state = "uncommitted" if copy.manifest is None else "committed"
    if copy.state in ("foreign", "unreadable") or copy.manifest is None:
        if copy.state != "uncommitted":
            rep.state, rep.problems = copy.state, 1
            report.problems.append(f"{copy.url}: {copy.state}: {copy.detail}")
        return None
    try:
        return Manifest.from_bytes(copy.manifest, where=f"{copy.url}/{MANIFEST_NAME}")
    except CheckpointError as exc:
        rep.state, rep.problems = ("unsafe manifest" if isinstance(exc, UnsafeCheckpoint) else "corrupt manifest"), 1
        report.problems.append(str(exc))
        return None


def _check_folder(
    report: FastVerifyReport,
    rep: FolderReport,
    copy: LocalCopy,
    m: Manifest,
    sizes: Mapping[str, int],
    total: int,
    progress: Callable[[int, int], None] | None,
) -> set[str]:
    """Check every file of one folder against ``m`` (``sizes``: its parts'); the parts it holds intact."""
    url, fs, path, files = copy.url, copy.fs, copy.path, copy.files
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
            if stock is not None and (len(stock) != m.metadata.size or hash_bytes(stock) != m.metadata.digest):
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
            data = read_bytes_or_none(fs, join(path, name)) or b""
            ok = hash_bytes(data) == m.metadata.digest
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
    for warning in fast.warnings:
        err.write(f"warning: {warning}\n")
    if fast.ok:
        out.write(
            f"OK fast tier {fast.tag}: complete; {fast.files_checked} file copies, {human(fast.bytes_checked)} "
            "(checksums verified)\n"
        )
        return 0
    err.write(f"FAILED fast tier {fast.tag}: {len(fast.problems)} problem(s)\n")
    for problem in fast.problems:
        err.write(f"  {problem}\n")
    return 1
