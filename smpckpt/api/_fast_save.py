"""A Checkpointer's fast tier, :class:`FastTierPart` (README, "Tiered checkpoints"): saves into the
nodes' fast tiers with replicas on other nodes, every ``durable_every``-th one drained to ``path`` on the
drain lane (:mod:`smpckpt.api._drain`), resumes from either tier (:mod:`smpckpt.api._fast_resume`).

Which rank does what ("leader" = each node's first rank): ``plan_tier_save`` (all, caller: nodes and
folders checked, listings gathered; rank 0 numbers the save and refuses a tag already complete or
committed, or finds a :class:`PendingDrain`; leaders remove this tag's leftovers) -> ``save_fast`` (all:
dcp.save into each node's folder, uncommitted; files sent to replica nodes; agreement that every node
holds its share; then each leader commits its node's copy and applies ``num_kept_local``) -> the drain.
A kill before the agreement leaves no manifest anywhere; after it, any manifest proves the union.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from smpckpt.api._async import GlooGroups, Lane, commit_point, wait_logged
from smpckpt.api._dist import DistContext, peer_failures
from smpckpt.api._drain import drain, due_record, is_drained, note_seen, path_down, pending_drains, read_drained
from smpckpt.api._fast_resume import Loaded, choose_tier, lineage_for, load_tiered, runs_for
from smpckpt.api._resume import ResumeRequest
from smpckpt.api._save import SaveRequest, run_save
from smpckpt.api._tier_retention import retain_fast
from smpckpt.api._tiers import (
    LINEAGE,
    TIER_KEY,
    FastCandidate,
    LocalCopy,
    Nodes,
    TierState,
    candidates,
    durable_key,
    ends_of,
    fetch_copy,
    gather_views,
    tier_seq,
)
from smpckpt.api.options import FastTier
from smpckpt.catalog.root import (
    CheckpointRecord,
    SequenceCounter,
    abandoned_of,
    partial_dirname,
    partial_url,
    sequence_of,
)
from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.storage import probe_checkpoint
from smpckpt.storage.backends._fs import folder_key, is_local, open_fs
from smpckpt.storage.format._checksum import hash_bytes
from smpckpt.storage.format.commit import check_files, remove_folder
from smpckpt.storage.format.manifest import FileRecord
from smpckpt.storage.tier import FastTierWriter, PreparedCommit, Replicator, commit_node_copy, parts_of
from smpckpt.storage.tier.reader import TransferOutcome

__all__ = ["FastTierPart", "TierPlan", "PendingDrain", "plan_tier_save", "save_fast"]

log = logging.getLogger("smpckpt.api")


class FastTierPart:
    """The fast tier of one Checkpointer: its options and memory, and the Checkpointer's parts it works with."""

    def __init__(self, options: FastTier, groups: GlooGroups, counter: SequenceCounter, drain_lane: Lane) -> None:
        self.options, self.groups, self.counter, self.drain_lane = options, groups, counter, drain_lane
        self.state = TierState()

    def plan(self, req: SaveRequest, ctx: DistContext) -> TierPlan:
        """(all ranks, the caller's thread) What this save is in the fast tier (:func:`plan_tier_save`)."""
        return plan_tier_save(req, ctx, self)

    def drew(self, tier: TierPlan, extra: Mapping[str, Any]) -> TierPlan:
        """(all ranks, the caller's thread) The plan to save with, once rank 0 drew the save's number
        (``extra``); what the draw read in ``path`` is known to the job's later saves."""
        if not extra:
            return tier
        read: CheckpointRecord | None = None if tier.offline else self.counter.newest_read  # (rank 0) by the draw
        seen = (read.tag, read.order[2]) if read is not None and read.committed else None
        self.state.saw_path(self.counter.read)  # not its own number when due: not in path yet (fix70f)
        return dataclasses.replace(tier, path_seen=max(tier.path_seen, self.counter.read), newest_seen=seen)

    def save(self, req: SaveRequest, state: dict[str, Any], extra: dict[str, Any], tier: TierPlan) -> None:
        """(all ranks) The fast tiers, then (a durable save, or a retried one) the drain, on the drain lane."""
        started = time.monotonic()
        if tier.drains:  # agreed: one rank's drain thread failing to start hung the others
            DistContext(req.process_group).all_ok(self.drain_lane.start)
        prepared = save_fast(req, state, extra, tier)
        # (rank 0) due for path: a checkpoint there at its number is the job's only when it is this save (fix70f)
        if tier.durable and extra:
            self.state.due[sequence_of(extra)] = prepared.parsed().save_id
        self.state.continues = hash_bytes(prepared.manifest)  # the next save goes on from this one
        log.info(
            "saved checkpoint %r to the fast tier %s (save %d, %d replica(s)) in %.2fs%s; phases: %s",
            req.tag,
            tier.options.local_path,
            tier.seq,
            tier.options.replicas,
            time.monotonic() - started,
            f"; draining to {req.url}" if tier.drains and tier.retry is None else "",
            ", ".join(f"{name} {s:.3f}s" for name, s in tier.phases.items()),
        )
        if tier.drains:
            self._drain(req, tier, prepared)

    def _drain(self, req: SaveRequest, tier: TierPlan, prepared: PreparedCommit) -> None:
        """This save (a durable one) or the save it drains again (``tier.retry``) drained on the drain lane,
        its tag held in the fast tier meanwhile."""
        retry = None if tier.durable else tier.retry
        if retry is not None:
            req = dataclasses.replace(req, tag=retry.tag, url=partial_url(req.root, retry.tag))
        with self.state.lock:  # retention keeps it until the drain ends
            self.state.held.add(req.tag)
        back = abandoned_of(prepared.parsed().extra)  # what this save's history abandoned: retention keeps it

        def work() -> None:
            drained = retry.prepared if retry is not None else prepared
            try:
                with peer_failures(DistContext(tier.drain_group), f"draining checkpoint {req.tag!r} to {req.url}"):
                    drain(req, tier, drained, retry, self.counter.manifests)
                self.counter.landed(req.tag, drained.parsed().extra)  # the run path's folder holds (a move keeps it)
            finally:
                with self.state.lock:  # a failed drain too: the next save may drain it again
                    self.state.held.discard(req.tag)
            if tier.nodes.is_leader:  # the fast tier kept this tag while it drained: it may go now
                retain_fast(tier, None, back)

        self.drain_lane.submit(req.tag, work)

    def resume(self, req: ResumeRequest, ctx: DistContext) -> Loaded | None:
        """(all ranks) The newest checkpoint complete in either tier, loaded; ``None``: none."""
        return load_tiered(req, ctx, choose_tier(req, ctx, self), self)


