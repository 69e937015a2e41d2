"""A Checkpointer's fast tier (:class:`~smpckpt.FastTier`; README, "Tiered checkpoints"): each save into
the nodes' fast tiers (``_fast_save``), every ``durable_every``-th one drained to ``path`` on the
Checkpointer's drain lane (``_drain``), and resumes from either tier (``_fast_resume``). It owns what the
tier remembers between saves (:class:`~smpckpt.api._tiers.TierState`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

from smpckpt.api._args import peer_failures
from smpckpt.api._async import GlooGroups, Lane
from smpckpt.api._dist import DistContext
from smpckpt.api._drain import drain
from smpckpt.api._fast_resume import Loaded, choose_tier, load_tiered
from smpckpt.api._fast_save import TierPlan, plan_tier_save, save_fast
from smpckpt.api._resume import ResumeRequest
from smpckpt.api._save import SaveRequest
from smpckpt.api._tiers import TierState
from smpckpt.api.options import FastTier
from smpckpt.catalog.sequence import SequenceCounter
from smpckpt.catalog.tags import partial_url

__all__ = ["FastTierPart"]

log = logging.getLogger("smpckpt.api")


class FastTierPart:
    """The fast tier of one Checkpointer: its options, its memory between saves, and the Checkpointer's
    gloo groups, save numbers and drain lane it works with."""

    def __init__(self, options: FastTier, groups: GlooGroups, counter: SequenceCounter, drain_lane: Lane) -> None:
        self.options, self.groups, self.counter, self.drain_lane = options, groups, counter, drain_lane
        self.state = TierState()

    def plan(self, req: SaveRequest, ctx: DistContext) -> TierPlan:
        """(all ranks, the caller's thread) What this save is in the fast tier (``_fast_save``)."""
        return plan_tier_save(req, ctx, self)

    def save(self, req: SaveRequest, state: dict[str, Any], extra: dict[str, Any], tier: TierPlan) -> None:
        """(all ranks) The fast tiers, then (every ``durable_every``-th save, or a save whose drain never
        committed) the drain, on the drain lane."""
        started = time.monotonic()
        prepared = save_fast(req, state, extra, tier)
        log.info(
            "saved checkpoint %r to the fast tier %s (save %d, %d replica(s)) in %.2fs%s; phases: %s",
            req.tag,
            tier.local_path,
            tier.seq,
            tier.replicas,
            time.monotonic() - started,
            f"; draining to {req.url}" if tier.durable else "",
            ", ".join(f"{name} {s:.3f}s" for name, s in tier.phases.items()),
        )
        if tier.durable:
            self._drain(req, tier, lambda: drain(req, tier, prepared))
        elif tier.retry is not None:
            retry = tier.retry
            rreq = dataclasses.replace(req, tag=retry.tag, url=partial_url(req.root, retry.tag))
            if DistContext(req.process_group).is_coordinator:
                message = (
                    f"checkpoint {retry.tag!r} (save {retry.seq}) was due for the durable tier and its drain never "
                    f"committed (a job stopped while draining?): draining it to {rreq.url} again, in the background"
                )
                log.warning(message)
                warnings.warn(message, stacklevel=5)
            self._drain(rreq, tier, lambda: drain(rreq, tier, retry.prepared, seq=retry.seq, held_by=retry.held_by))

    def _drain(self, req: SaveRequest, tier: TierPlan, copy: Any) -> None:
        """Hold ``req``'s tag in the fast tier while the drain lane runs ``copy()``."""
        self.state.hold(req.tag)

        def work() -> None:
            try:
                with peer_failures(DistContext(tier.drain_group), f"draining checkpoint {req.tag!r} to {req.url}"):
                    copy()
            finally:
                self.state.release(req.tag)

        self.drain_lane.submit(req.tag, work)

    def resume(self, req: ResumeRequest, ctx: DistContext) -> Loaded | None:
        """(all ranks) The newest checkpoint complete across the fast tiers or committed in ``path``,
        loaded (``_fast_resume``); ``None`` when neither tier holds one."""
        return load_tiered(req, ctx, choose_tier(req, ctx, self), self)
