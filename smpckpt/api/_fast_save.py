"""``save_checkpoint(..., local_path=...)``: the save into the fast tiers, with replicas on other nodes.

Which rank does what ("all" = every rank; "leader" = the first rank of each node)::

    plan_tier_save  (all, caller)   nodes from LOCAL_WORLD_SIZE; every node's fast tier scanned and
                                    gathered; rank 0: the save number (durable_every), refusal of a tag
                                    already complete in the fast tier or committed in ``path``;
                                    leaders: this tag's leftover folder removed; a durable save waits
                                    for the drain in flight; the gloo groups (``smpckpt.api._async``)
    save_fast       (all)           dcp.save into each node's folder (FastTierWriter: nothing committed);
                                    the manifest broadcast; each rank's files sent to its replica nodes;
                                    agreement that every node holds its share; then every leader commits
                                    its node's copy; leaders apply ``num_kept_local``
    (then)          drain           every ``durable_every``-th save: ``smpckpt.api._drain`` in the background

A kill before the agreement leaves no manifest on any node (the tag is not committed; the next save of
it removes the leftovers); after it, every node's share is complete, so any manifest proves the union.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from smpckpt.api._async import background_group, stream_groups, wait_for_drain
from smpckpt.api._dist import DistContext
from smpckpt.api._save import SaveRequest, run_save
from smpckpt.api._tiers import (
    TIER_KEY,
    Nodes,
    durable_seq,
    gather_views,
    newest_complete,
    node_layout,
    retain_local,
    scan_local,
    tier_seq,
)
from smpckpt.api.options import check_local_path
from smpckpt.catalog.sequence import saw_sequence
from smpckpt.catalog.tags import partial_dirname
from smpckpt.errors import CheckpointError, CheckpointExists
from smpckpt.storage import probe_checkpoint
from smpckpt.storage.backends._fs import is_local, open_fs
from smpckpt.storage.format.commit import check_files, remove_folder
from smpckpt.storage.tier import (
    FastTierWriter,
    PreparedCommit,
    commit_node_copy,
    parts_of,
    replica_transfers,
    run_transfers,
)

__all__ = ["TierPlan", "plan_tier_save", "save_fast", "retain_fast", "hold_for_drain"]

log = logging.getLogger("smpckpt.api")

# fast tier -> the tag a drain of this process is copying from it; the lock also keeps the save
# thread's and the drain thread's retention from running at once
_RETENTION = threading.Lock()
_HELD: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """One tiered save, decided before anything is written (identical on every rank but ``folder``), and
    this process's gloo groups for it."""

    nodes: Nodes
    local_path: str  #: this node's fast tier
    folder: str  #: this node's folder of the tag
    seq: int  #: this save's number in the job (1, 2, ...), across restarts
    durable: bool  #: also drained to ``path``
    replicas: int
    streams: tuple[Any, ...] = ()  #: the groups files move over (the first: agreements, the save thread's)
    drain_group: Any = None  #: the drain thread's group

    @property
    def group(self) -> Any:
        """The gloo group of the agreements (``None`` without a process group)."""
        return self.streams[0] if self.streams else None

    def record(self) -> dict[str, Any]:
        """The manifest's ``extra["tier"]``."""
        return {
            "seq": self.seq,
            "durable": self.durable,
            "replicas": self.replicas,
            "nodes": self.nodes.count,
            "local_world_size": self.nodes.local_world_size,
        }