# -- the tiered save ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PendingDrain:
    """A save due for the durable tier whose drain was killed or failed: drained again by the next save
    that is not itself durable. The same on every rank."""

    tag: str
    seq: int
    prepared: PreparedCommit
    held_by: Mapping[str, tuple[int, ...]]  #: part -> global ranks whose node folder holds it


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """One tiered save, decided before anything is written (the same on every rank but the folders)."""

    options: FastTier  #: the Checkpointer's (``local_path``: this node's fast tier)
    nodes: Nodes
    job: str  #: this job's folder in it
    folder: str  #: this node's folder of the tag
    seq: int  #: this save's number in the job (1, 2, ...), across restarts
    durable: bool  #: due for ``path`` (recorded: drained now, else -- ``offline`` -- by a later save)
    root_key: str = ""  #: the durable root, as the manifest records it
    views: tuple[Mapping[str, LocalCopy], ...] = ()  #: every rank's node listing before this save
    durable_seq: int = 0  #: the highest save number ``path`` held before this save
    retry: PendingDrain | None = None
    #: (rank 0's) the saves due for ``path`` whose drain was running when this save was planned: kept in the
    #: fast tier, as ``retry`` is (the drain may fail, and the next save drains it again: rev65b F1, rev65d F1)
    running: tuple[str, ...] = ()
    streams: tuple[Any, ...] = ()  #: the groups files move over (the first: agreements, the save thread's)
    drain_group: Any = None  #: the drain thread's group
    memory: TierState = dataclasses.field(default_factory=TierState, compare=False)  #: the Checkpointer's
    #: (rank 0) the highest root sequence number this job knew in ``path`` (``TierState.path_seq``)
    path_seen: int = 0
    lineage: tuple[int, ...] = ()  #: (rank 0) the fast-tier saves it was numbered after (``lineage_for``)
    runs: tuple[tuple[int, int], ...] = ()  #: (rank 0) its history's segments (``runs_for``, ``_tiers.RUNS``)
    passed: tuple[tuple[int, int], ...] = ()  #: (rank 0) the saves of others its history passed over
    #: (rank 0's) ``path`` did not answer when planned: a due save is not drained now (its copiers would block
    #: for retries x timeouts on a hung endpoint, and the next save wait for them: rev68b F2), but pending
    offline: bool = False
    #: (rank 0) its saves due for ``path`` numbered above ``path_seen``, with their save ids (``_drain.due_record``)
    due: tuple[tuple[int, str], ...] = ()
    #: (rank 0's, every rank's once broadcast with the manifest) path's newest committed as its draw read it
    newest_seen: tuple[str, str] | None = None
    #: seconds this rank spent in each step of the save (logged with it: where the time goes)
    phases: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
    #: the folder ``path`` named when planned (``folder_key``: a link resolved): its drain commits there or nowhere
    root_folder: str = ""

    @property
    def group(self) -> Any:
        return self.streams[0] if self.streams else None

    @property
    def drains(self) -> bool:
        """Whether this save starts a drain: its own (due, ``path`` answering) or a pending one's (``retry``)."""
        return (self.durable and not self.offline) or self.retry is not None

    def record(self) -> dict[str, Any]:
        """The manifest's ``extra["tier"]``: the one place a tiered save's record is built."""
        return {
            "seq": self.seq,
            "durable": self.durable,
            "replicas": self.options.replicas,
            "nodes": self.nodes.count,
            "local_world_size": self.nodes.local_world_size,
            "root": self.root_key,
            # a checkpoint of path numbered higher was saved without this save's knowledge (_fast_resume)
            "path_seen": self.path_seen,
            "due": [list(d) for d in self.due],  # path's checkpoint at such a number is the job's if it is that save
            # a fork: another save of that number is another history (a node back with an old disk)
            **({"lineage": ["skip" if d < 0 else f"{d:016x}" for d in self.lineage]} if self.lineage else {}),
            # further back: its history's segments, and the saves of others it passed over (_tiers.RUNS)
            **{k: [[f"{i:016x}", n] for i, n in v] for k, v in (("runs", self.runs), ("passed", self.passed)) if v},
        }

    def folder_of(self, tag: str) -> str:
        return os.path.join(self.job, partial_dirname(tag))


