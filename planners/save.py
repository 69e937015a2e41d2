"""ParallelSavePlanner: TP/PP/DP-aware save planning for ``dcp.save``.

Call order (as ``dcp.save`` drives it; "all" = every rank, "coord" = rank 0 of the group)::

    1. (all)   set_up_planner(state_dict, storage_meta, is_coordinator)
    2. (all)   create_local_plan()            -> only the items this rank writes
    3. (coord) create_global_plan(all_plans)  -> checks replicas, dedups, builds Metadata
    4. (all)   finish_plan(plan)              -> this rank's final plan (from cache when unchanged)
    5. (all)   resolve_data(item)             -> tensor or bytes, called from writer threads
    6. (caller, optional) release_state()     -> drop this save's tensors before keeping the planner

Plain local tensors are mapped to global chunks by their :class:`~smpckpt.ShardSpec`; DTensors carry
their own placement; other values are pickled (``torch.save``) objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import _validate_global_plan, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import Replicate

from smpckpt._gc import gc_paused
from smpckpt.errors import SpecError
from smpckpt.model.layout import ParallelLayout
from smpckpt.model.naming import NameMap
from smpckpt.model.record import METADATA_KEY, LayoutRecord
from smpckpt.model.specs import SpecLike, SpecRules
from smpckpt.planners._cache import PlanCache, structure_signature
from smpckpt.planners._checks import check_replica_digests, check_rules_apply, dedup_plans, gather_ties, replica_digest
from smpckpt.planners._entries import Entry, LayoutScope, ObjectBytes, dtensor_is_owner, tied_entries
from smpckpt.planners._ownership import assign_owners
from smpckpt.planners._replica_values import (
    check_replica_values,
    checked_codes,
    dtensor_values,
    rank_values,
    split_code,
)
from smpckpt.planners._wire import compact

__all__ = ["ParallelSavePlanner", "SaveReport"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveReport:
    """What the last global plan did (filled on the coordinator)."""

    bytes_per_rank: tuple[int, ...]
    items: int
    cached: bool

    @property
    def balance(self) -> float:
        """max / mean of bytes written per rank (1.0 is perfect)."""
        total = sum(self.bytes_per_rank)
        return max(self.bytes_per_rank) / (total / len(self.bytes_per_rank)) if total else 1.0


class ParallelSavePlanner(LayoutScope, SavePlanner):
    """Save planner for plain TP/PP shards, DP replicas, ZeRO-sharded state and DTensors.

    Args:
        layout: the parallel layout of the job saving.
        specs: glob -> :class:`~smpckpt.ShardSpec` rules for plain local shards (first match wins);
            unmatched tensors are replicas within their pipeline stage.
        rank: this rank in the layout; default the process group's rank, else 0 (lets tools and
            simulations plan without a process group).
        name_map: stage-local key -> global key (overrides the ``layers.<i>`` rule of ``pp_layers``).
        process_group: the group ``dcp.save`` runs on (for the default ``rank``).
        rank_local: globs of keys each rank holds for itself (RNG states, per-rank counters). Such keys
            must be rank-unique; they are written by their holder and never deduplicated.
        replica_owner: ``"balanced"`` spreads replicated tensors over their replicas by bytes;
            ``"lowest"`` writes them all from the lowest rank of each group.
        enable_plan_caching: reuse this instance's plans while the state's structure is unchanged.
        dedup_tied: write a tensor held under several keys (tied parameters: transformers ties
            ``lm_head.weight`` to the input embedding) once, under its first key; the checkpoint
            records the others (:attr:`~smpckpt.model.record.LayoutRecord.tied`), our storage writer lists
            them in ``.metadata`` over the same bytes (stock readers load both keys), and our load
            planner fills a destination that holds them apart. ``False`` writes each key's bytes.
        verify_replicas: ranks holding the same piece of a tensor (replicas within a stage, a global
            key two stages hold, and a DTensor's replicated pieces) must hold the same values: each rank sends a 4-byte digest of a sample
            of every tensor, and the coordinator fails the save naming the keys and ranks that differ
            (a TP shard whose spec was forgotten, a stage-local key not renumbered). ``False`` for
            replicas meant to differ. See :mod:`smpckpt.planners._replica_values`.
        cache_scope: what the plan cache reuses (with ``enable_plan_caching``):

            * ``"global"`` (default): an unchanged rank sends an empty plan and the coordinator reuses
              the global plan and metadata it built before (less gathered, no global planning). Every
              rank must then reuse its planner alike.
            * ``"local"``: a rank reuses only its own local plan -- a pure function of its state's
              structure, its rank and the layout -- and sends it in full; the coordinator plans afresh
              at every save. Nothing cached crosses ranks, so any mix of reused and fresh planners is
              correct, and object values (user content, RNG states) may change without a re-plan.

    Every plan and cache lives on the instance (DCP's class-level plan cache is never used: it can hand
    one rank's plan to another when several planners share a process).

    Why reuse stays exact, even across failed saves: :mod:`smpckpt.planners._cache`.
    """

    def __init__(
        self,
        layout: ParallelLayout,
        specs: Mapping[str, SpecLike] | SpecRules | None = None,
        *,
        rank: int | None = None,
        name_map: NameMap | None = None,
        process_group: Any = None,
        rank_local: Sequence[str] = (),
        replica_owner: str = "balanced",
        enable_plan_caching: bool = True,
        cache_scope: Literal["global", "local"] = "global",
        dedup_tied: bool = True,
        verify_replicas: bool = True,
    ) -> None:
        super().__init__()
        self._set_scope(layout, specs, rank, name_map, process_group, rank_local)
        if replica_owner not in ("balanced", "lowest"):
            raise SpecError(f"replica_owner must be 'balanced' or 'lowest', got {replica_owner!r}")
        if cache_scope not in ("global", "local"):
            raise SpecError(f"cache_scope must be 'global' or 'local', got {cache_scope!r}")
        self.replica_owner = replica_owner
        self.enable_plan_caching = enable_plan_caching
        self.cache_scope = cache_scope
        self.dedup_tied = dedup_tied
        self.verify_replicas = verify_replicas
        self.report: SaveReport | None = None
        self.entries: dict[str, Entry] = {}
        self.tied: dict[str, str] = {}
        self._cache = PlanCache(cache_scope if enable_plan_caching else "off")

    # -- 1. set up ---------------------------------------------------------------------------------
    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        """(all ranks, once per save) Resolve this rank's state dict against the layout: global keys
        (PP renaming), global chunks (specs, DTensor placements), objects."""
        self._cache.begin_round(self._rank_arg)
        self.entries, self.mappings = self._resolve(state_dict)
        self.tied = tied_entries(self.entries) if self.dedup_tied else {}
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._object_bytes: dict[str, bytes] = {}

    # -- 2. local plan -----------------------------------------------------------------------------
    @gc_paused()
    def create_local_plan(self) -> SavePlan:
        """(all ranks) Only the items this rank writes (it owns its shards and, by a deterministic
        byte-balanced choice every replica computes alike, some replicas), plus a constant-size
        replica digest; an empty "cached" plan when the structure is unchanged since the last save.

        Every rank runs this at every save: its cost is O(own keys), whatever the world size."""
        object_digests = self._serialise_objects()
        # the signature only serves the plan cache; a planner built per save skips it. The local scope
        # leaves object values out: they change the plan's object digests only (refreshed on a hit).
        signature = None
        if self.enable_plan_caching:
            signature = structure_signature(self, None if self.cache_scope == "local" else object_digests)
        # plain tensors every rank of the stage must agree on (the replica digest's rows), and of them the
        # replicas: those other ranks hold too (ownership and value checks)
        shared = [e for e in self.entries.values() if e.kind == "tensor" and not e.rank_local]
        replicas = [e for e in shared if e.sharded_axes != _SPLIT_OVER_BOTH and e.key not in self.tied]
        checked, codes, fresh = self._replica_values(replicas)
        hit = self._cache.hit(signature, self.rank, object_digests, fresh)
        if hit is not None:
            return hit

        # Tensor.nbytes: numel x itemsize, in one call (a view's, not its storage's)
        replicated = [(e.key, int(e.value.nbytes), e.sharded_axes) for e in replicas]
        owners = assign_owners(self.layout, self.rank, replicated, lowest_rank=self.replica_owner == "lowest")
        items: list[WriteItem] = []
        properties: dict[tuple[Any, ...], TensorProperties] = {}
        objects: dict[str, str] = {}
        mappings: dict[str, Any] = {}
        original: dict[str, tuple[int, ...]] = {}
        for entry in self.entries.values():
            if entry.key in self.tied:  # its bytes are its first key's; only its name is recorded
                mappings[entry.key] = self.mappings[entry.key]
                continue
            if entry.kind == "object":
                items.append(WriteItem(index=MetadataIndex(entry.key), type=WriteItemType.BYTE_IO))
                objects[entry.key] = object_digests[entry.key]
            elif not self._writes(entry, owners) or _carries_no_data(entry):
                continue
            else:
                items.append(_tensor_item(entry, properties))
            mappings[entry.key] = self.mappings[entry.key]
            if entry.original_global_shape is not None:
                original[entry.key] = entry.original_global_shape
        planner_data: dict[str, Any] = {
            "rank": self.rank,
            "matched": sum(1 for e in self.entries.values() if e.specs),  # keys a spec rule matched
            "digest": replica_digest(shared, self.tied),
            "objects": objects,
            "mappings": mappings,
            "original_shapes": original,
            "tied": dict(self.tied),
            **fresh,
        }
        coords = self.layout.coords(self.rank)
        if fresh["values"] is not None and coords.tp == 0 and coords.dp == 0:  # one key list per stage
            planner_data["value_keys"] = (tuple(e.key for e in checked), codes)
        plan = compact(SavePlan(items, planner_data=planner_data))  # gathered on the coordinator
        self._cache.remember(signature, plan)
        return plan

    def _replica_values(self, replicas: list[Entry]) -> tuple[list[Entry], bytes, dict[str, bytes | None]]:
        """The tensors whose values other ranks hold too (sorted by key), their split codes, and what
        this rank sends about their values (``planner_data`` fields; ``None``: nothing to compare).
        Which tensors those are follows from the layout alone (``_replica_values.checked_codes``): a
        rank of a one-rank stage digests none."""
        if not self.verify_replicas:
            return [], b"", {"values": None, "dtensor_values": None}
        wanted = checked_codes(self.layout)
        checked = [e for e in replicas if split_code(e.sharded_axes) in wanted]
        checked.sort(key=_by_key)
        codes = bytes(split_code(e.sharded_axes) for e in checked)
        values = rank_values(self.layout, self.rank, [e.value for e in checked], codes) if wanted else None
        return checked, codes, {"values": values, "dtensor_values": self._dtensor_values()}

    def _dtensor_values(self) -> bytes | None:
        """The value digests of the DTensor pieces this rank holds that other ranks may hold too (checked
        by piece at the coordinator: a DTensor's placements, not the layout, say which ranks hold the
        same piece); ``None`` when it holds no such piece."""
        pieces = []
        world = dist.get_world_size(self.process_group) if dist.is_available() and dist.is_initialized() else 1
        for e in self.entries.values():
            if e.kind == "dtensor" and not e.rank_local and e.chunk is not None and _replicated(e, world):
                pieces.append((e.key, e.chunk.offsets, e.chunk.sizes, e.value))
        return dtensor_values(pieces) if pieces else None

    def _writes(self, entry: Entry, owners: Mapping[str, int]) -> bool:
        """Whether this rank writes its piece of a tensor entry (before the empty-piece check)."""
        if entry.kind == "dtensor":
            return dtensor_is_owner(entry)
        return entry.rank_local or owners.get(entry.key, self.rank) == self.rank

    def _serialise_objects(self) -> dict[str, str]:
        """Serialise this rank's objects once (``resolve_data`` hands out these bytes); their digests."""
        digests: dict[str, str] = {}
        for entry in self.entries.values():
            if entry.kind != "object":
                continue
            if isinstance(entry.value, ObjectBytes):
                raw = bytes(entry.value)
            else:
                buf = io.BytesIO()
                torch.save(entry.value, buf)
                raw = buf.getvalue()
            self._object_bytes[entry.key] = raw
            digests[entry.key] = hashlib.sha1(raw).hexdigest()
        return digests

    # -- 3. global plan (coordinator) --------------------------------------------------------------
    @gc_paused()
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Compare replica digests per stage, dedup objects, build the ``Metadata``
        (with the :class:`~smpckpt.model.record.LayoutRecord`) and check that the chunks tile every tensor."""
        reused = self._cache.reuse_global(all_plans)
        if reused is not None:
            check_replica_values(all_plans, self._cache.all_plans or [], self.layout)
            plans, empty, metadata = reused
            self.report = dataclasses.replace(self.report, cached=True) if self.report else None
            self.global_plan, self.metadata = plans, metadata
            return empty, metadata
        full = self._cache.substitute(all_plans)
        self.layout.check_world_size(len(full), "dcp.save's world")
        check_rules_apply(self.rules, full)
        check_replica_digests(self.layout, full)
        check_replica_values(all_plans, full, self.layout)  # this save's values; cached plans' key lists
        tied = gather_ties(full)
        plans, metadata = create_default_global_save_plan(dedup_plans(full))
        mappings: dict[str, Any] = {}
        original: dict[str, tuple[int, ...]] = {}
        for plan in full:
            mappings.update(plan.planner_data["mappings"])
            original.update(plan.planner_data.get("original_shapes", {}))
        record = LayoutRecord(
            self.layout, tuple(self.rules.to_records()), self._rank_local_globs, original_shapes=original, tied=tied
        )
        mappings[METADATA_KEY] = record.to_json()
        metadata = dataclasses.replace(metadata, planner_data=mappings)
        errors = _validate_global_plan(plans, metadata)
        if errors:
            shown = "; ".join(errors[:5])
            raise SpecError(
                f"the ranks' shards do not tile their global tensors ({len(errors)} problems): {shown}. "
                "Check that every rank gives the same specs and sizes."
            )
        # held back until this rank's finish_plan: only a global plan every rank received may be reused
        gen = self._cache.stage_global(full, plans, metadata)
        plans = [compact(dataclasses.replace(p, planner_data=gen)) for p in plans]  # scattered to the ranks
        if plans:
            # the storage writer's coordinator reads the record here (full mode lays tensors out in
            # their original shapes); one copy, on the coordinator's own plan
            plans[0] = dataclasses.replace(plans[0], planner_data={**(gen or {}), METADATA_KEY: record.to_json()})
        per_rank = tuple(sum(i.tensor_storage_size() or 0 for i in p.items) for p in plans)
        self.report = SaveReport(per_rank, items=sum(len(p.items) for p in plans), cached=False)
        logger.info("save plan: %d items, max/mean bytes per rank %.2f", self.report.items, self.report.balance)
        self.global_plan, self.metadata = plans, metadata
        return plans, metadata

    # -- 4. finish ---------------------------------------------------------------------------------
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """(all ranks) This rank's final plan: the coordinator's, or this instance's cached one. With the
        "global" cache, a usable plan promotes what this round staged (this rank's local plan; on the
        coordinator, the global plan) under the plan's generation."""
        plan = self._cache.finish(new_plan, self.rank)
        self.plan = plan
        return plan

    def release_state(self, *, scope: bool = False) -> None:
        """(all ranks, after ``dcp.save`` returned or raised) Drop this save's state dict, tensors, object
        bytes, final plan and (coordinator) metadata, so a planner kept for reuse pins no memory between
        saves; the plan caches stay. With ``scope``, also drop the process group and name map: call
        :meth:`rescope` before the next save."""
        self.entries = {}
        self.mappings = {}
        self.state_dict = {}
        self._object_bytes = {}
        self.global_plan = []
        for name in ("plan", "metadata"):
            self.__dict__.pop(name, None)
        if scope:
            self.process_group = None
            self.name_map = None

    def rescope(
        self,
        layout: ParallelLayout,
        specs: Mapping[str, SpecLike] | SpecRules | None = None,
        *,
        rank: int | None = None,
        name_map: NameMap | None = None,
        process_group: Any = None,
        rank_local: Sequence[str] = (),
    ) -> None:
        """(all ranks, between saves) Plan the next saves for this scope (the constructor's arguments).
        The local plan cache stays -- its signature holds the layout, rank and every key's geometry, so a
        plan is reused only where it is still exact -- while a "global" cache is dropped: it also
        depends on who the coordinator is."""
        self._set_scope(layout, specs, rank, name_map, process_group, rank_local)
        if self.cache_scope == "global":
            self._cache.drop()

    # -- 5. data -----------------------------------------------------------------------------------
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """(all ranks, from the storage writer's threads) The tensor or object bytes of one item."""
        entry = self.entries.get(write_item.index.fqn)
        if entry is None:
            raise SpecError(f"rank {self.rank} was asked to write {write_item.index.fqn!r}, which it does not hold")
        if entry.kind == "object":
            return io.BytesIO(self._object_bytes[entry.key])
        return entry.value


#: a tensor split over both TP and DP is held by one rank: no replica to assign
_SPLIT_OVER_BOTH = frozenset({"tp", "dp"})


def _by_key(entry: Entry) -> str:
    return entry.key


def _replicated(entry: Entry, world: int) -> bool:
    """Whether other ranks may hold this DTensor piece too: a ``Replicate`` mesh dim, or a mesh that
    spans only part of the job (each copy of it holds the same pieces)."""
    dt = entry.dtensor
    if dt is None:
        return False
    return any(isinstance(p, Replicate) for p in dt.placements) or dt.device_mesh.size() < world


def _carries_no_data(entry: Entry) -> bool:
    """An empty piece of a non-empty tensor (an uneven split giving a rank nothing) is not written.

    Its offset can coincide with a neighbour's real chunk, and it adds nothing to the checkpoint. An
    empty *global* tensor is still written once, so its key and shape are recorded.
    """
    chunk, shape = entry.chunk, entry.global_shape
    if chunk is None or shape is None:
        return False
    return math.prod(chunk.sizes) == 0 and math.prod(shape) != 0


def _tensor_item(entry: Entry, properties: dict[tuple[Any, ...], TensorProperties]) -> WriteItem:
    """The write item of a tensor entry; ``properties`` shares one ``TensorProperties`` per distinct
    value among a plan's items (building one per item was ~1/8 of a local plan's time)."""
    chunk, shape = entry.chunk, entry.global_shape
    if chunk is None or shape is None:
        raise SpecError(f"{entry.key}: tensor entry without a chunk")
    whole = entry.kind == "tensor" and not entry.sharded_axes
    value = entry.value
    # the fields create_from_tensor reads (memory_format is always contiguous_format there)
    fields = (value.dtype, value.layout, value.requires_grad, value.is_pinned())
    props = properties.get(fields)
    if props is None:
        props = properties[fields] = TensorProperties.create_from_tensor(value)
    return WriteItem(
        index=MetadataIndex(entry.key, chunk.offsets),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=shape),
    )
