"""``resume_from_checkpoint(..., local_path=...)``: the newest checkpoint complete across the surviving
fast tiers or committed in ``path``, whichever is newer.

Which rank does what ("all" = every rank; "leader" = the first rank of each node)::

    choose_tier   (all)      the gloo groups (``smpckpt.api._async``); every node's fast tier scanned and gathered
                  (rank 0)   the newest fast-tier tag whose surviving files cover its manifest, against
                             ``path``'s newest committed one (or the tag asked for); the answer broadcast
    fast_reader   (all)      heal: leaders of nodes that lack the chosen copy's metadata or manifest receive
                             them from a node that has them (the metadata first: the manifest commits)
    (load)        (all)      dcp.load with PeerFetchingReader: each node fetches from peers the parts its
                             ranks read and it lacks, then reads its own folder, checksums verified

A fast-tier load that fails (a corrupt part, a peer lost mid-load) falls back to ``path``'s checkpoint,
with a warning, when there is one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any

from smpckpt.api._async import stream_groups
from smpckpt.api._dist import DistContext
from smpckpt.api._resume import ResumeRequest, Target, resolve_target
from smpckpt.api._tiers import FastCandidate, Nodes, gather_views, newest_complete, node_layout
from smpckpt.api.options import check_local_path
from smpckpt.catalog.sequence import saw_sequence
from smpckpt.catalog.tags import partial_dirname
from smpckpt.errors import CheckpointError, CheckpointNotFound
from smpckpt.storage.format._names import MANIFEST_NAME
from smpckpt.storage.tier import PeerFetchingReader, Transfer, run_transfers

__all__ = ["FastSource", "choose_tier", "fast_reader"]

log = logging.getLogger("smpckpt.api")


@dataclasses.dataclass(frozen=True)
class FastSource:
    """The fast-tier copy rank 0 chose, and what every rank needs to load it."""

    candidate: FastCandidate
    heal: tuple[Transfer, ...]  #: metadata and manifest to the leaders of nodes that lack them
    nodes: Nodes
    streams: tuple[Any, ...]  #: this process's gloo groups for the transfers (the first: agreements)

    @property
    def group(self) -> Any:
        return self.streams[0] if self.streams else None


def choose_tier(req: ResumeRequest, ctx: DistContext) -> tuple[Target | None, FastSource | None, Target | None]:
    """(all ranks) The target to load, its fast-tier source (``None``: load from ``path``), and the
    durable target to fall back to."""
    streams = stream_groups(req.process_group, ctx)
    nodes = ctx.all_ok(lambda: node_layout(ctx, req.process_group))  # one rank's env fails all
    local = check_local_path(req.opts.local_path)
    views = gather_views(ctx, nodes, local)
    best = newest_complete(ctx, local, views, req.tag)

    def durable_target() -> Target | None:
        try:
            return resolve_target(req.root, req.tag, req.storage_options)
        except CheckpointNotFound:
            if best is None or req.tag is None:
                raise
            return None  # the tag asked for is uncommitted in path (a drain that did not finish)

    durable = ctx.on_coordinator(durable_target)
    # the same tag in both tiers (tag=...): the fast copy; else whichever was saved later
    if best is None or (req.tag is None and durable is not None and durable.order > best.order):
        if durable is not None:
            durable.seen_by(req.root, req.storage_options)
        return durable, None, None
    folder = f"{local}/{partial_dirname(best.tag)}"  # this node's copy
    target = Target.of(best.tag, folder, best.parsed(), False)
    if durable is not None:
        durable.seen_by(req.root, req.storage_options)
    saw_sequence(req.root, best.order[0], req.storage_options)
    return target, FastSource(best, _heal_transfers(best, nodes), nodes, streams), durable


def _heal_transfers(best: FastCandidate, nodes: Nodes) -> tuple[Transfer, ...]:
    """(rank 0) The chosen copy's metadata, then its manifest, to each node's leader that lacks them."""
    manifest = best.parsed()
    sizes = {manifest.metadata.name: manifest.metadata.size, MANIFEST_NAME: len(best.manifest)}
    out = []
    for name in (manifest.metadata.name, MANIFEST_NAME):
        holders = best.held_by[name]
        for node in range(nodes.count):
            leader = nodes.ranks_of(node)[0]
            if not any(nodes.node_of(r) == node for r in holders):
                out.append(Transfer(name, sizes[name], min(holders), leader))
    return tuple(out)


def fast_reader(req: ResumeRequest, target: Target, fast: FastSource) -> PeerFetchingReader:
    """(all ranks) Nodes that lack the copy's metadata or manifest receive them (agreed across ranks);
    then this rank's reader of the chosen fast-tier copy."""
    gctx, nodes = DistContext(fast.group), fast.nodes
    if fast.heal:
        os.makedirs(target.url, exist_ok=True)
    outcome = run_transfers(
        fast.heal, rank=nodes.rank, group=fast.group, read_folder=target.url, write_folder=target.url, sync=False
    )

    def check() -> None:
        if outcome.errors:
            raise CheckpointError(
                f"sending the fast-tier copy's metadata to a node failed: {'; '.join(outcome.errors)}"
            )

    gctx.all_ok(check)
    return PeerFetchingReader(
        target.url,
        group=fast.group,
        streams=fast.streams,
        ranks=list(range(nodes.world_size)),
        rank=nodes.rank,
        local_world_size=nodes.local_world_size,
        held_by=fast.candidate.held_by,
        verify_checksums=req.opts.verify_checksums,
        allow_pickle=req.opts.allow_pickle,
    )


def fall_back_warning(target: Target, fallback: Target, exc: BaseException) -> None:
    """(all ranks; rank 0 warns) Loading the fast-tier copy failed: say so, and what is loaded instead."""
    message = (
        f"loading checkpoint {target.tag!r} from the fast tier failed ({exc}); resuming from {fallback.url} "
        f"(tag {fallback.tag!r}) in the durable tier instead"
    )
    log.warning(message)
    warnings.warn(message, stacklevel=4)