def plan_tier_save(req: SaveRequest, ctx: DistContext, part: FastTierPart) -> TierPlan:
    """(all ranks, the caller's thread) The nodes, the save number, the tag's folders settled, the groups."""
    started = time.monotonic()
    opts, memory = part.options, part.state
    local = opts.local_path
    nodes, job, views, _ = gather_views(
        ctx, req.process_group, opts.replicas, local, req.root, req.storage_options, memory.warned
    )

    if any(c.complete for c in candidates(views, req.tag)):  # the same answer on every rank
        raise CheckpointExists(f"checkpoint {req.tag!r} is already committed in the fast tier ({local} on its nodes)")

    def decide() -> tuple[int, int, FastCandidate | None, tuple[str, ...], tuple[int, ...], tuple[Any, Any], bool]:
        # the fast tiers' copies are numbered too (catalog.root): this save is numbered after them; once this job
        # drew, not after another job's sharing this fast folder (one node, one local_path and path): counted seen,
        # its drained checkpoint was no longer refused and this job's retention removed it from path (fix70a)
        me = part.counter.job if part.counter.drawn else ""  # a save's draw: an export before it draws too (rev70a)
        copies = [
            c.order[0] for v in views for c in v.values() if c.digest is not None and c.job in (None, me or c.job)
        ]
        part.counter.saw(max(copies, default=0))
        try:
            if probe_checkpoint(req.url, req.storage_options).state in ("committed", "legacy"):
                raise CheckpointExists(f"{req.url} already holds a committed checkpoint of tag {req.tag!r}")
            drained, part.counter.offline = memory.durable_seq(req.root, req.storage_options), False
        except OSError as exc:
            if not path_down(exc):
                raise
            # path's outage (tiers68 F3): the fast tier keeps the job checkpointing. The tag is checked when
            # it drains (_drain refuses a committed one); numbered after what the job saw, path listed later
            said = (
                f"path {req.root} is unreachable ({exc}): checkpoint {req.tag!r} is saved to the fast tier "
                "only; its tag is checked against path when it drains"
            )
            log.warning(said)
            warnings.warn(said, stacklevel=4)
            # as known, else as node 0 recorded its drains (else retention warns they "never reached" path)
            done = read_drained(job)
            recorded = {c.seq for c in candidates(views) if is_drained(done, c.tag, c.order[2])}
            drained, part.counter.offline = memory.durable or max(recorded, default=0), True
        seq = 1 + max(tier_seq(views), drained)
        with memory.lock:  # a drain of this Checkpointer still copying it is not pending: it is running
            running = set(memory.held)
        # nor one older than a drain still running: drained after it, it would move `newest` back (rev65b F3)
        ahead = max((c.seq for c in candidates(views) if c.tag in running), default=0)
        due = pending_drains(views, drained)
        pending = [c for c in due if c.tag not in running and c.seq > ahead]
        lineage, runs = lineage_for(views, drained, memory.continues), runs_for(views, drained, memory, seq)
        back = (
            *part.counter.abandoned,
            *([(memory.back_to[1] + 1, 2**62)] if memory.fresh and memory.back_to[1] else []),
        )
        tags = {c.order[0]: c.tag for c in candidates(views)} | {memory.back_to[1]: memory.back_to[0]}
        down = part.counter.offline  # no drain starts while path is down (a due one stays pending)
        retry = (
            None
            if down or seq % opts.durable_every == 0
            else _retry_of(req, pending, (seq, lineage, runs[0]), back, tags)
        )
        memory.runs, memory.passed, memory.fresh = *runs, False  # the segment stays, the save failing or not
        return seq, drained, retry, tuple(c.tag for c in due if c.tag in running), lineage, runs, down

    seq, drained, retry_of, running, lineage, runs, down = ctx.on_coordinator(decide)
    folder = os.path.join(job, partial_dirname(req.tag))

    def settle() -> None:
        # leftovers of this tag: a killed save, or a copy no surviving node set can complete; never a
        # folder this job does not own (a link goes, its target stays)
        if nodes.is_leader and req.tag in views[ctx.rank]:
            copy = views[ctx.rank][req.tag]
            if copy.state in ("foreign", "unsafe") and not os.path.islink(folder):
                raise CheckpointExists(
                    f"{folder} is {copy.state} ({copy.detail}): it is left alone; save under another tag, or "
                    "remove that folder"
                )
            failed = remove_folder(open_fs(folder)[0], folder, folder)  # manifest first, never through a link
            if failed:
                raise CheckpointError(f"{folder}: could not remove the leftovers of an earlier save: {failed[:5]}")

    ctx.all_ok(settle)
    durable = seq % opts.durable_every == 0
    if durable and not down:  # one drain at a time: the fast tier keeps its tag until it is done
        wait_logged(part.drain_lane.fut, f"the drain of {part.drain_lane.tag!r} to the durable tier")
    retry = _pending(ctx, job, retry_of, nodes) if retry_of is not None else None
    if retry is not None and ctx.is_coordinator:  # this job drains it again: its history's, due for path
        again = retry.prepared.parsed()
        memory.due[sequence_of(again.extra)] = again.save_id
    streams = part.groups.streams(ctx)
    drain_group = part.groups.get(ctx, "drain")
    key = durable_key(req.root, req.storage_options)
    plan = TierPlan(
        opts,
        nodes,
        job,
        folder,
        seq,
        durable,
        key,
        tuple(views),
        drained,
        retry,
        running,
        streams,
        drain_group,
        memory,
        memory.path_seq,
        lineage,
        *runs,
        offline=down,
        due=due_record(memory),
        root_folder=folder_key(req.root, req.storage_options),
    )
    plan.phases["plan"] = time.monotonic() - started
    return plan


