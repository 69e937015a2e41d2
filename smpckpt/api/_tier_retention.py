"""Fast-tier retention (README, "Tiered checkpoints"): ``num_kept_local`` over a node's job folder, by its first
rank, after each tiered save commits and after each drain (:func:`retain_fast`)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from smpckpt.api._drain import pending_drains
from smpckpt.api._tiers import LocalCopy, candidates, scan_job
from smpckpt.catalog.root import Ranges, open_root, partial_dirname
from smpckpt.storage.backends._fs import join
from smpckpt.storage.format.commit import remove_folder
from smpckpt.storage.format.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from smpckpt.api._fast_save import TierPlan

__all__ = ["retain_fast"]

log = logging.getLogger("smpckpt.api")
_NAMED = 3  # abandoned saves named in the warning; the rest counted


def retain_fast(tier: TierPlan, just_saved: str | None, abandoned: Ranges = ()) -> None:
    """(leaders) ``num_kept_local`` over this node's job folder, after a save (never the tag just saved) and
    after a drain (its tag no longer held), decided on ``tier``'s gathered listings (every node's) alike,
    its own save counted complete (``abandoned``: its manifest's ranges). Kept: the newest complete saves of
    the history, never counting nor removing one a newer save records as abandoned (as ``path``'s retention,
    ``catalog._abandoned``: a roll-back, a job gone on by tag past a node's old disk: hunt72b), held tags, of
    the saves due for the durable tier not yet drained only the one the next save drains again (this save
    when durable, else ``tier.retry``) and those whose drain ran when this save was planned (``tier.running``),
    unsafe and foreign folders, committed saves newer than the kept ones, and copies committed after the listings.
    Removed: older saves (a failed drain's with a warning naming it and the save drained instead), and
    uncommitted folders older than the newest commit here."""
    keep = tier.options.num_kept_local
    try:
        with tier.memory.lock:
            removed, back = _retain(
                tier, keep, {t for t in (just_saved,) if t is not None} | tier.memory.held, abandoned
            )
    except Exception as exc:  # noqa: BLE001 - retention never fails a committed save
        log.warning("fast-tier retention in %s failed (nothing else affected): %s", tier.job, exc)
        return
    if removed:
        log.info("fast tier %s: kept %s checkpoint(s); removed %s", tier.job, keep, removed)
    # said when the set grows (a roll-back, by a save, not its drain), not again at each save (rev72m L: each node's
    # first rank repeated it at every save until they were removed by hand)
    with tier.memory.lock:
        grew = {(tier.job, f"abandoned {t}") for t, _ in back} - tier.memory.warned if just_saved is not None else set()
        tier.memory.warned |= grew
    if grew:
        more = f" and {len(back) - _NAMED} more" if len(back) > _NAMED else ""
        log.warning(
            "fast tier %s: keeps %d checkpoint(s) a newer save records as abandoned (a roll-back by tag=, or saves "
            "the job went on past), %s%s, %.1f MiB on this node: retention neither counts nor removes them, so "
            "each roll-back adds to them (on /dev/shm they hold memory). Remove those no longer wanted by hand, on "
            "every node, e.g. `rm -r %s/%s_partial`",
            *(tier.job, len(back), ", ".join(repr(t) for t, _ in back[:_NAMED]), more, sum(n for _, n in back) / 2**20),
            *(tier.job, back[-1][0]),
        )


def _retain(
    tier: TierPlan, keep: int | None, protected: set[str], abandoned: Ranges
) -> tuple[list[str], list[tuple[str, int]]]:
    """The tags removed, and the abandoned saves kept here (newest first, each with its bytes on this node)."""
    this = LocalCopy("committed", digest=0, seq=tier.seq, parts={}, durable=tier.durable, abandoned=tuple(abandoned))
    tag = os.path.basename(tier.folder)[: -len("_partial")]
    views = [{**v, tag: this} for v in tier.views] or [{tag: this}]
    folder, durable_seq = tier.job, max(tier.durable_seq, tier.memory.durable or 0)
    found = candidates(views)
    if keep is None or not found:
        return [], []
    ranges: set[tuple[int, int]] = set()  # newest first, as catalog._abandoned.split_lineage: kept, uncounted
    gone: set[tuple[str, int]] = set()  # (a newer copy, complete or not: the worst a wrong inference does is keep)
    for c in found:
        if any(lo <= c.seq <= hi for lo, hi in ranges):
            gone.add((c.tag, c.digest))
        else:
            ranges.update(p for p in c.abandoned if p[1] < c.seq)
    complete = [c for c in found if c.complete and (c.tag, c.digest) not in gone]
    # of the saves whose drain did not commit, only the one the next save drains again (this save when
    # durable, else the one it drains again), those whose drain was running when this save was planned (it
    # may fail after: rev65b F1; not the newest failed one, which may be undrainable: rev65d F1) -- rank 0's
    # picks, alike on every node -- and held ones: keeping every failed drain filled the fast tier while path
    # was down (hunt64c F3)
    pending = pending_drains(views, durable_seq)
    drains = {tag if tier.durable else tier.retry.tag if tier.retry is not None else "", *tier.running}
    if tier.offline and pending:  # path down: the newest due save waits for it to drain (rev68i F1)
        drains.add(pending[0].tag)
    named = next((c for c in pending if c.tag in drains), None)  # the removal warning names the newest
    due = [c for c in pending if c.tag in drains or c.tag in protected]
    kept = {c.tag for c in complete[:keep]} | protected | {c.tag for c in due}
    oldest_kept = min((c.key for c in complete[:keep]), default=None)
    committed = {c.tag for c in found}
    removed = []
    fs, root = open_root(folder)
    mine = scan_job(folder, tier.root_key)
    newest = max(((c.key, t) for t, c in mine.items() if c.committed), default=None)
    newest_mtime = os.stat(os.path.join(folder, partial_dirname(newest[1]), MANIFEST_NAME)).st_mtime if newest else None
    back = sorted(((c.key, t, sum(c.files.values())) for t, c in mine.items() if (t, c.digest) in gone), reverse=True)
    for tag, copy in mine.items():
        if tag in kept or copy.state in ("unsafe", "foreign", "unreadable") or (tag, copy.digest) in gone:
            continue
        if tag in committed:
            if copy.digest not in {c.digest for c in found if c.tag == tag}:
                continue  # not the save the listing holds: the tag saved again since, or being written
            key = next(c.key for c in found if c.tag == tag)
            if len(complete) < keep or oldest_kept is None or key >= oldest_kept:
                continue
        elif copy.committed:
            # committed here but in no gathered listing: saved after ``views`` were gathered (a drain's
            # retention runs on its save's listing, after later saves committed) -- newer, never debris
            continue
        elif newest_mtime is None or os.stat(os.path.join(folder, partial_dirname(tag))).st_mtime >= newest_mtime:
            continue  # possibly a save still writing: only older debris goes
        # the protocol's removal: marked, manifest first (a kill half-way leaves no committed copy missing
        # parts), never through a link; an uncommitted folder only while it stays uncommitted
        path = join(root, partial_dirname(tag))
        failed = remove_folder(fs, path, path, uncommitted_only=not copy.committed)
        if failed:
            log.warning("fast tier %s: could not remove %d file(s) of %r", folder, len(failed), tag)
            continue
        removed.append(tag)
        for c in (c for c in pending if c.tag == tag):
            instead = f"{named.tag!r} (save {named.seq}){', newer,' * (named.seq > c.seq)} is" if named else "none is"
            log.warning(
                "fast tier %s: removed checkpoint %r (save %d), due for the durable tier: it never reached %s; "
                "%s %s instead",
                *(
                    folder,
                    tag,
                    c.seq,
                    tier.root_key,
                    instead,
                    "pending (path unreachable)" if tier.offline else "drained",
                ),
            )
    return removed, [(t, n) for _, t, n in back]