def plan_tier_save(req: SaveRequest, ctx: DistContext) -> TierPlan:
    """(all ranks, the caller's thread) The nodes, the save number, the tag's folders settled, the groups."""
    opts = req.opts
    nodes = ctx.all_ok(lambda: node_layout(ctx, req.process_group, opts.replicas))  # one rank's env fails all
    local = check_local_path(opts.local_path)
    views = gather_views(ctx, nodes, local)

    if newest_complete(ctx, local, views, req.tag) is not None:  # the same answer on every rank
        raise CheckpointExists(f"checkpoint {req.tag!r} is already committed in the fast tier ({local} on its nodes)")

    def decide() -> int:
        if probe_checkpoint(req.url, req.storage_options).state in ("committed", "legacy"):
            raise CheckpointExists(f"{req.url} already holds a committed checkpoint of tag {req.tag!r}")
        # the fast tiers' copies are numbered too (catalog.sequence): this save is numbered after them
        copies = [c.order[0] for view in views for c in view.values() if c.digest is not None]
        saw_sequence(req.root, max(copies, default=0), req.storage_options)
        return 1 + max(tier_seq(views), durable_seq(req.root, req.storage_options))

    seq = ctx.on_coordinator(decide)
    folder = f"{local}/{partial_dirname(req.tag)}"

    def settle() -> None:
        # leftovers of this tag: a killed save, or a copy no surviving node set can complete
        if nodes.is_leader and req.tag in views[ctx.rank]:
            failed = remove_folder(open_fs(folder)[0], folder, folder)  # manifest first, never through a link
            if failed:
                raise CheckpointError(f"{folder}: could not remove the leftovers of an earlier save: {failed[:5]}")

    ctx.all_ok(settle)
    durable = seq % opts.durable_every == 0
    if durable:
        wait_for_drain()  # one drain at a time: the fast tier keeps its tag until it is done
    streams = stream_groups(req.process_group, ctx)
    drain_group = background_group(req.process_group, ctx, "drain")
    return TierPlan(nodes, local, folder, seq, durable, opts.replicas, streams, drain_group)


def save_fast(req: SaveRequest, state: dict[str, Any], extra: dict[str, Any], tier: TierPlan) -> PreparedCommit:
    """(all ranks; ``req.process_group`` runs ``dcp.save``, ``tier.group`` the agreements and
    ``tier.streams`` the transfers) Write, replicate and commit this tag in every node's fast tier; the
    commit every node holds."""
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
    committed = False
    try:
        run_save("partial", req, writer, state, opts, f"saving checkpoint {req.tag!r} to the fast tier {tier.folder}")
        prepared: PreparedCommit = gctx.broadcast_object(writer.prepared)
        manifest = prepared.parsed()
        by_rank: dict[int, list[tuple[str, int]]] = {}
        for f in manifest.files:
            by_rank.setdefault(f.rank, []).append((f.name, f.size))
        transfers = replica_transfers(
            by_rank, world_size=nodes.world_size, local_world_size=nodes.local_world_size, replicas=tier.replicas
        )
        outcome = run_transfers(
            transfers,
            rank=nodes.rank,
            group=tier.streams or tier.group,
            read_folder=tier.folder,
            write_folder=tier.folder,
            sync=opts.sync_files,
        )
        node = nodes.node_of(nodes.rank)
        share = [r for n in nodes.replica_nodes(node, tier.replicas) for r in nodes.ranks_of(n)]
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
        committed = True  # from here on, a node's manifest proves every node's share
        gctx.all_ok(
            lambda: commit_node_copy(tier.folder, prepared, expected, sync=opts.sync_files) if nodes.is_leader else None
        )
    except BaseException:
        if not committed and nodes.is_leader:
            _remove_quietly(tier.folder)
        raise
    if nodes.is_leader:
        retain_fast(tier, req.tag, opts.num_kept_local)
    return prepared


def _remove_quietly(folder: str) -> None:
    try:
        remove_folder(open_fs(folder)[0], folder, folder)
    except FileNotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001 - the save's own error is the one to raise
        log.warning("could not remove the failed fast-tier save's folder %s: %s", folder, exc)


def hold_for_drain(local_path: str, tag: str) -> None:
    """``tag``'s files in this fast tier are about to be drained: retention keeps them until released."""
    with _RETENTION:
        _HELD[local_path] = tag


def retain_fast(tier: TierPlan, just_saved: str | None, keep: int | None, *, release: bool = False) -> None:
    """(leaders) ``num_kept_local`` over this node's fast tier: after a save (never the tag just saved),
    and after a drain (``release``: its tag, held meanwhile, may go now). One lock orders the two, so
    whichever runs last sees the other's outcome: a drained tag never outlives the next retention."""
    with _RETENTION:
        if release:
            _HELD.pop(tier.local_path, None)
        protected = {t for t in (just_saved, _HELD.get(tier.local_path)) if t is not None}
        try:
            removed = retain_local(tier.local_path, scan_local(tier.local_path), keep, protected)
        except Exception as exc:  # noqa: BLE001 - retention never fails a committed save
            log.warning("fast-tier retention in %s failed (nothing else affected): %s", tier.local_path, exc)
            return
    if removed:
        log.info("fast tier %s: kept %s checkpoint(s); removed %s", tier.local_path, keep, removed)