def _retry_of(
    req: SaveRequest,
    pending: Sequence[FastCandidate],
    save: tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]],
    back: Sequence[tuple[int, int]],
    tags: Mapping[int, str],
) -> FastCandidate | None:
    """(rank 0) The newest save due for the durable tier whose drain never committed, when it can be
    drained (complete across the nodes, its tag free in ``path``, and of the history of the save being
    made, ``save`` -- its number, lineage and runs: never another's, nor one a roll-back abandoned
    (``back``: root number ranges; ``tags``: root number -> tag), however far back: rev63c F2), warned of as
    the others are."""
    seq, lineage, runs = save
    for c in pending:
        why, span = "", ends_of(runs).get(c.runs[-1][0]) if c.runs else None
        gone = next(((lo, hi) for lo, hi in back if lo <= c.order[0] <= hi), None)
        if not c.complete:
            why = f"it is incomplete across the surviving nodes (missing {', '.join(c.missing[:3])})"
        elif gone is not None:  # numbered past the save a roll-back went on from, in sight then
            to = tags.get(gone[0] - 1)
            why = f"it was abandoned by the roll-back to {f'{to!r} ' if to else ''}(save {gone[0] - 1})"
        elif (c.runs and not (span and span[0] <= c.seq < span[1])) or (
            c.seq >= seq - LINEAGE and c.digest not in lineage
        ):
            why = "this job did not go on from it (another history's save: a node back with an older disk?)"
        elif probe_checkpoint(partial_url(req.root, c.tag), req.storage_options).state in ("committed", "legacy"):
            why = f"{partial_url(req.root, c.tag)} holds another checkpoint of that tag"
        kept = (
            "(abandoned: retention neither counts nor removes it)" if gone else "while among the num_kept_local newest"
        )
        message = (
            f"checkpoint {c.tag!r} (save {c.seq}) was due for the durable tier and its drain never committed (it "
            f"failed, or the job stopped while draining): this save drains it to {partial_url(req.root, c.tag)} again, in the "
            "background, once it is written"
            if not why
            else f"checkpoint {c.tag!r} (save {c.seq}) was due for the durable tier {req.root} and is not there, "
            f"but cannot be drained: {why}; the fast tier keeps it {kept}"
        )
        # inside plan_tier_save's agreement (on_coordinator): a filter making warnings errors fails the save
        # on every rank alike, not rank 0's alone (rev59c F3)
        log.warning(message)
        warnings.warn(message, stacklevel=5)
        if not why:
            return c
    return None


