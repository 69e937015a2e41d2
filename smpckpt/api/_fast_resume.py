"""A tiered resume (``FastTier``): the newest checkpoint complete across the surviving fast tiers or
committed in ``path``, whichever is newer; a fast-tier copy that cannot be loaded gives way to the next,
then to ``path``'s (README, "Tiered checkpoints").

:func:`choose_tier` (all: listings gathered, complete fast-tier saves newest first; rank 0 finds
``path``'s newest, broadcast; ``tag=None`` refuses diverged histories,
:func:`~smpckpt.api._drain.same_history`, and another job's checkpoint it would load, :func:`_refusals`) ->
:func:`load_tiered` (all, for each newer fast-tier save: its manifest and metadata broadcast and written by
the leaders that lack them, dcp.load with a :class:`PeerFetchingReader` fetching from peers the parts a node lacks; on failure
the leaders check their copies (``repair``) and the load is tried once more from a good peer), then
``path``'s checkpoint; a warning names each copy that could not be loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from smpckpt.api._dist import DistContext
from smpckpt.api._drain import (
    is_drained,
    note_seen,
    path_down,
    read_drained,
    refuse_emptied,
    same_history,
)
from smpckpt.api._resume import (
    ResumeRequest,
    Target,
    load_checkpoint,
    resolve_target,
    resume_state,
)
from smpckpt.api._tiers import (
    LINEAGE,
    PATH_MARK,
    RUNS,
    SKIPPED,
    FastCandidate,
    LocalCopy,
    Nodes,
    TierState,
    apart,
    candidates,
    durable_key,
    ends_of,
    fetch_copy,
    gather_views,
    read_copy,
    runs_of,
    tier_seq,
)
from smpckpt.catalog.root import newest_record, partial_dirname
from smpckpt.errors import (
    LOADED_IN_PLACE,
    CheckpointError,
    CheckpointNotFound,
    LayoutMismatch,
    NodeFull,
    RootInUse,
    SpecError,
    UnsafeCheckpoint,
    loaded_in_place,
)
from smpckpt.planners import ParallelLoadPlanner
from smpckpt.storage import Manifest
from smpckpt.storage.backends._folder import Folder
from smpckpt.storage.backends._fs import open_fs, read_bytes_or_none
from smpckpt.storage.format.manifest import MANIFEST_NAME
from smpckpt.storage.tier import PeerFetchingReader, PreparedCommit
from smpckpt.storage.tier.reader import disk_full
from smpckpt.storage.tools import check_blocks

if TYPE_CHECKING:
    from smpckpt.api._fast_save import FastTierPart

__all__ = ["TierChoice", "Loaded", "choose_tier", "load_tiered", "refuse_forked", "usable_saves"]

log = logging.getLogger("smpckpt.api")


@dataclasses.dataclass(frozen=True)
class TierChoice:
    """What a tiered resume may load, alike on every rank: the newer fast-tier saves, then ``path``'s."""

    nodes: Nodes
    job: str  #: this job's folder on this node
    streams: tuple[Any, ...]  #: this process's gloo groups for the transfers (the first: agreements)
    fast: tuple[FastCandidate, ...]
    durable: Target | None
    #: (tag=None) why the two-jobs check refuses each of ``fast``, then ``durable`` ("": taken; rank 0's counter)
    refused: tuple[str, ...] = ()

    @property
    def group(self) -> Any:
        return self.streams[0] if self.streams else None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A finished load: its target, planner and state, and the fast tier's reader (``None``: ``path``'s)."""

    target: Target
    planner: ParallelLoadPlanner
    state: dict[str, Any]
    rng: bool | None  #: resume_state's (None: the DTensor placements changed)
    reader: PeerFetchingReader | None


def choose_tier(req: ResumeRequest, ctx: DistContext, part: FastTierPart) -> TierChoice:
    """(all ranks) The candidates, newest first (module docstring)."""
    streams = part.groups.streams(ctx)
    local = part.options.local_path
    nodes, job, views, records = gather_views(
        ctx, req.process_group, 1, local, req.root, req.storage_options, part.state.warned, read_drained
    )
    found = candidates(views, req.tag)
    complete = [c for c in found if c.complete]
    if ctx.is_coordinator:
        newest = complete[0].key if complete else None
        for c in found:
            if not c.complete and (newest is None or c.key > newest):
                log.warning(
                    "fast tier: checkpoint %r is committed but incomplete across the surviving nodes (missing %s); "
                    "not used",
                    c.tag,
                    ", ".join(c.missing[:5]),
                )

    def durable_target() -> Target | None:
        try:
            target = resolve_target(req.root, req.tag, req.storage_options, warn=False)  # said if it loads
        except CheckpointNotFound:
            if not complete or req.tag is None:
                raise
            return None  # the tag asked for is uncommitted in path (a drain that did not finish)
        except OSError as exc:  # path's outage (tiers68 F3): the fast tier's copy only when asked for by tag
            if not path_down(exc) or not complete:
                raise
            if req.tag is None:  # path may hold a newer checkpoint than the fast tier's: not guessed
                raise CheckpointError(
                    f"path {req.root} is unreachable ({exc}): it may hold a checkpoint newer than the fast tier's "
                    f"newest complete one, {complete[0].tag!r}; pass tag={complete[0].tag!r} to resume it from the "
                    "fast tier"
                ) from exc
            _warn_on(ctx, f"path {req.root} is unreachable ({exc}): resuming {req.tag!r} from the fast tier", 7)
            return None
        if req.tag is None and complete and (target is None or complete[0].order >= target.order):
            drained = (target.tag, target.order[2]) if target is not None else None
            # every node's record of its drains, alike on every rank (node 0's alone was stale: hunt72b)
            refuse_emptied(req.root, req.storage_options, job, drained, complete[0].tag, records)
        return target

    def newest_damaged() -> bool:  # as the Checkpointer's refusal of path's damaged newest tells it
        rec = newest_record(req.root, req.storage_options)
        return rec is not None and rec.state not in ("committed", "missing", "removing", "legacy")

    def decided() -> tuple[Target | None, tuple[str, ...]]:
        target = durable_target()
        return target, _refusals(req, part, found, target)

    durable, refused = ctx.on_coordinator(decided)
    _refuse(refused, 0)  # the first choice: before anything is noted (seen_by) or read, as a plain resume's
    # tag=None with path's newest damaged: the Checkpointer refuses that by name (CheckpointCorrupt), not
    # "not found" here, which a caller may take for a fresh start over a checkpoint that is there (rev68a F1)
    damaged = durable is None and req.tag is None and bool(found) and ctx.on_coordinator(newest_damaged)
    if durable is None and found and not complete and not req.opts.missing_ok and not damaged:
        # (every rank alike: the listing is gathered, ``durable`` broadcast) say why the fast tier's copy is
        # no answer, rather than "no checkpoint" as if the tag had never been saved (tag=None: hunt67 note)
        what = f"checkpoint {req.tag!r}" if req.tag is not None else "committed checkpoint"
        copy = "copy of it" if req.tag is not None else f"newest copy, {found[0].tag!r},"
        raise CheckpointNotFound(
            f"no {what} under {req.root}: the fast tier's {copy} is committed but incomplete "
            f"across the surviving nodes (no node holds {', '.join(found[0].missing[:3])})"
        )
    if durable is not None:  # this job's next saves are numbered after what choosing it saw (catalog.root)
        durable.seen_by(part.counter)
        part.state.saw_path(durable.order[0])
    # whichever is later in the root's order (sequence number, then save time: a drained copy is the fast
    # copy's manifest, so it ties and the fast copy is taken), for tag=... too: a tag saved again in `path`
    # (overwrite=True by a job without this fast tier) leaves an older save of that tag in the fast tier
    return TierChoice(nodes, job, streams, tuple(usable_saves(found, durable, req.tag)), durable, refused)


def _refusals(
    req: ResumeRequest, part: FastTierPart, found: list[FastCandidate], durable: Target | None
) -> tuple[str, ...]:
    """(rank 0) A tag-less resume's two-jobs check (``SequenceCounter.resuming``, as a plain Checkpointer's) of
    each checkpoint it may load, in order: :func:`usable_saves`, then ``durable``; another job's checkpoint this
    job never saw, in ``path`` or in a fast-tier folder two jobs share, is refused, not loaded (rev69k)."""
    if req.tag is not None:
        return ()
    try:
        usable = usable_saves(found, durable, None)
    except CheckpointError:  # ambiguous histories: every rank raises it alike after the broadcast
        return ()
    said = []
    for c in (*usable, *([durable] if durable is not None else [])):
        try:
            part.counter.resuming(c, None)
            said.append("")
        except RootInUse as exc:
            said.append(str(exc))
    return tuple(said)


def _refuse(refused: tuple[str, ...], i: int) -> None:
    """(every rank alike) Refuse the ``i``-th checkpoint a resume may load (``TierChoice.fast``, then ``path``'s)
    when the two-jobs check did (:func:`_refusals`); a fallback reaching another job's checkpoint too."""
    if i < len(refused) and refused[i]:
        raise RootInUse(refused[i])


def usable_saves(found: list[FastCandidate], durable: Target | None, tag: str | None) -> list[FastCandidate]:
    """(every rank alike; ``smpckpt ls --local`` too) The complete fast-tier saves a resume may load, newest
    first: none older than ``durable``, none of another history (:func:`refuse_forked`), none a roll-back
    abandoned (``durable``'s ranges, the root's copy's among them, and a newer usable save's: rev60c F2);
    ``tag=None``: none of a history that diverged from ``path``'s (:func:`~smpckpt.api._drain.same_history`)."""
    usable, ranges = [], set(durable.abandoned if durable is not None and tag is None else ())
    partial: list[FastCandidate] = []  # incomplete copies: their roll-backs count within their own history only
    for c in found:  # newest first
        if durable is None or durable.order <= c.order:
            hit = any(lo <= c.seq <= hi for lo, hi in ranges) or any(
                lo <= c.seq <= hi and not apart(x, c) for x in partial for lo, hi in x.abandoned if hi < x.seq
            )
            if not hit or tag is not None:
                if c.complete:
                    usable.append(c)
                    ranges.update(p for p in c.abandoned if p[1] < c.seq)
                else:  # a committed save whose copy lost a file still records its roll-back: without it a save
                    # that roll-back discarded was loaded (rev70a L); not another history's (an old disk: rev70f)
                    partial.append(c)
    if durable is not None and tag is None:  # and the saves due for path at its newest's number, older by time
        n = durable.order[0]
        ties = [c for c in found if c.complete and c.durable and c.seq == n and not any(a <= n <= b for a, b in ranges)]
        usable = same_history(usable, durable, {c.order for c in found}, ties)
    if usable:  # tag=X too: two histories may both hold X
        refuse_forked(usable[0], found)
    return usable


def refuse_forked(newest: FastCandidate, found: list[FastCandidate]) -> None:
    """(every rank alike) Refuse when a complete save of a number in ``newest``'s ``lineage`` is not the one
    named there (or a second save of ``newest``'s own number, or, further back, one lower-numbered whose
    history and ``newest``'s never saw each other's saves: :func:`~smpckpt.api._tiers.apart`): another
    history, e.g. a node back with an older disk holding saves the job lost and saved past. Neither number
    nor clock says which the user continues: refused, naming both. :data:`~smpckpt.api._tiers.SKIPPED`
    numbers are not compared; incomplete copies, and older ones recording no ``runs``, are no evidence."""
    by_seq: dict[int, list[FastCandidate]] = {}
    for c in found:
        if c.complete:
            by_seq.setdefault(c.seq, []).append(c)
    other = next((c for c in by_seq.get(newest.seq, ()) if c.digest != newest.digest), None)
    for back, digest in enumerate(newest.lineage, start=1):
        if other is None and digest != SKIPPED:
            other = next((c for c in by_seq.get(newest.seq - back, ()) if c.digest != digest), None)
    if other is None:  # a fork further back than the lineage names (rev63c: resumed silently); by the
        # histories' segments, never the save times (rank 0's clock: rev63c F1, F3)
        other = next((c for c in found if c.complete and c.seq < newest.seq and apart(newest, c)), None)
    if other is not None:
        raise CheckpointError(
            f"ambiguous resume: the fast tier holds two histories of this job: {newest.tag!r} (save {newest.seq}) "
            f"and {other.tag!r} (save {other.seq}), saved by jobs that did not see each other's saves (a node back "
            "with an older disk, after the job lost its fast tier and saved past it). "
            + (
                f"Both are tag {newest.tag!r}: remove one history's {newest.tag}_partial folders from the nodes' "
                "local_path (its manifest names its save number: extra.tier.seq)"
                if other.tag == newest.tag
                else "Pass resume(tag=...) naming the one to continue (the next save settles it), or remove the "
                "other history's {tag}_partial folders from the nodes' local_path"
            )
        )


def load_tiered(req: ResumeRequest, ctx: DistContext, choice: TierChoice, part: FastTierPart) -> Loaded | None:
    """(all ranks) Load the newest candidate that loads; ``None``: neither tier holds one."""
    began = False  # a failed attempt's read began: a failure after it (a refused fallback) says so too
    try:
        durable = choice.durable
        for i, cand in enumerate(choice.fast):
            _refuse(choice.refused, i)
            manifest: Manifest | None = None
            for attempt in (cand, None):  # the copies as listed, then (once) as judged after a failure
                if attempt is None:  # fetched again: a node whose copy of the metadata was corrupt lacks it now
                    attempt = _repair(ctx, choice, cand, manifest) if manifest is not None else None
                if attempt is None:
                    break
                try:  # a copy no node reads back intact fails on every rank alike (fetch_copy): the next is tried
                    prepared = fetch_copy(ctx, choice.job, attempt, choice.nodes)
                    manifest = prepared.parsed()
                    target = Target.of(cand.tag, os.path.join(choice.job, partial_dirname(cand.tag)), manifest, False)
                    part.counter.saw(target.order[0])  # not path's target; the roll-back is marked once it is applied
                    rng, state = resume_state(req, target, ctx, depth=2)
                    DistContext(choice.group).all_ok(functools.partial(_heal, req, choice, attempt, prepared, cand))
                    reader = fast_reader(req, target, choice, attempt)
                    loaded = Loaded(
                        target, load_checkpoint(req, req.opts, target.url, state, reader), state, rng, reader
                    )
                    # the job goes on from this save (its next save's lineage, and a new segment of its runs)
                    part.state.continues, part.state.runs, part.state.passed = cand.digest, cand.runs, cand.passed
                    part.state.fresh, part.state.back_to = True, (cand.tag, target.order[0])
                    # and knows what its job knew in path, and the copy itself once drained there: a resume that
                    # did not see path (down, or tag= of a copy path lacks) knew 0, and its saves' path_seen 0
                    # later refused them as "diverged" from the job's own drained save (fix70d 3). A copy only due
                    # is not known in path: another job's save at its number there is a diverged history (rev70d)
                    drained = cand.durable and is_drained(read_drained(choice.job), cand.tag, cand.order[2])
                    part.state.saw_path(max(cand.path_seen or 0, cand.order[0] if drained else 0))
                    part.state.due.update(cand.due or ())  # and its saves only due there, itself among them
                    if cand.durable and not drained:
                        part.state.due[cand.order[0]] = cand.order[2]
                except BaseException as exc:  # every rank: a warning made an error (or a Ctrl-C) is one rank's, a
                    # CheckpointError naming it elsewhere: that rank must still reach the agreement (rev62b F1)
                    first = exc
                    began = began or str(exc).endswith(LOADED_IN_PLACE)
                    # (one collective) the caller's state does not fit the save (layout, specs, allow_pickle), or
                    # not a checkpoint's failure (a warning a filter made an error, on rank 0 alone: the others hold
                    # a CheckpointError naming it): raised on every rank alike, not fallen back from (rank 0 alone
                    # leaving made the others wait here: rev60d F1)
                    mine = isinstance(exc, (LayoutMismatch, SpecError, UnsafeCheckpoint, NodeFull)) or not isinstance(
                        exc, CheckpointError
                    )
                    full = type(exc) is NodeFull
                    votes = DistContext(choice.group).all_ok_values(functools.partial(tuple, (mine, full)))
                    if any(m for m, _ in votes):
                        # a full disk is this node's, not the save's: path's drained copy of this very save loads
                        # (agreed: every rank votes alike on it)
                        if not all(full for m, full in votes if m) or durable is None or cand.order != durable.order:
                            raise
                        said = f"{why(first, req.opts.strict)}; loading path's drained copy of {cand.tag!r} instead ({durable.url})"
                        ctx.all_ok(functools.partial(_warn_on, ctx, said, 7))
                        return _load_durable(req, ctx, durable, part)
                    continue
                if durable is not None and durable.said and cand.order == durable.order:  # path's choice, drained
                    ctx.all_ok(functools.partial(_warn_on, ctx, durable.said, 7))
                    loaded = dataclasses.replace(loaded, target=dataclasses.replace(loaded.target, fell_back=True))
                return loaded
            nxt = choice.fast[i + 1] if i + 1 < len(choice.fast) else None
            instead = (
                f"checkpoint {nxt.tag!r} of the fast tier"
                if nxt is not None
                else f"{choice.durable.url} (tag {choice.durable.tag!r}) in the durable tier"
                if choice.durable is not None
                else "nothing (no other checkpoint in either tier)"
            )
            # agreed, as the failure was: a warning made an error fails every rank alike (rev59c F1)
            said = f"loading checkpoint {cand.tag!r} from the fast tier failed ({why(first, req.opts.strict)}); resuming from {instead}"
            ctx.all_ok(functools.partial(_warn_on, ctx, said, 7))
            if nxt is None and choice.durable is None:
                raise first
        if choice.durable is None:
            return None
        _refuse(choice.refused, len(choice.fast))
        loaded = _load_durable(req, ctx, choice.durable, part)
        if choice.nodes.is_leader:  # the job goes on from it (each node's record: rev72b H1)
            note_seen(choice.job, (choice.durable.tag, choice.durable.order[2]))
        return loaded
    except CheckpointError as exc:
        loaded_in_place(exc, began)
        raise


def why(exc: BaseException, strict: bool) -> str:
    """A failure a fallback replaces; under ``strict`` without :data:`~smpckpt.errors.LOADED_IN_PLACE` (the
    fallback loads every key again), else with it: a key the fallback skips keeps the failed read's value."""
    return str(exc).removesuffix(LOADED_IN_PLACE) if strict else str(exc)


def _load_durable(req: ResumeRequest, ctx: DistContext, target: Target, part: FastTierPart) -> Loaded:
    """(all ranks) Load path's checkpoint ``target``; the job goes on from it."""
    if target.said:  # resolve_target's fallback warning, only when what it chose loads (agreed, as above)
        ctx.all_ok(functools.partial(_warn_on, ctx, target.said, 8))  # the caller's line: one frame deeper
    rng, state = resume_state(req, target, ctx, depth=2)
    loaded = Loaded(target, load_checkpoint(req, req.opts, target.url, state, known=target.manifest), state, rng, None)
    part.state.continues = PATH_MARK  # the job goes on from path's checkpoint (its next save's lineage)
    part.state.runs, part.state.passed = runs_of(target.runs[0]), runs_of(target.runs[1])
    part.state.fresh, part.state.back_to = True, (target.tag, target.order[0])
    return loaded


def _heal(
    req: ResumeRequest, choice: TierChoice, cand: FastCandidate, prepared: PreparedCommit, listed: FastCandidate
) -> None:
    """(leaders) Remove (never through a link, each kind logged) what in this node's folder of ``cand``'s
    tag would refuse a part healed in from a peer (files are created, never written over): a part not at
    the manifest's size (then fetched when read), found corrupt, or (a retry: ``cand`` is not ``listed``)
    fetched by the failed attempt and not intact (:func:`_repair` counts the intact ones as held); when
    this node lacks ``cand``'s manifest, an older save's manifest of the tag (first), then its files, or a
    damaged manifest alone. A newer or foreign copy is left alone
    (the load then fails, by name). Then the copy's metadata and manifest (``prepared``), where this node
    lacks them (unless the failed attempt wrote them: the same bytes are there)."""
    nodes = choice.nodes
    node = nodes.node_of(nodes.rank)
    if not nodes.is_leader:
        return
    folder = os.path.join(choice.job, partial_dirname(cand.tag))

    def here(holders: tuple[int, ...]) -> bool:
        return any(nodes.node_of(r) == node for r in holders)

    stale, what = [], []
    if not here(cand.held_by[MANIFEST_NAME]) and os.path.lexists(os.path.join(folder, MANIFEST_NAME)):
        copy, _ = read_copy(folder, cand.tag, durable_key(req.root, req.storage_options))
        if copy.state == "corrupt":
            stale, what = [MANIFEST_NAME], [f"a damaged manifest ({copy.detail})"]
        elif copy.committed and copy.seq < cand.seq:
            # a strictly lower save number: the tag was saved again after it, in this history; an equal
            # number is another history's save (a fork): never removed
            stale = [MANIFEST_NAME] + sorted(n for n in copy.files if n != MANIFEST_NAME and n not in cand.held_by)
            what = [f"an older save of the tag (save {copy.seq}; the one loaded is save {cand.seq})"]
    wrong = sorted(
        name
        for name, holders in cand.held_by.items()
        if name != MANIFEST_NAME and not here(holders) and os.path.lexists(os.path.join(folder, name))
    )
    corrupt = [n for n in wrong if here(listed.held_by[n])]  # the rest were not held when listed
    fetched = [n for n in wrong if n not in corrupt]
    kind = "fetched by the failed attempt, not intact" if cand is not listed else "not at the manifest's size"
    for names, said in ((corrupt, "found corrupt"), (fetched, kind)):
        if names:
            stale += names
            what.append(f"{len(names)} part(s) {said} ({', '.join(names[:3])})")
    if stale and not os.path.islink(folder):  # never removed through a link (the fast tier writes none)
        log.warning(
            "fast tier: node %d's copy of checkpoint %r holds %s: removed, intact copies are fetched from peers",
            node,
            cand.tag,
            "; ".join(what),
        )
        with Folder(open_fs(folder)[0], folder) as f:
            failed = f.remove(stale)
        if failed:
            raise CheckpointError(f"fast tier: could not remove {'; '.join(what)} on node {node}: {failed[:5]}")
    sent = {prepared.metadata_name: prepared.metadata, MANIFEST_NAME: prepared.manifest}
    lacks = [n for n in sent if not here(cand.held_by[n])]
    try:
        fs = open_fs(folder)[0]
        lacks = [
            n for n in lacks if not os.path.isfile(p := os.path.join(folder, n)) or read_bytes_or_none(fs, p) != sent[n]
        ]
        if lacks:  # the metadata first: a manifest commits the copy (created, never written over)
            with Folder(fs, folder, create=True) as f:
                for name in lacks:
                    f.publish(name, sent[name], sync=False)
    except (OSError, CheckpointError) as exc:  # a folder that is a link too: this copy fails, the next is tried
        shown = " and ".join("its manifest" if n == MANIFEST_NAME else "its metadata" for n in lacks)
        raise (NodeFull if disk_full(exc) else CheckpointError)(
            f"writing {shown} to node {node}'s copy of checkpoint {cand.tag!r} {folder} failed: {exc}"
        ) from exc


def fast_reader(req: ResumeRequest, target: Target, choice: TierChoice, cand: FastCandidate) -> PeerFetchingReader:
    """(all ranks, once this node's folder of the copy is healed: :func:`_heal`) This rank's reader of the
    chosen fast-tier copy."""
    nodes = choice.nodes
    return PeerFetchingReader(
        target.url,
        group=choice.group,
        streams=choice.streams,
        ranks=list(range(nodes.world_size)),
        rank=nodes.rank,
        local_world_size=nodes.local_world_size,
        held_by=cand.held_by,
        verify_checksums=req.opts.verify_checksums,
        allow_pickle=req.opts.allow_pickle,
    )


def _repair(ctx: DistContext, choice: TierChoice, cand: FastCandidate, manifest: Manifest) -> FastCandidate | None:
    """(all ranks; leaders read) After a failed load, each leader checks its parts of ``cand`` against the
    manifest, and the parts the failed attempt fetched; corrupt copies no longer count as held, intact
    fetched ones do (the retry fetches only the rest). ``cand`` so judged when something was corrupt and
    every part is still held intact somewhere, else ``None``."""
    gctx, nodes = DistContext(choice.group), choice.nodes
    folder = os.path.join(choice.job, partial_dirname(cand.tag))
    node = nodes.node_of(nodes.rank)
    records = {f.name: f for f in manifest.files}

    def check() -> tuple[list[str], list[str]]:
        if not nodes.is_leader:
            return [], []
        fs = open_fs(folder)[0]
        bad, gained = [], []
        for name, holders in cand.held_by.items():
            listed, path = any(nodes.node_of(r) == node for r in holders), os.path.join(folder, name)
            # a part the failed attempt fetched (rev63c: removed and fetched again, GiBs at real sizes) is
            # kept only once checked here, at the manifest's size (never through a link)
            fetched = not os.path.islink(folder) and os.path.isfile(path) and not os.path.islink(path)
            if name == MANIFEST_NAME or not (listed or fetched):
                continue
            try:
                if name in records:
                    ok = (listed or os.path.getsize(path) == records[name].size) and check_blocks(
                        fs, path, records[name], path, [], lambda _: None
                    )
                else:
                    ok = manifest.metadata.matches(read_bytes_or_none(fs, path) or b"")
            except OSError:
                ok = False
            if listed and not ok:
                bad.append(name)
            elif ok and not listed:
                gained.append(name)
        return bad, gained

    found = gctx.all_ok_values(check)
    corrupt = {(nodes.node_of(r), name) for r, (names, _) in enumerate(found) for name in names}
    gained = {(nodes.node_of(r), name) for r, (_, names) in enumerate(found) for name in names}
    if not corrupt:
        return None
    held = {  # an intact part a node fetched counts as held there: the retry reads it, fetches the rest
        name: tuple(
            r
            for r in range(nodes.world_size)
            if (nodes.node_of(r), name) in gained or (r in holders and (nodes.node_of(r), name) not in corrupt)
        )
        for name, holders in cand.held_by.items()
    }
    missing = tuple(sorted(n for n, where in held.items() if not where))
    shown = ", ".join(f"{name} on node {n}" for n, name in sorted(corrupt)[:5])
    what = "fetching them from peers with intact copies" if not missing else "no node holds an intact copy of some"
    # agreed (every rank knows `corrupt`): a filter making the warning an error fails every rank alike, not
    # rank 0 alone while the others wait in the next collective (rev59c F1)
    gctx.all_ok(lambda: _warn_on(ctx, f"fast tier: checkpoint {cand.tag!r} has corrupt parts ({shown}); {what}", 9))
    # the corrupt copies, no longer counted as held, go before the retried load (:func:`_heal`), so the
    # intact ones fetched from the peers can take their names
    return None if missing else dataclasses.replace(cand, held_by=held, missing=missing)


def _warn_on(ctx: DistContext, message: str, stacklevel: int) -> None:
    """A warning (and its log line) on rank 0, inside an agreement (``ctx.all_ok``) of its callers."""
    if ctx.is_coordinator:
        log.warning(message)
        warnings.warn(message, stacklevel=stacklevel)


def lineage_for(views: Sequence[Mapping[str, LocalCopy]], durable_seq: int, continues: int | None) -> tuple[int, ...]:
    """(rank 0, planning a save) The lineage a save records, newest first: the save the job goes on from
    (``continues``; unknown: the newest it sees) and that save's lineage, :data:`~smpckpt.api._tiers.SKIPPED`
    at the numbers in between and at numbers two saves hold; it ends at ``path``'s checkpoint."""
    found, top = candidates(views), tier_seq(views)
    seq = 1 + max(top, durable_seq)
    if continues is None:
        parent = next((c for c in found if c.seq == top), None) if top >= durable_seq else None
    else:
        parent = next((c for c in found if c.digest == continues), None)
    base = parent.seq if parent is not None else durable_seq if continues in (PATH_MARK, None) else seq - 1
    lineage = [SKIPPED] * (seq - 1 - base) + ([parent.digest, *parent.lineage] if parent is not None else [])
    digests: dict[int, set[int]] = {}
    for c in found:
        digests.setdefault(c.seq, set()).add(c.digest)
    twins = {n for n, held in digests.items() if len(held) > 1}
    return tuple(SKIPPED if seq - 1 - i in twins else d for i, d in enumerate(lineage[:LINEAGE]))


Pairs = tuple[tuple[int, int], ...]


def runs_for(
    views: Sequence[Mapping[str, LocalCopy]], durable_seq: int, memory: TierState, seq: int
) -> tuple[Pairs, Pairs]:
    """(rank 0, planning save ``seq``) The ``runs`` and ``passed`` the save records
    (:data:`~smpckpt.api._tiers.RUNS`): its history's (unknown: the newest it sees, as :func:`lineage_for`),
    a new segment the first save after a resume, and the saves in sight that are not of it: the
    job saw them and did not go on from them (as the lineage's skipped numbers: a fork so settled)."""
    found, top = candidates(views), tier_seq(views)
    runs, passed = memory.runs, memory.passed
    if runs is None:
        parent = next((c for c in found if c.seq == top), None) if top >= durable_seq else None
        runs, passed = (parent.runs, parent.passed) if parent is not None else ((), ())
    if memory.fresh:
        runs = (*runs, (secrets.randbits(64), seq))[-RUNS:]
    mine, seen = ends_of(runs), dict(passed)
    for c in found:
        span = mine.get(c.runs[-1][0]) if c.runs else None
        if c.runs and not (span and span[0] <= c.seq < span[1]):  # incomplete too: seen, not gone on from
            seen[c.runs[-1][0]] = max(seen.get(c.runs[-1][0], 0), c.seq)
    return runs, tuple(seen.items())[-RUNS:]