def _pending(ctx: DistContext, job: str, found: FastCandidate, nodes: Nodes) -> PendingDrain:
    """(all ranks) The pending save's manifest and metadata, from the first nodes holding them intact."""
    return PendingDrain(found.tag, found.seq, fetch_copy(ctx, job, found, nodes, metadata=True), found.held_by)


def save_fast(req: SaveRequest, state: dict[str, Any], extra: dict[str, Any], tier: TierPlan) -> PreparedCommit:
    """(all ranks; ``req.process_group`` runs ``dcp.save``, ``tier.group`` the agreements, ``tier.streams``
    the transfers) Write, replicate and commit this tag in every node's fast tier."""
    gctx = DistContext(tier.group)
    opts, nodes = req.opts, tier.nodes
    root_local = is_local(open_fs(req.root, req.storage_options)[0])
    writer = FastTierWriter(
        tier.folder,
        manifest_extra={**extra, TIER_KEY: tier.record()} if extra else {},
        format="torch_save" if opts.format == "torch_save" else "raw",
        sync_files=opts.sync_files,
        prefix_strategy="auto" if root_local else "hex",  # the durable root's names, for the drain
        durable_is_local=root_local,
    )
    # each data file also goes to the replica ranks while it is written (not the agreements' group:
    # an async save's dcp.save runs its collectives there meanwhile)
    replicator = None
    if tier.options.replicas > 1 and tier.streams:
        replicator = Replicator(
            rank=nodes.rank,
            world_size=nodes.world_size,
            local_world_size=nodes.local_world_size,
            replicas=tier.options.replicas,
            groups=tier.streams[1:] or tier.streams,
            folder=tier.folder,
            sync=opts.sync_files,
            max_queued=writer.staging_bytes,  # the save's cap on staged host memory bounds the senders' queue
            workers=tier.memory.replica_workers,
        )
        writer.replicator = replicator
        replicator.start()
    committed = False
    last = [time.monotonic()]

    def lap(name: str) -> None:  # the laps of the save's steps into ``phases`` (seconds)
        tier.phases[name] = (now := time.monotonic()) - last[0]
        last[0] = now

    try:
        try:
            action = f"saving checkpoint {req.tag!r} to the fast tier {tier.folder}"
            run_save("partial", req, writer, state, action, req.planners, opts.verify_replicas)
            lap("write")  # this rank's files written, and sent to the replica ranks meanwhile
        finally:
            outcome = replicator.close() if replicator is not None else TransferOutcome()
            lap("replicas")  # what this rank still received after its own writes
        prepared, seen = gctx.broadcast_object(None if writer.prepared is None else (writer.prepared, tier.newest_seen))
        if nodes.is_leader:  # every node's record (rev72b H1: node 0's alone, a replaced node 0 was refused)
            note_seen(tier.job, seen)
        manifest = prepared.parsed()
        node = nodes.node_of(nodes.rank)
        share = [r for n in nodes.replica_nodes(node, tier.options.replicas) for r in nodes.ranks_of(n)]
        expected = parts_of(manifest, share)

        def copied() -> None:
            if outcome.errors:
                raise CheckpointError(f"copying replicas failed: {'; '.join(outcome.errors[:5])}")

        def holds_share() -> None:
            if nodes.is_leader:
                fs, path = open_fs(tier.folder)
                check_files(fs, path, tier.folder, expected)

        gctx.all_ok(copied)  # also the barrier: a node's other ranks may still be receiving its share
        gctx.all_ok(holds_share)
        lap("agree")
        committed = True  # from here on, a node's manifest proves every node's share
        _commit_nodes(gctx, tier, req.tag, prepared, expected, sync=opts.sync_files)
        lap("commit")
    except BaseException:
        if not committed and nodes.is_leader:
            try:
                remove_folder(open_fs(tier.folder)[0], tier.folder, tier.folder)
            except Exception as exc:  # noqa: BLE001 - the save's own error is the one to raise
                if not isinstance(exc, FileNotFoundError):
                    log.warning("could not remove the failed fast-tier save's folder %s: %s", tier.folder, exc)
        raise
    if nodes.is_leader:
        retain_fast(tier, req.tag, abandoned_of(manifest.extra))
    lap("retain")
    return prepared


def _commit_nodes(
    gctx: DistContext, tier: TierPlan, tag: str, prepared: PreparedCommit, expected: list[FileRecord], *, sync: bool
) -> None:
    """(all ranks) Each leader commits its node's copy. One failing fails the save on every rank, naming its
    node, but a copy committed on another node is the checkpoint (a resume loads it and heals the rest): the
    job goes on from it, and a drain due for it is retried, not judged another history's (hunt64c F2)."""
    said = ("", False)
    if tier.nodes.is_leader:
        try:
            commit_point()  # a save given up on while a peer was silent commits no node's copy if it comes back
            commit_node_copy(tier.folder, prepared, expected, sync=sync)
        except Exception as exc:  # noqa: BLE001 - agreed below, every node's failure named
            node = tier.nodes.node_of(tier.nodes.rank)
            said = (f"node {node}: {type(exc).__name__}: {exc}", isinstance(exc, CheckpointExists))
    failed = [f for f in gctx.all_gather_object(said) if f[0]]
    if failed:
        some = len(failed) < tier.nodes.count
        if some:
            tier.memory.continues = hash_bytes(prepared.manifest)
        # another save's manifest on every node: CheckpointExists, the documented error (rev64b R4; not when saved)
        raise (CheckpointExists if not some and all(f[1] for f in failed) else CheckpointError)(
            f"committing checkpoint {tag!r} to the fast tier failed on {'; '.join(f[0] for f in failed[:4])}"
            + (
                "; it is committed on the other node(s): a resume loads it, healing the failed node(s) (which needs room there)"
                if some
                else ""
            )
        )
